"""Outcome of a service rollout: success, visits handled, stale actions.

- **success**: the rollout reached the last visit; every visit's attempted mutating actions equal its
  required actions (every required action done in its visit, in the form the state at that moment
  required, and no other: a *forbidden* action, one the account's state did not allow, fails even
  though the backend refused it, e.g. cancelling an order that had shipped; a wrong action later
  repaired still fails its visit); the backend's final state equals the episode's target state; and
  the final answer is right (exact match after :func:`mosaic.envs.rewards.normalize_answer`).
  ``reward = float(success)``.
- **visits_correct**: visits whose attempted mutating actions (done or refused) equal the visit's
  required actions as a multiset (required actions follow the target path, so a visit after a wrong
  one may no longer be solvable as required).
- **stale actions** (:class:`StaleTracker`): a mutating action attempted (done or rejected) while a field
  it relies on (:func:`mosaic.envs.service.state.uses`) had been changed by a world event after the
  agent last observed it. Observing a field: a lookup that shows it, the user announcing the change at
  a visit, or the agent's own action writing it. A field an event never changed is never stale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from mosaic.envs.rewards import extract_answer, normalize_answer
from mosaic.envs.service.state import Call


class StaleTracker:
    """When each field was last changed by an event and last observed by the agent (in ticks)."""

    def __init__(self) -> None:
        self.changed: dict[str, int] = {}
        self.seen: dict[str, int] = {}

    def change(self, field_name: str, tick: int) -> None:
        self.changed[field_name] = tick

    def see(self, fields, tick: int) -> None:
        for f in fields:
            self.seen[f] = tick

    def stale(self, fields) -> list[str]:
        """The fields among ``fields`` an event changed after the agent last observed them."""
        return [f for f in fields if f in self.changed and self.seen.get(f, -1) < self.changed[f]]


@dataclass
class ServiceOutcome:
    success: bool
    reward: float
    state_match: bool
    answer: str | None
    answer_status: str
    answer_correct: bool
    visits: int
    visits_reached: int
    visits_correct: int
    actions: int
    stale_actions: int
    tool_errors: int
    rejected: int
    forbidden: int
    stale: list[dict] = field(default_factory=list)

    @property
    def stale_rate(self) -> float:
        """Stale actions per mutating action attempted (0 when none)."""
        return self.stale_actions / self.actions if self.actions else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "stale_rate": self.stale_rate}


def outcome_summary(envs: list) -> dict[str, float]:
    """A batch of outcome records (``ServiceOutcome.to_dict()``, what ``traj.meta["env"]`` holds; a field that is
    missing or not a number counts 0): ``stale_rate`` (stale actions per mutating action, pooled; 0 when nothing
    was changed), and per trajectory ``stale_actions``, ``actions``, ``visits_correct`` (its share of visits
    handled right), ``state_match``, ``answer_correct``, ``tool_errors``; {} for none. The one definition of
    the training logs' ``env/*`` and ``mosaic rollout``'s summary."""
    if not envs:
        return {}

    def num(e: dict, k: str) -> float:
        v = e.get(k, 0)
        return float(v) if isinstance(v, (int, float)) else 0.0

    def mean(k) -> float:
        return float(np.mean([k(e) if callable(k) else num(e, k) for e in envs]))

    actions = sum(num(e, "actions") for e in envs)
    return {
        "stale_rate": sum(num(e, "stale_actions") for e in envs) / actions if actions else 0.0,
        "stale_actions": mean("stale_actions"), "actions": actions / len(envs),
        "visits_correct": mean(lambda e: num(e, "visits_correct") / max(1.0, num(e, "visits"))),
        "state_match": mean("state_match"), "answer_correct": mean("answer_correct"),
        "tool_errors": mean("tool_errors"),
    }


def same_actions(done: list[Call], required) -> bool:
    key = lambda c: (c.name, c.args)  # noqa: E731
    return sorted(done, key=key) == sorted(required, key=key)


def score_rollout(episode, final_state: dict, attempts: list[list[Call]], answer_text: str | None, *,
                  visits_reached: int, actions: int, stale: list[dict], tool_errors: int,
                  rejected: int, forbidden: int) -> ServiceOutcome:
    """Score a finished rollout of ``episode`` (see the module docstring)."""
    answer, status = extract_answer(answer_text) if answer_text is not None else (None, "missing")
    correct = answer is not None and normalize_answer(answer) == normalize_answer(episode.answer)
    n = len(episode.visits)
    state_match = final_state == episode.target
    visits_correct = sum(same_actions(attempts[i] if i < len(attempts) else [], v.required)
                         for i, v in enumerate(episode.visits) if i < visits_reached)
    success = state_match and correct and visits_reached == n and visits_correct == n and forbidden == 0
    return ServiceOutcome(success, float(success), state_match, answer, status, correct, n, visits_reached,
                          visits_correct, actions, len(stale), tool_errors, rejected, forbidden, stale)
