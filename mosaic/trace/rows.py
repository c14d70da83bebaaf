"""From trajectories to what the estimators and the loss consume.

- :func:`flatten` lays a batch of trajectories out as flat per-trajectory (T,)
  and per-session (S,) arrays — the inputs of ``mosaic.core.advantages``.
- :func:`to_rows` makes one training row per session (docs/algorithm.md §5): the prompt
  (never trained) and the completion with its ``loss_mask`` and sampling
  log-probs, copied from the record as-is (token-in, token-out: no decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mosaic.trace.graph import KIND_CODES, Session, Trajectory


@dataclass(frozen=True)
class FlatBatch:
    """A batch of trajectories as flat arrays.

    Attributes:
        rewards: (T,) float; success: (T,) bool; group_ids: (T,) int (dense codes of
            ``Trajectory.group_id`` in order of first appearance);
        session_counts: (T,) int, sessions counted per trajectory (kinds chosen by
            ``count_kinds``);
        session_traj: (S,) int index into T; kinds: (S,) int kind codes;
        is_final: (S,) bool; session_index: (S,) int, the session's id in its trajectory.
    """

    rewards: np.ndarray
    success: np.ndarray
    group_ids: np.ndarray
    session_counts: np.ndarray
    session_traj: np.ndarray
    kinds: np.ndarray
    is_final: np.ndarray
    session_index: np.ndarray
    group_names: tuple[str, ...]


def flatten(trajs: Sequence[Trajectory], *, count_kinds: Sequence[str] | None = None) -> FlatBatch:
    """Flatten trajectories; ``count_kinds=None`` counts sessions of every kind (docs/algorithm.md §4.3)."""
    group_codes: dict[str, int] = {}
    rewards, success, groups, counts = [], [], [], []
    s_traj, s_kind, s_final, s_idx = [], [], [], []
    for i, t in enumerate(trajs):
        rewards.append(float(t.reward))
        success.append(bool(t.success))
        groups.append(group_codes.setdefault(t.group_id, len(group_codes)))
        counts.append(
            len(t.sessions)
            if count_kinds is None
            else sum(1 for s in t.sessions if s.kind in count_kinds)
        )
        for s in t.sessions:
            s_traj.append(i)
            s_kind.append(KIND_CODES[s.kind])
            s_final.append(bool(s.is_final))
            s_idx.append(s.id)
    return FlatBatch(
        rewards=np.asarray(rewards, dtype=np.float32),
        success=np.asarray(success, dtype=bool),
        group_ids=np.asarray(groups, dtype=np.int64),
        session_counts=np.asarray(counts, dtype=np.int64),
        session_traj=np.asarray(s_traj, dtype=np.int64),
        kinds=np.asarray(s_kind, dtype=np.int64),
        is_final=np.asarray(s_final, dtype=bool),
        session_index=np.asarray(s_idx, dtype=np.int64),
        group_names=tuple(group_codes),
    )


def turn_spans(loss_mask: Sequence[bool]) -> list[tuple[int, int]]:
    """Completion offsets ``[start, end)`` of each turn of a session.

    A turn is a run of sampled (True) tokens and the inserted tokens after it (a tool
    response, template tokens), up to where the next sampled run starts; the first turn
    also holds any inserted tokens before it. A completion with no sampled token has no turn.
    This is the one definition of a turn (the turn-level scorer and estimators use it).
    """
    m = [bool(x) for x in loss_mask]
    starts = [i for i, x in enumerate(m) if x and (i == 0 or not m[i - 1])]
    if not starts:
        return []
    starts[0] = 0
    return [(a, b) for a, b in zip(starts, starts[1:] + [len(m)])]


def turn_boundaries(session: Session, header_ids: Sequence[int] | None = None) -> list[int]:
    """State lengths for turn-level probing: the prompt, then the end of every turn.

    Turns are :func:`mosaic.trace.turn_spans` (a run of sampled tokens and the inserted
    tokens after it, up to the next sampled run). Returns lengths into
    ``prompt_ids + completion_ids``, increasing, starting at the prompt.

    ``header_ids``: the chat format's generation header (``ChatFormat.generation_header_ids``,
    ``<|im_start|>assistant\n``). The harness inserts it before every sampled
    turn, so a raw boundary ends with it; it is cut off so that every state ends
    at a message boundary and the answer probe (which brings its own header) is
    appended cleanly, as for the session-level states.
    """
    p = len(session.prompt_ids)
    toks = session.tokens()
    raw = [p] + [p + end for _, end in turn_spans(session.loss_mask)]
    if not header_ids:
        return raw
    h = list(header_ids)
    return [c - len(h) if c >= len(h) and toks[c - len(h) : c] == h else c for c in raw]


@dataclass(frozen=True)
class TurnLayout:
    """The turns of a batch, in :func:`flatten` session order (U turns in all).

    Attributes:
        session: (U,) index into the flattened sessions; start, end: (U,) completion offsets
        of the turn; context: (U,) tokens in the session's context when the turn starts
        (prompt + earlier completion); is_final: (U,) the answer turn (last turn of a final session).
    """

    session: np.ndarray
    start: np.ndarray
    end: np.ndarray
    context: np.ndarray
    is_final: np.ndarray


def turn_layout(trajs: Sequence[Trajectory]) -> TurnLayout:
    """Every session's :func:`turn_spans`, flattened (session order of :func:`flatten`)."""
    sess, start, end, ctx, final = [], [], [], [], []
    k = 0
    for t in trajs:
        for s in t.sessions:
            spans = turn_spans(s.loss_mask)
            for j, (a, b) in enumerate(spans):
                sess.append(k)
                start.append(a)
                end.append(b)
                ctx.append(len(s.prompt_ids) + a)
                final.append(bool(s.is_final) and j == len(spans) - 1)
            k += 1
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return TurnLayout(i64(sess), i64(start), i64(end), i64(ctx), np.asarray(final, dtype=bool))


@dataclass
class TrainingRow:
    """One session as a training example.

    ``loss_mask`` is True on tokens the policy sampled (the only tokens trained on).
    ``advantage`` is the session's scalar advantage (filled by the trainer);
    ``token_advantages``, when set, gives each completion token its own (turn-level estimators).
    """

    traj_index: int
    session_index: int
    kind: str
    is_final: bool
    group_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    reward: float
    advantage: float = 0.0
    token_advantages: list[float] | None = None
    stretch: int | None = None
    """None: the session's own row; k: its k-th detached stretch (:class:`~mosaic.trace.graph.Stretch`),
    trained on the context it was sampled from, with the session's advantage."""

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


def to_rows(trajs: Sequence[Trajectory], advantages: Sequence[float] | None = None) -> list[TrainingRow]:
    """One row per session, then one per detached stretch of that session, in the order of
    :func:`flatten` (trajectory-major).

    ``advantages``: optional (S,) per-session advantages in the same order (a stretch gets its session's).
    """
    rows: list[TrainingRow] = []
    adv = None if advantages is None else [float(a) for a in advantages]
    n_sessions = sum(len(t.sessions) for t in trajs)
    if adv is not None and len(adv) != n_sessions:
        raise ValueError(f"advantages has {len(adv)} entries for {n_sessions} sessions")
    k = 0
    for i, t in enumerate(trajs):
        for s in t.sessions:
            for j, part in enumerate([s, *s.detached]):
                rows.append(
                    TrainingRow(
                        traj_index=i,
                        session_index=s.id,
                        kind=s.kind,
                        is_final=s.is_final,
                        group_id=t.group_id,
                        prompt_ids=list(part.prompt_ids),
                        completion_ids=list(part.completion_ids),
                        loss_mask=list(part.loss_mask),
                        logprobs=list(part.logprobs),
                        reward=float(t.reward),
                        advantage=0.0 if adv is None else adv[k],
                        stretch=None if j == 0 else j - 1,
                    )
                )
            k += 1
    return rows
