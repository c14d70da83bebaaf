"""Where a step's rollouts come from: one seam, :class:`RolloutSource`, for every ``rollout.source``.

- ``builtin`` — :class:`HarnessRollouts`: the built-in harness drives the local policy in-process
  (B tasks × G samples), optionally scoring session states off the rollout's KV cache as sessions
  close (``algo.score_live``);
- ``harness`` — :class:`mosaic.train.external.ExternalRollouts`: any agent harness, run against the
  served policy through the recording proxy, graphs rebuilt from the records;
- ``records`` — :class:`mosaic.train.replay.RecordsReplay`: captured rollouts replayed off-policy.

The trainer (:func:`mosaic.train.rl.rl_step`) knows only this protocol: it collects, scores and
updates inside :meth:`RolloutSource.hold`, and closes the source at the end of the run. An engine
integration that brings its own rollouts implements the same three methods.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol, Sequence, runtime_checkable

from mosaic.agent.episode import make_env
from mosaic.agent.harness import Harness
from mosaic.config.loader import Config
from mosaic.core.estimators import get_estimator
from mosaic.trace import Trajectory
from mosaic.train.scorer import LiveScorer
from mosaic.train.setup import frozen_copy, partner_policy, sampling_policy

__all__ = ["RolloutSource", "HarnessRollouts", "open_source"]


@runtime_checkable
class RolloutSource(Protocol):
    """A source of training rollouts.

    ``live_scorer``: the scorer that already scored the last :meth:`collect`'s session states while
    they were generated (the built-in harness with ``algo.score_live``), or None: the trainer then
    scores them after the rollout.
    """

    live_scorer: LiveScorer | None

    def collect(self, tasks: Sequence, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Step ``step``'s trajectories (for ``tasks``; a replay source picks its own) and the source's metrics."""
        ...

    def hold(self) -> ContextManager:
        """A context the scoring and the update run in (a served policy holds its weights meanwhile)."""
        ...

    def close(self) -> None:
        """Release servers and threads at the end of the run."""
        ...


class HarnessRollouts:
    """The built-in harness on the local policy (``rollout.source=builtin``): B tasks × G samples per step."""

    def __init__(self, cfg: Config, model, tokenizer, chat, split, *, partner_model=None):
        """``partner_model``: the frozen warm start a ``harness.partner=frozen`` plays from (None: a frozen
        copy of ``model`` as given, made here — before a resumed run loads its checkpoint's weights)."""
        self.cfg, self.model, self.tokenizer, self.chat, self.split = cfg, model, tokenizer, chat, split
        if partner_model is None and cfg.harness.partner == "frozen":
            partner_model = frozen_copy(model)
        self.partner_model = partner_model
        est = get_estimator(cfg.algo.estimator)
        # (a group reference is known only once the group has finished: scored after the rollout)
        self.score_live = est.needs_gains and cfg.algo.scorer == "cached" and cfg.algo.score_live \
            and cfg.algo.gain_reference == "answer"
        self.live_scorer: LiveScorer | None = None  # set by each collect()

    def collect(self, tasks: Sequence, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        cfg = self.cfg
        policy = sampling_policy(cfg, self.model, self.tokenizer, seed=cfg.train.seed * 1_000_003 + step)
        scorer = LiveScorer(policy, self.chat.answer_probe, max_batch_tokens=cfg.algo.score_batch_tokens) \
            if self.score_live else None  # fmt: skip
        partner = partner_policy(cfg, self.tokenizer, self.split, self.partner_model,
                                 seed=cfg.train.seed * 1_000_003 + step)
        harness = Harness(policy, self.chat, make_env(self.split), cfg.harness, state_scorer=scorer,
                          partner=partner)
        trajs = harness.run(tasks, group_size=cfg.train.group_size, seed=cfg.train.seed + step, step=step)
        if scorer is not None:
            scorer.flush()  # (the harness flushes after every round: normally nothing is left)
        self.live_scorer = scorer
        return trajs, {}

    def hold(self) -> ContextManager:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def open_source(cfg: Config, model, tokenizer, chat, split, run_dir: Path, log: Callable[[str], Any] = print, *,
                resumed: bool = False, replay=None, partner_model=None) -> tuple[RolloutSource, int | None]:
    """The run's rollout source, and the number of task groups it brings (a replay's; None when the
    tasks come from the training split). A replay (``replay``: one already read, so that bad records
    fail before any work) writes what it dropped to ``RUN_DIR/drops.jsonl`` once (not again when
    ``resumed``)."""
    if cfg.rollout.source == "records":
        from mosaic.train.replay import RecordsReplay

        replay = replay if replay is not None else RecordsReplay(cfg)
        if not resumed:
            replay.write_drops(run_dir)
        log(f"replaying {sum(len(g) for g in replay.groups.values())} captured rollouts in {replay.n_groups} "
            f"groups from {cfg.rollout.records} (dropped: {replay.report.summary()})")
        return replay, replay.n_groups
    if cfg.rollout.source == "harness":
        from mosaic.train.external import ExternalRollouts  # fastapi / uvicorn only when asked for

        ext = ExternalRollouts(cfg, model, tokenizer, split, run_dir / "records")
        log(f"rollouts from the harness {cfg.rollout.harness!r}: policy served behind the recording proxy at "
            f"{ext.url} (records in {ext.records_path})")
        return ext, None
    return HarnessRollouts(cfg, model, tokenizer, chat, split, partner_model=partner_model), None
