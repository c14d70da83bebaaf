"""Replaying captured rollouts (``rollout.source=records``): proxy records with rewards, trained on
off-policy against their recorded sampling log-probs."""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Sequence

from mosaic.capture.reconstruct import reconstruct_rollout
from mosaic.capture.records import CallRecord, RecordError, read_records
from mosaic.config.harness import HarnessConfig
from mosaic.trace import Trajectory, ids_outside
from mosaic.trace.graph import TraceError
from mosaic.train.external import DROPS_FILE, reconstruction_rules, unscorable

__all__ = ["RecordsReplay"]


def _warm_start_tokenizer(cfg):
    """The tokenizer of the run's warm start when it is a model on disk (``model.source`` base or dir); else
    None (compactions' history tails then stay in their prompts, flagged)."""
    from mosaic.agent.tokenizer import load_tokenizer
    from mosaic.train.setup import base_model_dir

    try:
        m = cfg.model
        path = base_model_dir(m.embedded_preset, m.base) if m.source == "base" else m.path if m.source == "dir" else None
        return load_tokenizer(path) if path else None
    except (OSError, ValueError):
        return None


class RecordsReplay:
    """Rollouts captured earlier (``rollout.source=records``): proxy records with rewards, replayed off-policy.

    Every rewarded rollout of ``rollout.records`` is rebuilt once (the same rules as the live source);
    rollouts that cannot be rebuilt, lack a reward, or lack sampling log-probs on a sampled token are
    dropped, counted and named in ``self.report`` (the drop report ``mosaic proxy export`` prints, with
    records that have a bad field as ``bad_record``). Groups (``group_id``) are visited in a seeded order, ``train.batch_tasks`` per
    step, epoch after epoch. The PPO ratio is taken against the **recorded** sampling log-probs, so it is
    the importance ratio of the current policy to the one that sampled (clipped as usual; the
    ``actor/ratio_*`` metrics show how far off-policy the data is).
    """

    live_scorer = None  # (a RolloutSource: nothing is scored while replaying)

    def __init__(self, cfg, tokenizer=None):
        self.cfg = cfg
        hcfg: HarnessConfig = cfg.harness
        # the served model's tokenizer locates a compaction's history tail as the live source does
        self.rules = reconstruction_rules(hcfg, tokenizer if tokenizer is not None else _warm_start_tokenizer(cfg))
        path = Path(cfg.rollout.records)
        if not path.exists():
            raise FileNotFoundError(f"rollout.records: {path} does not exist")
        try:
            calls, rewards, self.report = read_records(path)
        except RecordError as exc:
            raise ValueError(f"rollout.records: {exc}") from None
        by: dict[str, list[CallRecord]] = {}
        for c in calls:
            by.setdefault(c.rollout_id, []).append(c)
        groups: dict[str, list[Trajectory]] = {}
        for rid, cs in by.items():
            t, reason, why = self._rebuild(rid, cs, rewards.get(rid))
            if t is None:
                self.report.drop(rid, reason, why)
                continue
            groups.setdefault(t.group_id, []).append(t)
        for rid in rewards.keys() - by.keys():
            self.report.drop(rid, "no_calls", "a reward but no call record")
        self.dropped: Counter = self.report.counts()
        if not groups:
            raise ValueError(f"rollout.records: no usable rollout in {path} "
                             f"(dropped: {self.report.summary() if self.report.dropped else 'no call records'})")
        self.group_ids = sorted(groups)
        self.groups = groups
        self._order_cache: dict[int, list[str]] = {}

    def _rebuild(self, rid: str, cs: list[CallRecord], rw) -> tuple[Trajectory | None, str, str]:
        """One rollout's trajectory, or (None, reason, why) when it is dropped."""
        if rw is None:
            return None, "no_reward", "no reward posted"
        try:
            t = reconstruct_rollout(cs, rw, self.rules, rollout_id=rid)
            why = "no usable call" if t is None else unscorable(t)
        except (TraceError, ValueError, KeyError, IndexError) as exc:
            t, why = None, f"{type(exc).__name__}: {exc}"[:500]
        if why is not None:
            return None, "unbuildable", why
        if any(c.ok and len(c.logprobs) != len(c.completion_ids) for c in cs):  # no importance ratio
            return None, "no_logprobs", "a sampled call has no log-probs"
        if isinstance(rw.meta.get("env"), dict):  # the service family's outcome, as the trainer recorded it
            t.meta["env"] = dict(rw.meta["env"])
        return t, "", ""

    def drop_outside_vocab(self, vocab_size: int) -> int:
        """Drop (as ``bad_token_ids``, counted and named like every drop) the rollouts holding a token id
        the model has no embedding for (records of another model's tokenizer, or edited); how many.
        Nothing left is a ValueError naming the first."""
        n = 0
        for g, trajs in list(self.groups.items()):
            keep = []
            for t in trajs:
                why = ids_outside(t, vocab_size)
                if why:
                    self.report.drop(t.id, "bad_token_ids", why)
                    n += 1
                else:
                    keep.append(t)
            if keep:
                self.groups[g] = keep
            else:
                del self.groups[g]
        if n:
            self.dropped = self.report.counts()
            self.group_ids = sorted(self.groups)
            self._order_cache = {}
        if not self.groups:
            raise ValueError(f"rollout.records: no usable rollout in {self.cfg.rollout.records} "
                             f"(dropped: {self.report.summary()})")
        return n

    def write_drops(self, run_dir: str | os.PathLike) -> None:
        """Every dropped rollout, one JSON line each, in ``RUN_DIR/drops.jsonl`` (as the live source does)."""
        if self.report.dropped:
            with open(Path(run_dir) / DROPS_FILE, "a") as f:
                f.writelines(json.dumps({"step": 0, **row}) + "\n" for row in self.report.rows())

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
