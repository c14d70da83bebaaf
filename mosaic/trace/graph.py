"""The session graph: what a multi-session rollout is, token for token.

A trajectory is a DAG of sessions (docs/algorithm.md §1). Each session stores the exact
prompt ids the model was fed and the completion ids that followed, with a
parallel boolean ``loss_mask`` (True = sampled by the policy, trained on;
template and tool tokens False) and the sampling log-probs (0.0 where the
mask is False). Edges point from a parent to a child: ``continues``
(main → compaction → main) and ``forks`` (main → subagent).

States for the information-gain scorer (docs/algorithm.md §4.4) are *references* rather
than copies: a :class:`StateRef` names a session and a length ``upto`` into
that session's ``prompt_ids + completion_ids``. Sessions that share a state
(a compaction's ``state_before`` is the previous main session's end) name the
same (session, upto) pair, so the scorer can deduplicate them by key and each
state is stored once. States that exist in no session's tokens (the "own"
subagent mode, captured sessions) go in ``Trajectory.states`` and are named by
index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from mosaic.trace.stretch import Stretch  # noqa: F401  (re-exported: part of the data model)
from mosaic.trace.fields import (  # noqa: F401  (TraceError and the limits are re-exported)
    TraceError, MAX_TOKEN_ID, LOGPROB_TOLERANCE, show_value, as_int, as_str, as_bool, as_number, as_list, as_int_list, as_bool_list, as_float_list, as_dict, check_ids, check_logprobs,
)

# Session kinds and their integer codes (the estimators take codes).
# Extensible with :func:`register_kind`; codes are stable once registered.
KIND_CODES: dict[str, int] = {"main": 0, "compaction": 1, "subagent": 2, "reset": 3}
EdgeType = Literal["continues", "forks"]
EDGE_TYPES: tuple[str, ...] = ("continues", "forks")


def register_kind(name: str) -> int:
    """Register a new session kind and return its integer code (idempotent)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"session kind must be a non-empty string, got {name!r}")
    if name not in KIND_CODES:
        KIND_CODES[name] = max(KIND_CODES.values()) + 1
    return KIND_CODES[name]


def kind_names() -> dict[int, str]:
    """Map code → kind name (for metric labels)."""
    return {code: name for name, code in KIND_CODES.items()}


@dataclass(frozen=True)
class StateRef:
    """A context the answer likelihood is measured in.

    Exactly one of the two forms:
    - ``session`` + ``upto``: the first ``upto`` tokens of that session's
      ``prompt_ids + completion_ids`` (``upto=None`` means all of them);
    - ``state``: an index into ``Trajectory.states`` (explicit token ids).
    """

    session: int | None = None
    upto: int | None = None
    state: int | None = None

    def to_dict(self) -> dict[str, int | None]:
        if self.state is not None:
            return {"state": self.state}
        return {"session": self.session, "upto": self.upto}

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "StateRef | None":
        if d is None:
            return None
        if not isinstance(d, dict):
            raise TraceError(f"state reference must be an object, got {type(d).__name__}")
        return StateRef(session=as_int(d.get("session"), "session", optional=True),
                        upto=as_int(d.get("upto"), "upto", optional=True),
                        state=as_int(d.get("state"), "state", optional=True))


@dataclass
class Session:
    """One stretch of interaction over one context prefix.

    Attributes:
        id: index of the session inside its trajectory (``trajectory.sessions[id]``).
        kind: ``main``, ``compaction``, ``subagent``, ``reset`` or a registered kind.
        parent: id of the parent session, or None for the root.
        edge: type of the parent → this edge (``continues`` or ``forks``); None for the root.
        prompt_ids: the exact token ids the model was fed at the session start.
        completion_ids: every token after the prompt: sampled tokens and inserted
            tool / template tokens, in the order the model saw them.
        loss_mask: (len(completion_ids),) True = sampled by the policy (trained on).
        logprobs: (len(completion_ids),) sampling log-probs; 0.0 where loss_mask is False.
        end_reason: why the session ended (``answer``, ``compaction``, ``turn_cap``, ...).
        is_final: True for the last main session of the trajectory (exactly one).
        state_before / state_after: the gain scorer's states (docs/algorithm.md §4.4).
        num_turns: assistant turns sampled in this session.
        meta: free-form, JSON-serialisable extras (tool errors, timings, ...).
        detached: sampled tokens trained on a context the row no longer holds (:class:`Stretch`).
    """

    id: int
    kind: str
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    parent: int | None = None
    edge: str | None = None
    end_reason: str = ""
    is_final: bool = False
    state_before: StateRef | None = None
    state_after: StateRef | None = None
    num_turns: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    detached: list[Stretch] = field(default_factory=list)

    @property
    def kind_code(self) -> int:
        return KIND_CODES[self.kind]

    @property
    def num_trainable(self) -> int:
        return sum(1 for m in self.loss_mask if m)

    def tokens(self) -> list[int]:
        """The full context at the session's end: prompt + completion."""
        return list(self.prompt_ids) + list(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "parent": self.parent,
            "edge": self.edge,
            "prompt_ids": list(self.prompt_ids),
            "completion_ids": list(self.completion_ids),
            "loss_mask": [bool(m) for m in self.loss_mask],
            "logprobs": [float(x) for x in self.logprobs],
            "end_reason": self.end_reason,
            "is_final": self.is_final,
            "state_before": self.state_before.to_dict() if self.state_before else None,
            "state_after": self.state_after.to_dict() if self.state_after else None,
            "num_turns": self.num_turns,
            "meta": self.meta,
            **({"detached": [x.to_dict() for x in self.detached]} if self.detached else {}),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Session":
        """Decode a session record strictly: every field must have its type (no coercion)."""
        if not isinstance(d, dict):
            raise TraceError(f"session record must be an object, got {show_value(d)}")
        try:
            refs = {}
            for key in ("state_before", "state_after"):
                try:
                    refs[key] = StateRef.from_dict(d.get(key))
                except TraceError as exc:
                    raise TraceError(f"field {key!r}: {exc}") from None
            return Session(
                id=as_int(d["id"], "id"),
                kind=as_str(d["kind"], "kind"),
                parent=as_int(d.get("parent"), "parent", optional=True),
                edge=as_str(d.get("edge"), "edge", optional=True),
                prompt_ids=as_int_list(d["prompt_ids"], "prompt_ids"),
                completion_ids=as_int_list(d.get("completion_ids", []), "completion_ids"),
                loss_mask=as_bool_list(d.get("loss_mask", []), "loss_mask"),
                logprobs=as_float_list(d.get("logprobs", []), "logprobs"),
                end_reason=as_str(d.get("end_reason", ""), "end_reason"),
                is_final=as_bool(d.get("is_final", False), "is_final"),
                state_before=refs["state_before"],
                state_after=refs["state_after"],
                num_turns=as_int(d.get("num_turns", 0), "num_turns"),
                meta=as_dict(d.get("meta"), "meta"),
                detached=[Stretch.from_dict(x) for x in as_list(d.get("detached", []), "detached")],
            )
        except KeyError as exc:
            raise TraceError(f"session record is missing field {exc.args[0]!r}") from None


@dataclass
class Trajectory:
    """One rollout of one task: a DAG of sessions and one outcome reward.

    Attributes:
        id: unique id of the rollout.
        task_id: the task it solves; group_id: the GRPO comparison set it belongs to.
        sessions: ``sessions[k].id == k``; parents must come before children.
        reward: outcome reward in [0, 1]; success: ``reward >= success_threshold``.
        answer: the extracted final answer (None if none); ground_truth: the gold answer
            (the gain scorer needs it).
        end_reason: why the trajectory ended (``answer``, ``session_cap``, ``context_overflow``, ...).
        states: explicit states referenced by ``StateRef(state=i)``.
        meta: free-form extras (counters, timings, invalid-action counts, ...).
    """

    id: str
    task_id: str
    group_id: str
    sessions: list[Session]
    reward: float = 0.0
    success: bool = False
    answer: str | None = None
    ground_truth: str | None = None
    end_reason: str = ""
    states: list[list[int]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def count_kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.sessions:
            counts[s.kind] = counts.get(s.kind, 0) + 1
        return counts

    def final_session(self) -> Session:
        finals = [s for s in self.sessions if s.is_final]
        if len(finals) != 1:
            raise TraceError(f"trajectory {self.id!r}: expected exactly one final session, found {len(finals)}")
        return finals[0]

    def resolve_state(self, ref: StateRef) -> list[int]:
        """Token ids of a state reference."""
        if ref.state is not None:
            return list(self.states[ref.state])
        toks = self.sessions[ref.session].tokens()  # type: ignore[index]
        return toks if ref.upto is None else toks[: ref.upto]

    def state_key(self, ref: StateRef) -> tuple:
        """A hashable key equal for references to the same tokens of this trajectory."""
        if ref.state is not None:
            return ("state", ref.state)
        s = self.sessions[ref.session]  # type: ignore[index]
        n = len(s.prompt_ids) + len(s.completion_ids)
        return ("session", ref.session, n if ref.upto is None else ref.upto)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "reward": float(self.reward),
            "success": bool(self.success),
            "answer": self.answer,
            "ground_truth": self.ground_truth,
            "end_reason": self.end_reason,
            "sessions": [s.to_dict() for s in self.sessions],
            "states": [list(map(int, st)) for st in self.states],
            "meta": self.meta,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Trajectory":
        """Decode a trajectory record strictly; a :class:`TraceError` names the session and field."""
        if not isinstance(d, dict):
            raise TraceError(f"trajectory record must be an object, got {type(d).__name__}")
        try:
            tid = as_str(d["id"], "id")
            sessions = d["sessions"]
            if not isinstance(sessions, list):
                raise TraceError("trajectory field 'sessions' must be a list")
            decoded = []
            for k, s in enumerate(sessions):
                try:
                    decoded.append(Session.from_dict(s))
                except TraceError as exc:
                    raise TraceError(f"trajectory {tid!r} session {k} {exc}") from None
            try:
                states = [as_int_list(st, f"states[{i}]") for i, st in enumerate(as_list(d.get("states", []), "states"))]
                return Trajectory(
                    id=tid,  # type: ignore[arg-type]
                    task_id=as_str(d["task_id"], "task_id"),  # type: ignore[arg-type]
                    group_id=as_str(d["group_id"], "group_id"),  # type: ignore[arg-type]
                    sessions=decoded,
                    reward=as_number(d.get("reward", 0.0), "reward"),
                    success=as_bool(d.get("success", False), "success"),
                    answer=as_str(d.get("answer"), "answer", optional=True),
                    ground_truth=as_str(d.get("ground_truth"), "ground_truth", optional=True),
                    end_reason=as_str(d.get("end_reason", ""), "end_reason"),  # type: ignore[arg-type]
                    states=states,
                    meta=as_dict(d.get("meta"), "meta"),
                )
            except TraceError as exc:
                raise TraceError(f"trajectory {tid!r} {exc}") from None
        except KeyError as exc:
            raise TraceError(f"trajectory record is missing field {exc.args[0]!r}") from None
        except TraceError as exc:
            if str(exc).startswith(("trajectory", "session")):
                raise
            raise TraceError(f"trajectory {exc}") from None


def _check_ref(traj: Trajectory, s: Session, name: str, ref: StateRef | None) -> None:
    where = f"trajectory {traj.id!r} session {s.id} field {name!r}"
    if ref is None:
        return
    if (ref.state is None) == (ref.session is None):
        raise TraceError(f"{where}: a state reference needs exactly one of 'session' or 'state'")
    if ref.state is not None:
        if not 0 <= ref.state < len(traj.states):
            raise TraceError(f"{where}: state index {ref.state} out of range (have {len(traj.states)})")
        return
    if not 0 <= ref.session < len(traj.sessions):  # type: ignore[operator]
        raise TraceError(f"{where}: session {ref.session} out of range (have {len(traj.sessions)})")
    tgt = traj.sessions[ref.session]  # type: ignore[index]
    n = len(tgt.prompt_ids) + len(tgt.completion_ids)
    if ref.upto is not None and not 0 <= ref.upto <= n:
        raise TraceError(f"{where}: upto={ref.upto} outside session {ref.session}'s {n} tokens")


# Long on purpose: one ordered list of checks, each naming the broken field; splitting it would scatter the checks' order.
def _check_session(s: Session, k: int, n: int, where: str) -> None:
    """One session's own invariants (id, kind, lengths, ids, log-probs, turns, parent and edge)."""
    if s.id != k:
        raise TraceError(f"{where} field 'id': expected {k}, got {s.id}")
    if s.kind not in KIND_CODES:
        raise TraceError(f"{where} field 'kind': unknown kind {s.kind!r} (known: {sorted(KIND_CODES)})")
    if len(s.loss_mask) != len(s.completion_ids):
        raise TraceError(
            f"{where} field 'loss_mask': length {len(s.loss_mask)} != "
            f"{len(s.completion_ids)} completion tokens"
        )
    if len(s.logprobs) != len(s.completion_ids):
        raise TraceError(
            f"{where} field 'logprobs': length {len(s.logprobs)} != "
            f"{len(s.completion_ids)} completion tokens"
        )
    try:
        check_ids(s.prompt_ids, "prompt_ids")
        check_ids(s.completion_ids, "completion_ids")
        check_logprobs(s.logprobs, "logprobs")
    except TraceError as exc:
        raise TraceError(f"{where} {exc}") from None
    for j, x in enumerate(s.detached):
        x.check(f"{where} field 'detached' [{j}]")
    if s.num_turns < 0:
        raise TraceError(f"{where} field 'num_turns': {s.num_turns} is negative")
    if s.parent is None:
        if s.edge is not None:
            raise TraceError(f"{where} field 'edge': a root session has no incoming edge, got {s.edge!r}")
    else:
        if not 0 <= s.parent < n:
            raise TraceError(f"{where} field 'parent': {s.parent} out of range (have {n} sessions)")
        if s.edge not in EDGE_TYPES:
            raise TraceError(f"{where} field 'edge': {s.edge!r} is not one of {EDGE_TYPES}")


def validate(traj: Trajectory) -> Trajectory:
    """Check the data model's invariants; raise :class:`TraceError` naming the broken field.

    - session ids are 0..S-1 in order; kinds are registered; edges valid;
    - the parent graph is acyclic (every session reaches a root);
    - exactly one final session, and it is a ``main`` session (``reset`` in reset mode);
    - ``loss_mask`` and ``logprobs`` have the length of ``completion_ids``;
    - state references point inside the trajectory;
    - token ids (prompt, completion, explicit states) are in ``[0, MAX_TOKEN_ID]``; log-probs are
      finite and ``<= LOGPROB_TOLERANCE``; ``num_turns >= 0``;
    - reward is finite and in [0, 1].
    Returns the trajectory so calls can be chained.
    """
    tid = traj.id
    if not traj.sessions:
        raise TraceError(f"trajectory {tid!r} field 'sessions': no sessions")
    if not (0.0 <= traj.reward <= 1.0):  # also False for NaN
        raise TraceError(f"trajectory {tid!r} field 'reward': {traj.reward} is not in [0, 1]")
    for i, st in enumerate(traj.states):
        try:
            check_ids(st, f"states[{i}]")
        except TraceError as exc:
            raise TraceError(f"trajectory {tid!r} {exc}") from None
    n = len(traj.sessions)
    for k, s in enumerate(traj.sessions):
        _check_session(s, k, n, f"trajectory {tid!r} session {k}")
    # Acyclic: follow parents from every node; a walk longer than n revisits a node.
    for k in range(n):
        seen = set()
        cur: int | None = k
        while cur is not None:
            if cur in seen:
                raise TraceError(f"trajectory {tid!r} field 'parent': cycle through session {cur}")
            seen.add(cur)
            cur = traj.sessions[cur].parent
    finals = [s.id for s in traj.sessions if s.is_final]
    if len(finals) != 1:
        raise TraceError(f"trajectory {tid!r} field 'is_final': expected exactly one final session, found {len(finals)}")
    if traj.sessions[finals[0]].kind not in ("main", "reset"):
        raise TraceError(
            f"trajectory {tid!r} field 'is_final': the final session must be 'main' (or 'reset' in reset mode), "
            f"session {finals[0]} is {traj.sessions[finals[0]].kind!r}"
        )
    for s in traj.sessions:
        _check_ref(traj, s, "state_before", s.state_before)
        _check_ref(traj, s, "state_after", s.state_after)
    return traj


def validate_all(trajs: Iterable[Trajectory]) -> list[Trajectory]:
    out = []
    seen: set[str] = set()
    for t in trajs:
        validate(t)
        if t.id in seen:
            raise TraceError(f"trajectory field 'id': duplicate id {t.id!r}")
        seen.add(t.id)
        out.append(t)
    return out
