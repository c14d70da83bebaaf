"""Advantage estimators by name: one batch type, one call signature, metrics.

The trainer picks an estimator with ``get_estimator(name)`` and knows nothing of
the algorithm behind it. An estimator returns per-session advantages (S,) — one
training row per session — or, when its ``level`` is ``"turn"``, per-turn
advantages (U,) that the trainer spreads over each turn's tokens; plus a flat dict
of metrics.

| name | advantage |
| --- | --- |
| ``grpo`` | single-session GRPO: ``A_i`` on the trajectory's one session (fails loud on more) |
| ``broadcast`` | ``A_i`` copied to every session (docs/algorithm.md §4.2) |
| ``mosaic-traj`` | session-aware ``Â_i`` broadcast, no gains (§4.3) |
| ``mosaic-session`` | ``A_i + lam z`` (GRPO broadcast plus gains, §4.4 without §4.3) |
| ``mosaic`` | ``Â_i + lam z`` (§4.3 + §4.4) |
| ``mosaic-dag`` | ``Â_i + lam z(D)``: the downstream credit ``D`` of each session on the final answer (§4.10) |
| ``turn-level`` | per turn: ``A_i + lam z_turn`` (IGPO-style, §4.7) |
| ``fold`` | per turn: ``A_i``, minus ``p`` on main (and reset) turns past half their budget (FoldGRPO-style, §4.8) |

Each knob is declared once, in :data:`KNOBS` (name, type, default, one-line doc, range); an estimator
lists the ones it reads. The trainer config (``algo.<knob>``), ``--help-config``, the verl plugin
(``algorithm.mosaic.<knob>``) and the core functions' defaults (:mod:`.advantages`) read them from here.

Names: one spelling, with hyphens (``mosaic-traj``), as the project's other value names
(``algo.loss_agg=trajectory-token-mean``, verl's own ``loss_agg_mode=seq-mean-token-mean``) and every saved
run, report and experiment; the underscore spelling (``mosaic_traj``) and the old verl name
``mosaic_broadcast`` are accepted as aliases (:func:`resolve_name`) with a one-line note.

Adding an estimator, knobs included, touches this file only: ``add_knob(Knob(...))`` for a new knob,
``register(Estimator(...))`` with its function; the trainer scores gains or lays out turns from
``Estimator.needs`` and ``Estimator.level``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

import mosaic.core.advantages as adv

__all__ = ["AdvantageBatch", "Knob", "KNOBS", "add_knob", "Estimator", "EstimatorParams", "ESTIMATORS", "register",
           "aliases", "resolve_name", "alias_note", "knob_table", "get_estimator", "advantage_metrics"]


@dataclass(frozen=True)
class AdvantageBatch:
    """Everything an estimator may read, for one training batch.

    Trajectory-level fields have length T, session-level fields length S and
    turn-level fields length U (a turn: one run of sampled tokens and the
    inserted tokens after it, see ``mosaic.trace.turn_spans``). The optional
    fields are filled only for the estimators that declare them in ``Estimator.needs``.
    """

    rewards: torch.Tensor
    """(T,) outcome rewards in [0, 1]."""
    group_ids: torch.Tensor
    """(T,) integer group (task) id of each trajectory; groups may differ in size."""
    session_counts: torch.Tensor
    """(T,) number of sessions of each trajectory."""
    success: torch.Tensor
    """(T,) bool outcome flag (reward >= success threshold)."""
    session_traj: torch.Tensor
    """(S,) index into T of each session's trajectory."""
    kinds: torch.Tensor
    """(S,) integer session-kind code of each session."""
    is_final: torch.Tensor
    """(S,) bool, True for each trajectory's final main session."""
    gains: torch.Tensor | None = None
    """(S,) information gains ``L(after) - L(before)``; None when not scored."""
    turn_session: torch.Tensor | None = None
    """(U,) index into S of each turn's session (turns of a session in order)."""
    turn_gains: torch.Tensor | None = None
    """(U,) per-turn information gains ``L(after turn) - L(before turn)`` (docs/algorithm.md §4.7)."""
    turn_is_final: torch.Tensor | None = None
    """(U,) bool, True for the answer turn (the last turn of a final session)."""
    turn_over_half: torch.Tensor | None = None
    """(U,) bool, True for a main- or reset-session turn taken while its context exceeds half its budget (§4.8)."""
    downstream: torch.Tensor | None = None
    """(S,) downstream credit ``D``: a session's effect on the final state's answer likelihood (§4.10); 0 for finals."""
    gain_valid: torch.Tensor | None = None
    """(S,) bool, False where no answer was probed (§4.11): z = 0, out of the statistics, as a final. None: all True."""

    def unscored(self) -> torch.Tensor:
        """(S,) bool: finals, and sessions without an answer to probe (their gains are not used)."""
        return self.is_final.to(torch.bool) | (False if self.gain_valid is None else ~self.gain_valid.to(torch.bool))

    def __post_init__(self) -> None:
        t = self.rewards.shape[0]
        s = self.session_traj.shape[0]
        for name in ("group_ids", "session_counts", "success"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"AdvantageBatch.{name} must have shape ({t},) like rewards")
        optional = tuple(n for n in ("gains", "downstream", "gain_valid") if getattr(self, n) is not None)
        for name in ("kinds", "is_final") + optional:
            if getattr(self, name).shape != (s,):
                raise ValueError(f"AdvantageBatch.{name} must have shape ({s},) like session_traj")
        if s and (int(self.session_traj.min()) < 0 or int(self.session_traj.max()) >= t):
            raise ValueError(f"AdvantageBatch.session_traj must index into the {t} trajectories")
        if self.turn_session is not None:
            u = self.turn_session.shape[0]
            for name in ("turn_gains", "turn_is_final", "turn_over_half"):
                v = getattr(self, name)
                if v is not None and v.shape != (u,):
                    raise ValueError(f"AdvantageBatch.{name} must have shape ({u},) like turn_session")
            if u and (int(self.turn_session.min()) < 0 or int(self.turn_session.max()) >= s):
                raise ValueError(f"AdvantageBatch.turn_session must index into the {s} sessions")


@dataclass(frozen=True)
class Knob:
    """One estimator knob, declared once: ``algo.<name>`` in the trainer config, ``algorithm.mosaic.<name>``
    in verl's; the config, ``--help-config``, the docs and the verl plugin read it from :data:`KNOBS`."""

    name: str
    type: type
    """``float``, ``int`` or ``bool``."""
    default: float | int | bool
    doc: str
    """One line: what it does (with its section of docs/algorithm.md)."""
    bounds: str = ""
    """The range a value must lie in, ``[lo, hi)`` style (``inf`` for none); empty: any value of the type."""
    why: str = ""
    """Said after the range when a value falls outside it."""

    def check(self, value: float | int | bool) -> str | None:
        """Why ``value`` is not valid for this knob (``must be in [0, 1)``), or None."""
        if not self.bounds:
            return None
        lo_c, lo, hi, hi_c = self.bounds[0], *(float(x) for x in self.bounds[1:-1].split(",")), self.bounds[-1]
        ok = (value >= lo if lo_c == "[" else value > lo) and (value <= hi if hi_c == "]" else value < hi)
        if ok:
            return None
        if hi == math.inf:
            text = f"must be {'>=' if lo_c == '[' else '>'} {lo:g}"
        else:
            text = f"must be in {self.bounds}"
        return f"{text} {self.why}".rstrip()


KNOBS: dict[str, Knob] = adv.KNOB_TABLE
"""Every estimator knob by name, in declaration order (each estimator lists the ones it reads); the same dict
the core functions of :mod:`.advantages` take their defaults from."""


def add_knob(knob: Knob) -> Knob:
    """Declare ``knob`` (idempotent for an equal declaration; a second, different one is an error)."""
    if KNOBS.get(knob.name, knob) != knob:
        raise ValueError(f"estimator knob {knob.name!r} is already declared differently: {KNOBS[knob.name]}")
    if knob.type not in (float, int, bool) or type(knob.default) is not knob.type or knob.check(knob.default):
        raise ValueError(f"estimator knob {knob.name!r}: default {knob.default!r} is not a valid {knob.type.__name__}")
    KNOBS[knob.name] = knob
    return knob


for _k in (
    Knob("rho", float, 0.2, "ρ, strength of the session-count rank term in mixed groups (§4.3)", "[0, 1)",
         "so the multiplier stays positive"),
    Knob("delta", float, 0.1, "δ, the all-success / all-failure fallback term (§4.3, our choice)", "[0, inf)"),
    Knob("lam", float, 0.1, "λ, weight of the per-kind z-scored information gain (§4.4, §4.7)", "[0, inf)"),
    Knob("norm_by_std", bool, True, "Divide by the group std (GRPO); false = Dr. GRPO"),
    Knob("eps", float, 1e-6, "Added to standard deviations", "(0, inf)"),
    Knob("gamma", float, 0.0, "Discount of later turns' gains in turn-level (0: each turn its own gain; §4.7)",
         "[0, 1]"),
    Knob("fold_penalty", float, 1.0, "p of fold: subtracted on main/reset turns past half their budget (§4.8)",
         "[0, inf)"),
):
    add_knob(_k)


class EstimatorParams:
    """Values of the knobs in :data:`KNOBS` (each estimator reads the ones it lists); immutable.

    ``EstimatorParams(rho=0.3)``: the others at their declared defaults. An unknown name is a TypeError,
    a value outside its knob's range a ValueError naming the knob."""

    __slots__ = ("_values",)

    def __init__(self, **values: float | int | bool) -> None:
        unknown = sorted(set(values) - set(KNOBS))
        if unknown:
            raise TypeError(f"unknown estimator knobs {unknown}; known: {', '.join(KNOBS)}")
        out = {name: k.default for name, k in KNOBS.items()}
        for name, v in values.items():
            why = KNOBS[name].check(v)
            if why:
                raise ValueError(f"estimator knob {name!r}: {why} (got {v!r})")
            out[name] = v
        object.__setattr__(self, "_values", out)

    def __getattr__(self, name: str):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"no estimator knob {name!r}; known: {', '.join(KNOBS)}") from None

    def __setattr__(self, name: str, value) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to knob {name!r}: use .replace({name}=...)")

    def replace(self, **changes: float | int | bool) -> EstimatorParams:
        return EstimatorParams(**{**self._values, **changes})

    def as_dict(self) -> dict[str, float | int | bool]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EstimatorParams) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"EstimatorParams({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def __reduce__(self):  # copy / pickle through the constructor (attribute assignment is refused)
        return (_params_from, (dict(self._values),))


def _params_from(values: dict) -> EstimatorParams:
    return EstimatorParams(**values)


def advantage_metrics(
    advantages: torch.Tensor,
    batch: AdvantageBatch,
    kind_names: Mapping[int, str] | None = None,
) -> dict[str, float]:
    """Advantage statistics (verl's ``critic/advantages/*`` keys) and, when gains
    are given, the share of non-final sessions with positive gain per kind
    (``session/pos_gain_share/<kind>``; kind name from ``kind_names`` or ``kind_<code>``)."""
    a = advantages.to(torch.float64)
    m: dict[str, float] = {}
    if a.numel():
        m["critic/advantages/mean"] = float(a.mean())
        m["critic/advantages/std"] = float(a.std()) if a.numel() > 1 else 0.0
        m["critic/advantages/min"] = float(a.min())
        m["critic/advantages/max"] = float(a.max())
    live = ~batch.unscored()
    for field_name, key in (("gains", "pos_gain_share"), ("downstream", "pos_downstream_share")):
        values = getattr(batch, field_name)
        if values is None:
            continue
        for code in torch.unique(batch.kinds[live]).tolist():  # loop over kinds (a handful), not sessions
            sel = live & (batch.kinds == code)
            name = (kind_names or {}).get(int(code), f"kind_{int(code)}")
            m[f"session/{key}/{name}"] = float((values[sel] > 0).to(torch.float64).mean())
    if batch.gain_valid is not None and batch.gain_valid.numel():
        m["session/no_reference_share"] = float((~batch.gain_valid.to(torch.bool)).to(torch.float64).mean())
    return m


@dataclass(frozen=True)
class Estimator:
    """A named advantage estimator; call it on an :class:`AdvantageBatch`.

    ``needs`` names the optional :class:`AdvantageBatch` fields it reads (the trainer scores gains
    or lays out turns only when an estimator asks); ``level`` says whether it returns one advantage
    per session (S,) or per turn (U,); ``single_session`` estimators refuse multi-session rollouts;
    ``knobs`` lists the :data:`KNOBS` it reads; ``aliases`` older spellings it still answers to
    (the underscore spelling of its name always is one).
    """

    name: str
    fn: Callable[[AdvantageBatch, EstimatorParams], torch.Tensor]
    doc: str
    needs: frozenset[str] = frozenset()
    level: Literal["session", "turn"] = "session"
    single_session: bool = False
    knobs: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    @property
    def needs_gains(self) -> bool:
        return "gains" in self.needs

    @property
    def needs_turns(self) -> bool:
        return self.level == "turn" or any(n.startswith("turn_") for n in self.needs)

    def spellings(self) -> tuple[str, ...]:
        """The other names it answers to: the underscore spelling, then ``aliases``."""
        under = self.name.replace("-", "_")
        return tuple(dict.fromkeys(([under] if under != self.name else []) + list(self.aliases)))

    def __call__(
        self,
        batch: AdvantageBatch,
        params: EstimatorParams | None = None,
        *,
        kind_names: Mapping[int, str] | None = None,
        **overrides: float | bool,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns (advantages (S,) or (U,) by ``level``, metrics). ``overrides`` replace knobs of ``params``."""
        p = params or EstimatorParams()
        p = p.replace(**overrides) if overrides else p
        for field_name in sorted(self.needs):
            if getattr(batch, field_name) is None:
                raise ValueError(f"estimator {self.name!r} needs AdvantageBatch.{field_name}")
        if self.level == "turn" and batch.turn_session is None:
            raise ValueError(f"estimator {self.name!r} needs AdvantageBatch.turn_session (turn layout)")
        out = self.fn(batch, p)
        metrics = advantage_metrics(out, batch, kind_names)
        if batch.turn_gains is not None and batch.turn_is_final is not None:
            live = ~batch.turn_is_final.to(torch.bool)
            if bool(live.any()):
                metrics["turn/pos_gain_share"] = float((batch.turn_gains[live] > 0).to(torch.float64).mean())
        return out, metrics


def _outcome(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    return adv.grpo(b.rewards, b.group_ids, norm_by_std=p.norm_by_std, eps=p.eps)


def _grpo(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    per_traj = torch.bincount(b.session_traj.long(), minlength=b.rewards.shape[0])
    if bool((per_traj != 1).any()):
        raise ValueError(
            "estimator 'grpo' is single-session: every trajectory needs exactly one session "
            "(use 'broadcast' for multi-session rollouts)"
        )
    return adv.broadcast(_outcome(b, p), b.session_traj)


def _broadcast(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    return adv.broadcast(_outcome(b, p), b.session_traj)


def _mosaic_traj(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    a_hat = adv.session_aware(b.rewards, b.group_ids, b.session_counts, b.success, rho=p.rho, delta=p.delta,
                              norm_by_std=p.norm_by_std, eps=p.eps)  # fmt: skip
    return adv.broadcast(a_hat, b.session_traj)


def _mosaic_session(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    z = adv.normalized_session_gains(b.gains, b.kinds, b.unscored(), eps=p.eps)
    return adv.broadcast(_outcome(b, p), b.session_traj).to(z.dtype) + p.lam * z


def _mosaic(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    return adv.mosaic(
        b.rewards, b.group_ids, b.session_counts, b.success, b.session_traj, b.gains, b.kinds, b.unscored(),
        rho=p.rho, delta=p.delta, lam=p.lam, norm_by_std=p.norm_by_std, eps=p.eps,
    )  # fmt: skip


def _mosaic_dag(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    # The same formula as mosaic with the downstream credit D in place of the immediate gain: every
    # §4.5 property carries over (the session term is a per-kind z-score either way).
    return adv.mosaic(
        b.rewards, b.group_ids, b.session_counts, b.success, b.session_traj, b.downstream, b.kinds, b.unscored(),
        rho=p.rho, delta=p.delta, lam=p.lam, norm_by_std=p.norm_by_std, eps=p.eps,
    )  # fmt: skip


def _turn_level(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    # GRPO outcome (rho = delta = 0) plus the per-kind z-scored turn gain: mosaic-session at turn granularity.
    ts = b.turn_session.long()
    turn_traj = b.session_traj.index_select(0, ts)
    zeros = torch.zeros_like(b.turn_gains, dtype=torch.float64)
    return adv.turn_level(b.rewards, b.group_ids, b.session_counts, b.success, turn_traj, zeros, b.turn_gains,
                          b.kinds.index_select(0, ts), b.turn_is_final, rho=0.0, delta=0.0, lam=p.lam,
                          gamma=p.gamma, norm_by_std=p.norm_by_std, eps=p.eps)  # fmt: skip


def _fold(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    ts = b.turn_session.long()
    a = _outcome(b, p).index_select(0, b.session_traj.index_select(0, ts))
    return a - p.fold_penalty * b.turn_over_half.to(a.dtype)


ESTIMATORS: dict[str, Estimator] = {}
"""The one registry of estimators: the trainer config, the CLI, the docs and the verl plugin read their
names and knobs from here."""
_ALIASES: dict[str, str] = {}


def register(est: Estimator) -> Estimator:
    """Add ``est`` to :data:`ESTIMATORS` (its knobs must be declared in :data:`KNOBS`; no name or
    spelling may be taken)."""
    unknown = [k for k in est.knobs if k not in KNOBS]
    if unknown:
        raise ValueError(f"estimator {est.name!r} reads undeclared knobs {unknown}: add_knob(Knob(...)) first")
    for n in (est.name, *est.spellings()):
        if n in ESTIMATORS or n in _ALIASES:
            raise ValueError(f"estimator name {n!r} is already taken")
    ESTIMATORS[est.name] = est
    _ALIASES.update({a: est.name for a in est.spellings()})
    return est


_SESSION_KNOBS = ("norm_by_std", "eps")
for _e in (
    Estimator("grpo", _grpo, "single-session GRPO: A_i on the trajectory's one session", single_session=True,
              knobs=_SESSION_KNOBS),
    Estimator("broadcast", _broadcast, "A_i copied to every session (4.2)", knobs=_SESSION_KNOBS,
              aliases=("mosaic_broadcast",)),
    Estimator("mosaic-traj", _mosaic_traj, "session-aware trajectory advantage, broadcast (4.3)",
              knobs=("rho", "delta", *_SESSION_KNOBS)),
    Estimator("mosaic-session", _mosaic_session, "A_i + lam z_session (4.4 without 4.3)",
              needs=frozenset({"gains"}), knobs=("lam", *_SESSION_KNOBS)),
    Estimator("mosaic", _mosaic, "session-aware advantage + lam z_session (4.3 + 4.4)",
              needs=frozenset({"gains"}), knobs=("rho", "delta", "lam", *_SESSION_KNOBS)),
    Estimator("mosaic-dag", _mosaic_dag, "session-aware advantage + lam z(downstream credit) (4.3 + 4.10)",
              # (gains: D is propagated along the graph in shares of the immediate gains, so both are scored)
              needs=frozenset({"gains", "downstream"}), knobs=("rho", "delta", "lam", *_SESSION_KNOBS)),
    Estimator("turn-level", _turn_level, "IGPO-style: A_i + lam z_turn on each turn's tokens (4.7)",
              needs=frozenset({"turn_gains", "turn_is_final"}), level="turn", knobs=("lam", "gamma", *_SESSION_KNOBS)),
    Estimator("fold", _fold, "FoldGRPO-style: A_i, minus p on main (and reset) turns past half the budget (4.8)",
              needs=frozenset({"turn_over_half"}), level="turn", knobs=("fold_penalty", *_SESSION_KNOBS)),
):
    register(_e)


def aliases() -> dict[str, str]:
    """Every other spelling -> the registered name it stands for (``mosaic_traj`` -> ``mosaic-traj``)."""
    return dict(_ALIASES)


def resolve_name(name: str) -> str:
    """The registered name ``name`` is (itself, or the estimator it is another spelling of); ValueError
    listing the valid names otherwise."""
    if name in ESTIMATORS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(sorted(ESTIMATORS))}")


def alias_note(name: str) -> str | None:
    """One line when ``name`` is another spelling (``mosaic_traj is another spelling of mosaic-traj``), else None."""
    return f"{name} is another spelling of {_ALIASES[name]}; write {_ALIASES[name]}" if name in _ALIASES else None


def knob_table() -> str:
    """The knobs as a Markdown table (name, type, default, range, the estimators that read it, doc): the docs' table."""
    lines = ["| knob | type | default | range | read by | what |", "| --- | --- | --- | --- | --- | --- |"]
    for k in KNOBS.values():
        users = ", ".join(f"`{n}`" for n, e in ESTIMATORS.items() if k.name in e.knobs) or "none"
        lines.append(f"| `{k.name}` | {k.type.__name__} | `{k.default!r}` | {k.bounds or 'any'} | {users} | {k.doc} |")
    return "\n".join(lines)


def get_estimator(name: str) -> Estimator:
    """The estimator registered under ``name`` or one of its other spellings; ValueError listing the valid names otherwise."""
    return ESTIMATORS[resolve_name(name)]
