"""Export tasks to verl's Parquet layout and read them back.

One row per task:

- ``data_source``: ``"mosaic/deepsearch"``
- ``prompt``: chat messages ``[{"role": "system", ...}, {"role": "user", ...}]``
- ``ability``: ``"deep-search"``
- ``reward_model``: ``{"style": "rule", "ground_truth": answer}``
- ``agent_name``: ``"mosaic_agent"``, the verl agent loop that runs the Mosaic harness on the row
  (:mod:`mosaic.integrations.verl.agent_loop`; verl reads this column to pick a loop per row)
- ``extra_info``: ``{"index", "split", "hops", "task_id", "question", "start", "style",
  "gold_chain": [{doc_id, title, relation, target, query, relation_name, target_id}, ...],
  "tools_kwargs": {"split_config": JSON}}``; verl's dataset passes ``extra_info.tools_kwargs`` to
  the agent loop, which rebuilds the row's world and search index from the split's full
  :class:`~mosaic.envs.splits.SplitConfig` (JSON text: Parquet would turn its int/float pairs into floats)

The prompt here is a neutral default; the harness may build its own from
``extra_info.question``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

from mosaic.envs.questions import Hop, Task
from mosaic.envs.splits import SplitConfig, WorldConfig
import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "mosaic/deepsearch"
ABILITY = "deep-search"
AGENT_NAME = "mosaic_agent"  # == mosaic.integrations.verl.AGENT_NAME (that package may not import here)
SYSTEM_PROMPT = (
    "You answer questions about a fictional world by searching its encyclopedia. "
    "Call the search tool with short queries (an entity name plus a relation word works best). "
    "Each question needs several searches, one per step of its chain. "
    "When you know the answer, reply with <answer>NAME</answer>, giving the entity's full name."
)


def build_prompt(task: Task, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": task.question}]


def task_to_row(task: Task, index: int, split_config: SplitConfig | None = None) -> dict:
    """One verl row; ``split_config``: the config the task's split was generated with (its world)."""
    cfg = json.dumps(dataclasses.asdict(split_config), sort_keys=True) if split_config is not None else ""
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": build_prompt(task),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": task.answer},
        "extra_info": {
            "index": index, "split": task.split, "hops": task.hops, "task_id": task.id,
            "question": task.question, "start": task.start, "style": task.style,
            "gold_chain": [asdict(h) for h in task.gold_chain],
            "tools_kwargs": {"split_config": cfg},
        },
    }


def row_to_task(row: dict) -> Task:
    info = row["extra_info"]
    return Task(id=info["task_id"], question=info["question"],
                answer=row["reward_model"]["ground_truth"], hops=int(info["hops"]),
                split=info["split"], gold_chain=[Hop(**h) for h in info["gold_chain"]],
                start=info["start"], style=info["style"])


def export_parquet(tasks: list, path: str | Path, *, split_config=None) -> Path:
    """Write ``tasks`` as a verl-layout Parquet file; returns the path. ``split_config``: the config
    the tasks' split was generated with, so verl's agent loop can rebuild their world (empty if None).
    Service episodes (with their :class:`~mosaic.envs.service.ServiceConfig`, required) get the service
    family's rows (:mod:`mosaic.envs.service.export`)."""
    from mosaic.envs.service.world import Episode, ServiceConfig

    path = Path(path)
    if tasks and all(isinstance(t, Episode) for t in tasks):
        if not isinstance(split_config, ServiceConfig):
            raise ValueError("service episodes are exported with their ServiceConfig (split_config=)")
        from mosaic.envs.service.export import episode_to_row

        rows = [episode_to_row(e, i, split_config) for i, e in enumerate(tasks)]
    elif any(isinstance(t, Episode) for t in tasks):
        raise ValueError("export_parquet: one family per file (deep-search tasks and service episodes are mixed)")
    else:
        rows = [task_to_row(t, i, split_config) for i, t in enumerate(tasks)]
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path)
    return path


def split_config_from_json(text: str) -> SplitConfig:
    """The :class:`SplitConfig` stored by :func:`task_to_row` (``extra_info.tools_kwargs.split_config``)."""
    if not text:
        raise ValueError("tools_kwargs.split_config is empty: export with export_parquet(..., split_config=...)")
    d = json.loads(text)
    wfields = {f.name: f for f in dataclasses.fields(WorldConfig)}
    world = {k: tuple(v) if isinstance(v, list) else v for k, v in d.pop("world").items() if k in wfields}
    d["hop_mix"] = tuple((int(h), float(w)) for h, w in d["hop_mix"])
    return SplitConfig(world=WorldConfig(**world), **d)


def read_rows(path: str | Path) -> list[dict]:

    return pq.read_table(path).to_pylist()


def load_parquet(path: str | Path) -> list:
    """Read a file written by :func:`export_parquet` back into tasks (same order): deep-search
    :class:`Task` objects, or the service family's episodes (regenerated from the rows' configs)."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: holds no rows")
    missing = {"data_source", "prompt", "ability", "reward_model", "extra_info"} - set(rows[0])
    if missing:
        raise ValueError(f"{path}: not a verl-layout file, missing columns {sorted(missing)}")
    from mosaic.envs.service.export import DATA_SOURCE as SERVICE_SOURCE, row_episode

    sources = {r["data_source"] for r in rows}
    if SERVICE_SOURCE in sources:
        if len(sources) > 1:
            raise ValueError(f"{path}: rows of several families ({sorted(sources)}); one family per file")
        return [row_episode(r)[0] for r in rows]
    return [row_to_task(r) for r in rows]
