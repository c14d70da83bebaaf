"""Held-out evaluation with the multi-session harness (``mosaic eval``).

Runs the policy over a split's questions (greedy, or n samples at a
temperature), scores the sessions' information gains with the same policy,
and reports accuracy with a 95 % interval, sessions per trajectory by kind,
the share of sessions with positive gain by kind and the end reasons. The
per-question outcomes are saved (JSONL) so two runs can be compared pairwise
(``mosaic compare``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from mosaic.agent.episode import make_env
from mosaic.agent.harness import Harness
from mosaic.trace import Trajectory
from mosaic.config.loader import Config
from mosaic.train.metrics import rollout_metrics, val_keys
from mosaic.train.scorer import LiveScorer, score_gains as score_gains_
from mosaic.train.setup import frozen_copy, partner_policy, sampling_policy
from mosaic.train.stats import accuracy_ci


@dataclass
class EvalResult:
    accuracy: float
    lo: float
    hi: float
    n_questions: int
    metrics: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self, name: str = "eval") -> str:
        m = self.metrics
        pos = m.get("session/pos_gain_share/all", float("nan"))
        return (f"{name}: accuracy {100 * self.accuracy:.1f} % [95 % CI {100 * self.lo:.1f}, {100 * self.hi:.1f}] "
                f"on {self.n_questions} questions; sessions/traj {m.get('session/per_traj', float('nan')):.2f}; "
                + (f"positive-gain share {pos:.2f}" if pos == pos else "positive-gain share n/a (no scored non-final "
                   "session)")
                + (f"; stale-action rate {self._stale(m)}, visits handled right {100 * m['env/visits_correct']:.1f} %"
                   if "env/stale_rate" in m else ""))

    @staticmethod
    def _stale(m: dict[str, float]) -> str:
        """The stale-action rate; n/a when the rollouts changed nothing on the accounts (no rate to speak of)."""
        return "n/a (no account changes)" if m.get("env/actions", 1.0) == 0 else f"{100 * m['env/stale_rate']:.1f} %"


def evaluate(cfg: Config, model, tokenizer, chat, split, *, n_tasks: int | None = None, samples: int = 1,
             temperature: float = 0.0, seed: int = 0, score_gains: bool = True, progress: bool | str = True,
             out: str | Path | None = None, partner_model=None) -> EvalResult:
    """Accuracy of ``model`` on ``split`` through the harness; optional outcomes file ``out``.

    ``progress``: a progress bar over the trajectories (a string: its label; ``True``: ``eval``).
    ``partner_model``: the frozen warm start a ``harness.partner=frozen`` plays from (None: a frozen copy of
    ``model``)."""
    t0 = time.perf_counter()
    tasks = split.tasks[: n_tasks or len(split.tasks)]
    # rollout.eval_batch_size (0: rollout.batch_size). One batch of all 256 trajectories was slower on CPU than
    # batches of 64 (3.9 vs 5.0 trajectories per CPU second) and sampled other draws: see docs (issue 27).
    batch = cfg.rollout.eval_batch_size or cfg.rollout.batch_size
    policy = sampling_policy(cfg, model, tokenizer, temperature=temperature, seed=seed, batch_size=batch)
    # Gains scored as in training: each main session's states off the policy's live cache as it closes.
    live = (LiveScorer(policy, chat.answer_probe, max_batch_tokens=cfg.algo.score_batch_tokens)
            if score_gains and cfg.algo.scorer == "cached" and cfg.algo.score_live else None)
    if partner_model is None and cfg.harness.partner == "frozen":
        partner_model = frozen_copy(model)
    partner = partner_policy(cfg, tokenizer, split, partner_model, seed=seed, temperature=temperature, batch_size=batch)
    harness = Harness(policy, chat, make_env(split), cfg.harness, state_scorer=live, partner=partner)
    trajs = harness.run(tasks, group_size=samples, seed=seed, progress="eval" if progress is True else progress,
                        step="eval")
    gains = is_final = None
    if score_gains:
        res = score_gains_(trajs, model, chat.answer_probe, max_batch_tokens=cfg.algo.score_batch_tokens,
                           known=live.known(trajs) if live is not None else None)
        gains, is_final = res.gains.numpy(), res.is_final.numpy()
    metrics = rollout_metrics(trajs, gains, is_final)
    outcomes: dict[str, list[float]] = {}
    for t in trajs:
        outcomes.setdefault(t.task_id, []).append(float(t.success))
    acc = accuracy_ci([outcomes[t.id] for t in tasks])
    if out is not None:
        write_outcomes(out, trajs)
    metrics.update(zip(val_keys(samples, cfg.data.family), (acc.accuracy, acc.lo, acc.hi)))
    return EvalResult(acc.accuracy, acc.lo, acc.hi, acc.n_questions, metrics, outcomes, time.perf_counter() - t0)


def write_outcomes(path: str | Path, trajs: Sequence[Trajectory]) -> Path:
    """One JSON line per question sample: what ``mosaic compare`` reads; a service episode's outcome (state
    match, visits handled right, stale actions: why a right answer can still fail) under ``env``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as fh:
        for t in trajs:
            row = {"question_id": t.task_id, "trajectory": t.id, "correct": bool(t.success), "reward": t.reward,
                   "answer": t.answer, "ground_truth": t.ground_truth, "end_reason": t.end_reason,
                   "sessions": t.count_kinds()}
            if isinstance(t.meta.get("env"), dict):
                row["env"] = t.meta["env"]
            fh.write(json.dumps(row, default=str) + "\n")
    tmp.replace(p)
    return p


def paired_outcomes(a: dict[str, list[float]], b: dict[str, list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Align two outcome dicts on their common questions → two (Q,) arrays of per-question means."""
    common = sorted(set(a) & set(b))
    return (np.array([np.mean(a[q]) for q in common]), np.array([np.mean(b[q]) for q in common]))
