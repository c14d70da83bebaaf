"""Export tasks to verl's Parquet layout and read them back.

One row per task:

- ``data_source``: ``"mosaic/deepsearch"``
- ``prompt``: chat messages ``[{"role": "system", ...}, {"role": "user", ...}]``
- ``ability``: ``"deep-search"``
- ``reward_model``: ``{"style": "rule", "ground_truth": answer}``
- ``extra_info``: ``{"index", "split", "hops", "task_id", "question", "start", "style",
  "gold_chain": [{doc_id, title, relation, target, query, relation_name, target_id}, ...]}``

The prompt here is a neutral default; the harness may build its own from
``extra_info.question``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from mosaic.envs.questions import Hop, Task
import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "mosaic/deepsearch"
ABILITY = "deep-search"
SYSTEM_PROMPT = (
    "You answer questions about a fictional world by searching its encyclopedia. "
    "Call the search tool with short queries (an entity name plus a relation word works best). "
    "Each question needs several searches, one per step of its chain. "
    "When you know the answer, reply with <answer>NAME</answer>, giving the entity's full name."
)


def build_prompt(task: Task, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": task.question}]


def task_to_row(task: Task, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": build_prompt(task),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": task.answer},
        "extra_info": {
            "index": index, "split": task.split, "hops": task.hops, "task_id": task.id,
            "question": task.question, "start": task.start, "style": task.style,
            "gold_chain": [asdict(h) for h in task.gold_chain],
        },
    }


def row_to_task(row: dict) -> Task:
    info = row["extra_info"]
    return Task(id=info["task_id"], question=info["question"],
                answer=row["reward_model"]["ground_truth"], hops=int(info["hops"]),
                split=info["split"], gold_chain=[Hop(**h) for h in info["gold_chain"]],
                start=info["start"], style=info["style"])


def export_parquet(tasks: list[Task], path: str | Path) -> Path:
    """Write ``tasks`` as a verl-layout Parquet file; returns the path."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([task_to_row(t, i) for i, t in enumerate(tasks)])
    pq.write_table(table, path)
    return path


def read_rows(path: str | Path) -> list[dict]:

    return pq.read_table(path).to_pylist()


def load_parquet(path: str | Path) -> list[Task]:
    """Read a file written by :func:`export_parquet` back into tasks (same order)."""
    rows = read_rows(path)
    missing = {"data_source", "prompt", "ability", "reward_model", "extra_info"} - set(rows[0] if rows else {})
    if rows and missing:
        raise ValueError(f"{path}: not a verl-layout file, missing columns {sorted(missing)}")
    return [row_to_task(r) for r in rows]
