"""Replaying captured rollouts (``rollout.source=records``): proxy records with rewards, trained on
off-policy against their recorded sampling log-probs."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections import Counter
from pathlib import Path
from typing import Sequence

from mosaic.capture.reconstruct import reconstruct_rollout
from mosaic.capture.records import CallRecord, RecordError, load_records
from mosaic.config.harness import HarnessConfig
from mosaic.trace import Trajectory
from mosaic.trace.graph import TraceError
from mosaic.train.external import reconstruction_rules, unscorable

__all__ = ["RecordsReplay"]


class RecordsReplay:
    """Rollouts captured earlier (``rollout.source=records``): proxy records with rewards, replayed off-policy.

    Every rewarded rollout of ``rollout.records`` is rebuilt once (the same rules as the live source);
    rollouts that cannot be rebuilt, lack a reward, or lack sampling log-probs on a sampled token are
    dropped and counted. Groups (``group_id``) are visited in a seeded order, ``train.batch_tasks`` per
    step, epoch after epoch. The PPO ratio is taken against the **recorded** sampling log-probs, so it is
    the importance ratio of the current policy to the one that sampled (clipped as usual; the
    ``actor/ratio_*`` metrics show how far off-policy the data is).
    """

    live_scorer = None  # (a RolloutSource: nothing is scored while replaying)

    def __init__(self, cfg):
        self.cfg = cfg
        hcfg: HarnessConfig = cfg.harness
        self.rules = reconstruction_rules(hcfg)
        path = Path(cfg.rollout.records)
        if not path.exists():
            raise FileNotFoundError(f"rollout.records: {path} does not exist")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # counted below instead
            try:
                calls, rewards = load_records(path, lenient=True)
            except RecordError as exc:
                raise ValueError(f"rollout.records: {exc}") from None
        by: dict[str, list[CallRecord]] = {}
        for c in calls:
            by.setdefault(c.rollout_id, []).append(c)
        self.dropped: Counter = Counter()
        groups: dict[str, list[Trajectory]] = {}
        for rid, cs in by.items():
            rw = rewards.get(rid)
            if rw is None:
                self.dropped["no_reward"] += 1
                continue
            try:
                t = reconstruct_rollout(cs, rw, self.rules, rollout_id=rid)
            except (TraceError, ValueError, KeyError, IndexError):
                t = None
            if t is None or unscorable(t) is not None:
                self.dropped["unbuildable"] += 1
                continue
            if any(c.ok and len(c.logprobs) != len(c.completion_ids) for c in cs):  # no importance ratio
                self.dropped["no_logprobs"] += 1
                continue
            groups.setdefault(t.group_id, []).append(t)
        if not groups:
            raise ValueError(f"rollout.records: no usable rollout in {path} "
                             f"(dropped: {dict(self.dropped) or 'no call records'})")
        self.group_ids = sorted(groups)
        self.groups = groups
        self._order_cache: dict[int, list[str]] = {}

    @property
    def n_groups(self) -> int:
        return len(self.group_ids)

    def _order(self, epoch: int) -> list[str]:
        if epoch not in self._order_cache:
            order = list(self.group_ids)
            random.Random(f"{self.cfg.train.seed}/replay/{epoch}").shuffle(order)
            self._order_cache = {epoch: order}
        return self._order_cache[epoch]

    def collect(self, tasks: Sequence, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The groups of step ``step`` (``tasks`` is ignored: the records are the tasks)."""
        B, n = self.cfg.train.batch_tasks, self.n_groups
        picked: list[str] = []
        for k in range(step * B, (step + 1) * B):
            epoch, pos = divmod(k, n)
            g = self._order(epoch)[pos]
            if g not in picked:
                picked.append(g)
        trajs = [t for g in picked for t in self.groups[g]]
        m = {f"rollout/dropped/{r}": float(v) for r, v in self.dropped.items()}
        m.update({"rollout/replayed": float(len(trajs)), "train/tasks": float(len(picked))})
        return trajs, m

    def hold(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
