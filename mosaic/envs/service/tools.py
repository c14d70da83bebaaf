"""The service tools and the environment a harness drives: JSON arguments in, text out.

:class:`ServiceEnv` keeps one rollout per key (a trajectory id): :meth:`~ServiceEnv.open` loads a fresh
SQLite backend from the episode's initial state and returns the first visit's text;
:meth:`~ServiceEnv.call` runs one tool; :meth:`~ServiceEnv.finish` scores the rollout and frees it.

Errors. Arguments that are not what the tool takes (not an object, a missing or extra key, a value
that is not a non-empty string, an unknown tier, a card that is not four digits, an address without
``street, city``, an order id the account does not have, a call after the rollout ended) raise
:class:`ToolError`: a harness shows its message and counts it as a tool error (so does the rollout:
``tool_errors``). A well-formed action that the account's state does not allow (cancelling a shipped
order, ``end_visit`` at the last visit) returns ``Rejected: ...`` and is counted as ``rejected``; a
rejected *mutating* action is also ``forbidden`` (it fails the rollout, see
:mod:`mosaic.envs.service.rewards`).

``end_visit`` closes the visit: the events before the next visit are applied to the backend and the
reply is the next visit's message (what the user says). The last visit ends with an answer.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from dataclasses import dataclass, field

from mosaic.envs.service.backend import Backend, Rejected
from mosaic.envs.service.rewards import ServiceOutcome, StaleTracker, score_rollout
from mosaic.envs.service.state import PLANS, SERVICE_RULES, USER_FIELDS, Call, call, sets, uses
from mosaic.envs.service.text import format_account, format_order, format_orders

TOOLS: dict[str, tuple[tuple[str, ...], str]] = {
    "get_account": ((), "the account on file: address, card, plan and its status, contact channel"),
    "list_orders": ((), "every order: id, item, status, ship-to address"),
    "get_order": (("order_id",), "one order"),
    "create_order": (("item", "address", "card"), "place a new order (card: the last four digits on file)"),
    "cancel_order": (("order_id",), "cancel an order that is still placed"),
    "return_order": (("order_id",), "return an order that is shipped or delivered"),
    "update_order_address": (("order_id", "address"), "change where a placed order ships"),
    "change_plan": (("tier",), "change an active plan to tier basic, plus or premium"),
    "renew_plan": (("tier",), "renew a lapsed plan at tier basic, plus or premium"),
    "update_address": (("address",), "record the customer's new address (street, city)"),
    "update_card": (("card",), "record the customer's new card (last four digits)"),
    "end_visit": ((), "close this visit; the reply is the customer's next visit"),
}
"""Tool name -> (argument names, what it does). Every argument is a non-empty string."""
LOOKUPS = ("get_account", "list_orders", "get_order")
MUTATIONS = tuple(n for n in TOOLS if n not in LOOKUPS and n != "end_visit")
MAX_ARG_CHARS = 200
_ORDER_ID = re.compile(r"^o\d{1,4}$")


class ToolError(ValueError):
    """Bad arguments (or no such tool, or no open rollout): a counted tool error, never a crash."""


def tool_docs() -> str:
    """The tools as the system prompt lists them."""
    lines = [f"- {n}({', '.join(a)}): {d}" for n, (a, d) in TOOLS.items()]
    lines.append('Example: <tool_call>{"name": "cancel_order", "arguments": {"order_id": "o2"}}</tool_call>')
    return "\n".join(lines)


def check_args(name: str, arguments) -> Call:
    """The call ``name(arguments)`` after checking its shape and values; raises :class:`ToolError`."""
    if name not in TOOLS:
        raise ToolError(f"no tool named {name[:40]!r}; available: {', '.join(TOOLS)}.")
    want = TOOLS[name][0]
    shape = "{" + ", ".join(f'"{a}": "..."' for a in want) + "}"
    if not isinstance(arguments, dict) or set(arguments) != set(want):
        raise ToolError(f"{name} takes the arguments {shape}.")
    kw = {}
    for key, value in arguments.items():
        if not isinstance(value, str) or not value.strip():
            raise ToolError(f"{name}: {key} must be a non-empty string; arguments {shape}.")
        if len(value) > MAX_ARG_CHARS:
            raise ToolError(f"{name}: {key} has {len(value)} characters; the limit is {MAX_ARG_CHARS}.")
        kw[key] = value.strip()
    if "tier" in kw and kw["tier"] not in PLANS:
        raise ToolError(f"{name}: tier must be one of {', '.join(PLANS)}.")
    if "card" in kw and not re.fullmatch(r"\d{4}", kw["card"]):
        raise ToolError(f"{name}: card must be the last four digits, e.g. \"0421\".")
    if "address" in kw and ", " not in kw["address"]:
        raise ToolError(f"{name}: address must read \"street, city\".")
    if "order_id" in kw and not _ORDER_ID.match(kw["order_id"]):
        raise ToolError(f"{name}: order_id looks like \"o2\".")
    return call(name, **kw)


@dataclass
class Rollout:
    """One rollout in progress: its backend and what the agent has done and seen."""

    episode: object
    backend: Backend
    visit: int = 0
    tick: int = 0
    tracker: StaleTracker = field(default_factory=StaleTracker)
    attempts: list[list[Call]] = field(default_factory=lambda: [[]])  # well-formed mutations, per visit
    stale: list[dict] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)


class ServiceEnv:
    """The service family behind a harness: one :class:`Rollout` per key; see the module docstring."""

    tool_names = tuple(TOOLS)
    tool_docs = staticmethod(tool_docs)
    system_rules = SERVICE_RULES
    """Appended to the harness's system prompts (:class:`mosaic.agent.episode.EnvHooks`)."""

    def current_question(self, key: str) -> str:
        """The current visit's text of rollout ``key`` (what a resumed session must be told after a compaction)."""
        r = self.rollouts.get(key)
        if r is None:
            raise ToolError(f"no open rollout {key!r}")
        return r.episode.visits[r.visit].text

    def __init__(self, episodes=()):
        self.episodes = {e.id: e for e in episodes}
        self.rollouts: dict[str, Rollout] = {}
        self._lock = threading.RLock()  # open / call / finish from several threads (an external harness's server)

    def open(self, key: str, episode) -> str:
        """Start a rollout of ``episode`` under ``key`` (a fresh backend); returns the first visit's text."""
        with self._lock:
            return self._open(key, episode)

    def call(self, key: str, name: str, arguments) -> str:
        """Run tool ``name`` in rollout ``key`` (see :meth:`_call`)."""
        with self._lock:
            return self._call(key, name, arguments)

    def finish(self, key: str, answer_text: str | None) -> ServiceOutcome:
        """Score rollout ``key`` with the agent's final message (None: it never answered) and free it."""
        with self._lock:
            return self._finish(key, answer_text)

    def _open(self, key: str, episode) -> str:
        """Start a rollout of ``episode`` under ``key`` (a fresh backend); returns the first visit's text."""
        if not (hasattr(episode, "initial") and hasattr(episode, "visits")):
            raise TypeError(f"ServiceEnv runs service episodes (mosaic.envs.service.Episode), got "
                            f"{type(episode).__name__}")
        if key in self.rollouts:
            self.rollouts.pop(key).backend.close()
        self.rollouts[key] = Rollout(episode, Backend(episode.initial))
        return episode.visits[0].text

    def search(self, query: str, k: int) -> str:
        raise ToolError("the service environment has no search tool")

    def _call(self, key: str, name: str, arguments) -> str:
        """Run tool ``name`` with ``arguments`` (a dict) in rollout ``key``; raises :class:`ToolError`."""
        r = self.rollouts.get(key)
        if r is None:
            raise ToolError(f"no open rollout {key!r}")
        r.tick += 1
        try:
            c = check_args(name, arguments)
            if "order_id" in c.kw and r.backend.order(c.kw["order_id"]) is None:
                raise ToolError(f"{name}: the account has no order {c.kw['order_id']}.")
        except ToolError:
            r.counts["tool_errors"] += 1
            raise
        r.counts["calls"] += 1
        if name in LOOKUPS:
            return self._lookup(r, c)
        if name == "end_visit":
            return self._end_visit(r)
        return self._mutate(r, c)

    def _lookup(self, r: Rollout, c: Call) -> str:
        if c.name == "get_account":
            r.tracker.see(USER_FIELDS, r.tick)
            return format_account(r.backend.account())
        orders = r.backend.orders()
        if c.name == "get_order":
            orders = {c.kw["order_id"]: orders[c.kw["order_id"]]}
        r.tracker.see([f"order:{oid}:{f}" for oid in orders for f in ("status", "address")], r.tick)
        return format_orders(orders) if c.name == "list_orders" else format_order(*next(iter(orders.items())))

    def _end_visit(self, r: Rollout) -> str:
        visits = r.episode.visits
        if r.visit + 1 >= len(visits):
            r.counts["rejected"] += 1
            return "Rejected: this is the last visit; answer the customer's question with <answer>...</answer>."
        r.visit += 1
        for e in r.episode.events_before(r.visit):
            if not e.in_backend:
                continue
            r.tick += 1
            r.backend.apply_event(e)
            r.tracker.change(e.field, r.tick)
        r.tick += 1
        r.tracker.see([e.field for e in r.episode.events_before(r.visit) if e.announced and e.in_backend], r.tick)
        r.attempts.append([])
        return visits[r.visit].text

    def _mutate(self, r: Rollout, c: Call) -> str:
        state = r.backend.snapshot()
        r.counts["actions"] += 1
        stale = r.tracker.stale(uses(state, c))
        if stale:
            r.stale.append({"visit": r.visit, "call": c.to_json(), "fields": stale})
        r.attempts[r.visit].append(c)
        try:
            out = r.backend.mutate(c)
        except Rejected as exc:
            r.counts["rejected"] += 1
            r.counts["forbidden"] += 1
            r.tracker.see([f for f in uses(state, c) if f.startswith("order:")], r.tick)  # the message shows it
            return f"Rejected: {exc}"
        written = sets(c, state["orders"])
        if c.name == "create_order":
            new = next(reversed(r.backend.orders()))
            written = (f"order:{new}:status", f"order:{new}:address")
        r.tracker.see(written, r.tick)
        return out

    def _finish(self, key: str, answer_text: str | None) -> ServiceOutcome:
        """Score rollout ``key`` with the agent's final message (None: it never answered) and free it."""
        r = self.rollouts.pop(key, None)
        if r is None:
            raise ToolError(f"no open rollout {key!r}")
        try:
            return score_rollout(r.episode, r.backend.snapshot(), r.attempts, answer_text,
                                 visits_reached=r.visit + 1, actions=r.counts["actions"], stale=r.stale,
                                 tool_errors=r.counts["tool_errors"], rejected=r.counts["rejected"],
                                 forbidden=r.counts["forbidden"])
        finally:
            r.backend.close()
