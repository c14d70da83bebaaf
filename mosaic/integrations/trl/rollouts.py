"""Where the TRL trainer's multi-session rollouts come from, and the prompt dataset TRL samples from.

No TRL here. A rollout source has ``collect(rows, step, model, tokenizer, *, temperature, top_p, seed)``:
``rows`` is this rank's share of the generation batch as ``(task, sample)`` pairs (``sample``: the
row's number within its task's group over the whole batch, see
:func:`~mosaic.integrations.trl.batch.sample_indices`); it returns one validated
:class:`~mosaic.trace.Trajectory` per row, in order, with ``group_id`` naming the task's group.

- :class:`HarnessRollouts`: the built-in harness (compaction, sub-agents, resets; ``harness.*`` of a Mosaic
  config) with a batched KV-cache local policy over the model being trained (and reset mode's partner:
  the scripted expert, or a frozen warm start given as ``partner_model``).
- :class:`RecordedRollouts`: trajectories from a ``.jsonl`` / ``.parquet`` file (the same batch every
  time: the cross-engine and multi-process tests train on it).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Protocol, Sequence

from mosaic.config.harness import HarnessConfig
from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.envs.splits import Split
from mosaic.trace.graph import Trajectory
from mosaic.trace.storage import load_trajectories
from mosaic.train.setup import chat_format, partner_for

__all__ = ["RowSource", "HarnessRollouts", "RecordedRollouts", "task_dataset"]


class RowSource(Protocol):
    """TRL's side of the rollout seam: TRL hands each rank its share of prompt rows, so a source here
    collects one trajectory per ``(task, sample)`` row with the live model (the trainer's
    :class:`mosaic.train.sources.RolloutSource` collects whole groups per step instead)."""

    def task(self, task_id: str): ...

    def collect(self, rows: Sequence[tuple], step: int, model, tokenizer, *, temperature: float, top_p: float,
                seed: int) -> list[Trajectory]: ...  # fmt: skip


def task_dataset(tasks: Sequence):
    """A ``datasets.Dataset`` TRL samples prompts from: ``prompt`` (the question), ``task_id``."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [t.question for t in tasks], "task_id": [t.id for t in tasks]})


class HarnessRollouts:
    """The built-in multi-session harness on ``split``'s deep-search world, sampling from the live model."""

    def __init__(self, split: Split, harness: HarnessConfig, *, batch_size: int = 64, partner_model=None):
        if not isinstance(split, Split):  # (a ServiceSplit: its backend is not wired into this path)
            raise ValueError(f"HarnessRollouts plays the deep-search family, not a {type(split).__name__} "
                             "(data.family=service trains with mosaic train or verl's mosaic_agent loop)")
        self.split = split
        self.env = DeepSearchEnv(split)
        self.harness_cfg = harness
        if harness.partner == "frozen" and partner_model is None:
            raise ValueError("harness.partner='frozen' plays reset mode's second role from a frozen copy of the warm "
                             "start: pass it as partner_model (mosaic.train.setup.frozen_copy(model) before training)")
        self.partner_model = partner_model if harness.partner == "frozen" else None
        self.batch_size = batch_size
        self.tasks = {t.id: t for t in split.tasks}
        self._chat = None

    def task(self, task_id: str):
        """The split's task ``task_id`` (a dataset row names its task by id)."""
        try:
            return self.tasks[task_id]
        except KeyError:
            raise ValueError(f"task {task_id!r} is not in the {self.split.config.split} split") from None

    def collect(self, rows, step, model, tokenizer, *, temperature, top_p, seed):
        if self._chat is None:
            self._chat = chat_format(tokenizer)
        # The harness wants one id per run: a row is run as its own task (id + sample), then renamed.
        runs = [dataclasses.replace(task, id=f"{task.id}#{j}") for task, j in rows]
        was_training = model.training  # (the policy puts the model in eval mode; TRL's step needs it back)
        policy = LocalPolicy(model, tokenizer, LocalPolicyConfig(temperature=temperature, top_p=top_p,
                                                                 max_batch_size=self.batch_size, seed=seed))
        harness = Harness(policy, self._chat, self.env, self.harness_cfg,
                          partner=self._partner(runs, tokenizer, temperature=temperature, top_p=top_p, seed=seed))
        try:
            trajs = harness.run(runs, group_size=1, seed=seed, step=step)
        finally:
            model.train(was_training)
        for t, (task, j) in zip(trajs, rows):
            t.task_id, t.group_id, t.id = task.id, f"{step}/{task.id}", f"{step}/{task.id}/{j}"
        return trajs

    def _partner(self, runs, tokenizer, *, temperature, top_p, seed):
        """Who plays reset mode's second role (``harness.partner``): None (the live model), the scripted
        expert over this batch's tasks, or the local sampler over the frozen warm start."""
        return partner_for(self.harness_cfg.partner, tokenizer, runs, self.partner_model, seed=seed,
                           temperature=temperature, top_p=top_p, batch_size=self.batch_size)


class RecordedRollouts:
    """Recorded trajectories: row ``(task, j)`` gets the ``j``-th trajectory of that task in the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.by_task: dict[str, list[Trajectory]] = defaultdict(list)
        for t in load_trajectories(self.path):
            self.by_task[t.task_id].append(t)
        if not self.by_task:
            raise ValueError(f"{self.path}: no trajectories")

    def tasks(self) -> list:
        """One stand-in task per recorded task (its id; the question is the id: only the id is looked up)."""
        return [_RecordedTask(tid, tid) for tid in self.by_task]

    def task(self, task_id: str):
        if task_id not in self.by_task:
            raise ValueError(f"{self.path}: no trajectory of task {task_id!r}")
        return _RecordedTask(task_id, task_id)

    def collect(self, rows, step, model, tokenizer, *, temperature, top_p, seed):
        out = []
        for task, j in rows:
            have = self.by_task.get(task.id, [])
            if j >= len(have):
                raise ValueError(f"{self.path}: row asks for sample {j} of task {task.id!r}, "
                                 f"the file has {len(have)}")  # fmt: skip
            out.append(copy.deepcopy(have[j]))
        return out


@dataclasses.dataclass(frozen=True)
class _RecordedTask:
    id: str
    question: str
