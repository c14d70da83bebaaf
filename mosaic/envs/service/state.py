"""The account model in plain Python: what a request requires, what an action does, what a question asks.

One user's account is a dict (:func:`new_state`)::

    {"name", "address", "card", "plan", "plan_status", "channel",
     "orders": {order_id: {"item", "status", "address"}}}

The same pure functions give the target path (the generator applies the required actions to the true
state), the trusting expert's belief (remembered facts plus announcements) and the experts' plans; the
SQLite backend (:mod:`mosaic.envs.service.backend`) implements the same rules independently, and the
tests check that the expert's run through the backend ends on the target state.

Rules of the service (the agent reads them in its system prompt, :data:`SERVICE_RULES`):

- ``cancel`` an item: an order still ``placed`` is cancelled (``cancel_order``); one ``shipped`` or
  ``delivered`` is returned (``return_order``).
- ``reorder`` an item: ``create_order`` with the address and card on file *now*.
- ``upgrade`` to a tier: an ``active`` plan is changed (``change_plan``); a ``lapsed`` one is renewed
  (``renew_plan``).
- ``redirect``: every order still ``placed`` whose ship-to address is not the address on file gets
  ``update_order_address`` to it.
- an announced move or new card is recorded first (``update_address`` / ``update_card``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

PLANS = ("basic", "plus", "premium")
CHANNELS = ("email", "sms", "phone")
ORDER_STATUSES = ("placed", "shipped", "delivered", "returned", "cancelled")
ACTIVE = ("placed", "shipped", "delivered")
"""Statuses of an order the customer may still cancel or return."""
USER_FIELDS = ("address", "card", "plan", "plan_status", "channel")

SERVICE_RULES = (
    "Service rules: to cancel an item, an order still placed is cancelled (cancel_order) and one already "
    "shipped or delivered is returned (return_order). A reorder uses the address and card on file now. "
    "An upgrade changes an active plan (change_plan) and renews a lapsed one (renew_plan). A redirect "
    "moves every order still placed to the address on file (update_order_address). Record an announced "
    "move or new card first (update_address, update_card). Accounts change between visits: check before "
    "you act. Call end_visit when a visit's request is done; answer the last visit's question with "
    "<answer>...</answer>."
)


@dataclass(frozen=True)
class Call:
    """One tool call: ``name`` and its arguments as sorted ``(key, value)`` pairs (hashable, comparable)."""

    name: str
    args: tuple[tuple[str, str], ...] = ()

    @property
    def kw(self) -> dict[str, str]:
        return dict(self.args)

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.kw}


def call(name: str, **kw: str) -> Call:
    return Call(name, tuple(sorted(kw.items())))


@dataclass(frozen=True)
class Request:
    """What a visit asks for: ``kind`` in :data:`REQUEST_KINDS`, with its item or tier."""

    kind: str
    item: str = ""
    tier: str = ""


REQUEST_KINDS = ("reorder", "cancel", "upgrade", "redirect")
QUESTION_KINDS = ("status", "city", "card", "plan", "channel")


def new_state(name: str, address: str, card: str, plan: str, channel: str,
              orders: list[tuple[str, str]]) -> dict:
    """An account with ``orders`` as ``(item, status)`` pairs, all shipping to ``address``."""
    return {"name": name, "address": address, "card": card, "plan": plan, "plan_status": "active",
            "channel": channel,
            "orders": {f"o{i + 1}": {"item": item, "status": status, "address": address}
                       for i, (item, status) in enumerate(orders)}}


def latest_active(state: dict, item: str) -> str | None:
    """The newest order of ``item`` that can still be cancelled or returned (None if none)."""
    ids = [oid for oid, o in state["orders"].items() if o["item"] == item and o["status"] in ACTIVE]
    return ids[-1] if ids else None


def plan_request(state: dict, req: Request) -> list[Call]:
    """The actions ``req`` requires on an account in ``state`` (see the module docstring)."""
    if req.kind == "reorder":
        return [call("create_order", item=req.item, address=state["address"], card=state["card"])]
    if req.kind == "cancel":
        oid = latest_active(state, req.item)
        if oid is None:
            return []
        verb = "cancel_order" if state["orders"][oid]["status"] == "placed" else "return_order"
        return [call(verb, order_id=oid)]
    if req.kind == "upgrade":
        verb = "change_plan" if state["plan_status"] == "active" else "renew_plan"
        return [call(verb, tier=req.tier)]
    if req.kind == "redirect":
        return [call("update_order_address", order_id=oid, address=state["address"])
                for oid, o in state["orders"].items()
                if o["status"] == "placed" and o["address"] != state["address"]]
    raise ValueError(f"unknown request kind {req.kind!r}")


def apply_call(state: dict, c: Call) -> None:
    """Apply a (valid) mutating call to ``state`` in place; lookups and end_visit change nothing."""
    kw, orders = c.kw, state["orders"]
    if c.name == "create_order":
        orders[f"o{len(orders) + 1}"] = {"item": kw["item"], "status": "placed", "address": kw["address"]}
    elif c.name == "cancel_order":
        orders[kw["order_id"]]["status"] = "cancelled"
    elif c.name == "return_order":
        orders[kw["order_id"]]["status"] = "returned"
    elif c.name == "update_order_address":
        orders[kw["order_id"]]["address"] = kw["address"]
    elif c.name in ("change_plan", "renew_plan"):
        state["plan"], state["plan_status"] = kw["tier"], "active"
    elif c.name == "update_address":
        state["address"] = kw["address"]
    elif c.name == "update_card":
        state["card"] = kw["card"]


def apply_event(state: dict, event) -> None:
    """Apply a world event (:class:`mosaic.envs.service.world.Event`) to ``state`` in place."""
    if event.kind in ("ship", "deliver"):
        state["orders"][event.target]["status"] = "shipped" if event.kind == "ship" else "delivered"
    elif event.kind == "lapse":
        state["plan_status"] = "lapsed"
    else:  # move, card, channel
        state[event.field] = event.value


def visit_plan(state: dict, events, req: Request, *, believe: bool) -> list[Call]:
    """The actions a visit requires, applied to ``state`` in place, given the ``events`` before it.

    First the announced move / new card are recorded (``update_address`` / ``update_card``), then the
    request's actions. ``believe``: ``state`` is a belief (what was looked up earlier), so the events the
    user announces are learnt from the announcement; otherwise ``state`` is the backend's truth, which
    already holds every event that reached the backend."""
    updates = []
    for e in events:
        if e.in_backend and believe and e.announced:
            apply_event(state, e)
        elif not e.in_backend:
            updates.append(Call("update_address" if e.kind == "move" else "update_card",
                                ((e.field, e.value),)))
    for c in updates:
        apply_call(state, c)
    actions = plan_request(state, req)
    for c in actions:
        apply_call(state, c)
    return updates + actions


def city_of(address: str) -> str:
    return address.rsplit(", ", 1)[-1]


def answer_for(state: dict, kind: str, item: str = "") -> str:
    """The short answer to a final question of ``kind`` on ``state``."""
    if kind == "status":
        ids = [oid for oid, o in state["orders"].items() if o["item"] == item]
        return state["orders"][ids[-1]]["status"] if ids else "none"
    if kind == "city":
        return city_of(state["address"])
    if kind == "card":
        return state["card"]
    if kind == "plan":
        return state["plan_status"]
    if kind == "channel":
        return state["channel"]
    raise ValueError(f"unknown question kind {kind!r}")


def uses(state: dict, c: Call) -> tuple[str, ...]:
    """The state fields whose values an action's arguments (or its choice) rely on.

    Field names: the user fields, and ``order:<id>:status`` / ``order:<id>:address``. An action on an
    order relies on that order's status (it decides cancel vs return, and whether it is allowed); one
    that carries an address or card relies on the value on file."""
    kw = c.kw
    out = []
    if c.name == "create_order":
        out += ["address", "card"]
    if c.name in ("cancel_order", "return_order", "update_order_address") and kw.get("order_id") in state["orders"]:
        out.append(f"order:{kw['order_id']}:status")
    if c.name == "update_order_address":
        out.append("address")
    if c.name in ("change_plan", "renew_plan"):
        out.append("plan_status")
    return tuple(out)


def sets(c: Call, order_ids) -> tuple[str, ...]:
    """The fields an action writes (after it the agent knows their value)."""
    kw = c.kw
    if c.name in ("cancel_order", "return_order") and kw.get("order_id") in order_ids:
        return (f"order:{kw['order_id']}:status",)
    if c.name == "update_order_address" and kw.get("order_id") in order_ids:
        return (f"order:{kw['order_id']}:address",)
    if c.name in ("change_plan", "renew_plan"):
        return ("plan", "plan_status")
    if c.name == "update_address":
        return ("address",)
    if c.name == "update_card":
        return ("card",)
    return ()


def snapshot(state: dict) -> dict:
    return copy.deepcopy(state)
