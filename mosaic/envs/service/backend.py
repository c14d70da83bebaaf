"""The account backend: an in-process SQLite database the tools read and mutate, one per rollout.

Two tables: ``account`` (one row per field of the user) and ``orders`` (id, seq, item, status, address).
The business rules are checked here, in SQL terms, independently of the plain-Python model of
:mod:`mosaic.envs.service.state` (the tests check the two agree along the expert's runs). A call
that breaks a rule raises :class:`Rejected` and changes nothing.
"""

from __future__ import annotations

import sqlite3

from mosaic.envs.service.state import PLANS, USER_FIELDS, Call

SCHEMA = """
CREATE TABLE account (field TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE orders (id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, item TEXT NOT NULL,
                     status TEXT NOT NULL, address TEXT NOT NULL);
"""


class Rejected(Exception):
    """A well-formed action that the account's state does not allow (the message says why)."""


class Backend:
    """One user's account in a fresh in-memory database, loaded from an episode's initial state."""

    def __init__(self, initial: dict):
        # any thread may use it (an external harness's tool calls arrive on server threads); ServiceEnv
        # serialises the calls
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.executescript(SCHEMA)
        rows = [("name", initial["name"])] + [(f, initial[f]) for f in USER_FIELDS]
        self.db.executemany("INSERT INTO account VALUES (?, ?)", rows)
        for seq, (oid, o) in enumerate(initial["orders"].items(), 1):
            self.db.execute("INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                            (oid, seq, o["item"], o["status"], o["address"]))
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ reads
    def account(self) -> dict:
        return dict(self.db.execute("SELECT field, value FROM account"))

    def orders(self) -> dict:
        rows = self.db.execute("SELECT id, item, status, address FROM orders ORDER BY seq")
        return {oid: {"item": item, "status": status, "address": address} for oid, item, status, address in rows}

    def order(self, oid: str) -> dict | None:
        return self.orders().get(oid)

    def snapshot(self) -> dict:
        """The account in the shape of :func:`mosaic.envs.service.state.new_state` (compared to the target)."""
        return {**self.account(), "orders": self.orders()}

    # ------------------------------------------------------------------ writes
    def _set(self, field: str, value: str) -> None:
        self.db.execute("UPDATE account SET value = ? WHERE field = ?", (value, field))

    def _set_order(self, oid: str, column: str, value: str) -> None:
        if column not in ("status", "address"):
            raise ValueError(f"no order column {column!r}")
        self.db.execute(f"UPDATE orders SET {column} = ? WHERE id = ?", (value, oid))

    def apply_event(self, event) -> None:
        """A world event between visits (:class:`mosaic.envs.service.world.Event`)."""
        if event.kind in ("ship", "deliver"):
            self._set_order(event.target, "status", "shipped" if event.kind == "ship" else "delivered")
        elif event.kind == "lapse":
            self._set("plan_status", "lapsed")
        else:
            self._set(event.field, event.value)
        self.db.commit()

    def _status(self, oid: str, allowed: tuple[str, ...], verb: str) -> None:
        o = self.order(oid)
        if o is None:
            raise KeyError(oid)
        if o["status"] not in allowed:
            raise Rejected(f"order {oid} is {o['status']}; only a {' or '.join(allowed)} order can be {verb}.")

    def mutate(self, c: Call) -> str:
        """Carry out a mutating call whose arguments are well-formed; returns the confirmation text."""
        kw, acct = c.kw, self.account()
        if c.name == "create_order":
            if kw["card"] != acct["card"]:
                raise Rejected(f"card ending {kw['card']} is not on file.")
            seq = self.db.execute("SELECT COUNT(*) FROM orders").fetchone()[0] + 1
            oid = f"o{seq}"
            self.db.execute("INSERT INTO orders VALUES (?, ?, ?, 'placed', ?)", (oid, seq, kw["item"], kw["address"]))
            out = f"Order {oid} placed: {kw['item']}, ship to {kw['address']}, card ending {kw['card']}."
        elif c.name in ("cancel_order", "return_order"):
            allowed, done = (("placed",), "cancelled") if c.name == "cancel_order" else (("shipped", "delivered"), "returned")
            self._status(kw["order_id"], allowed, done)
            self._set_order(kw["order_id"], "status", done)
            out = f"Order {kw['order_id']} {done}."
        elif c.name == "update_order_address":
            self._status(kw["order_id"], ("placed",), "redirected")
            self._set_order(kw["order_id"], "address", kw["address"])
            out = f"Order {kw['order_id']} now ships to {kw['address']}."
        elif c.name in ("change_plan", "renew_plan"):
            out = self._plan(c.name, kw["tier"], acct)
        elif c.name in ("update_address", "update_card"):
            field = "address" if c.name == "update_address" else "card"
            self._set(field, kw[field])
            out = f"The {field} on file is now {kw[field]}."
        else:
            raise ValueError(f"{c.name} is not a mutating call")
        self.db.commit()
        return out

    def _plan(self, verb: str, tier: str, acct: dict) -> str:
        if tier not in PLANS:
            raise ValueError(f"no plan {tier!r}")
        if verb == "change_plan":
            if acct["plan_status"] != "active":
                raise Rejected("the plan is lapsed; a lapsed plan is renewed, not changed.")
            if acct["plan"] == tier:
                raise Rejected(f"the plan is already {tier}.")
        elif acct["plan_status"] != "lapsed":
            raise Rejected("the plan is active; an active plan is changed, not renewed.")
        self._set("plan", tier)
        self._set("plan_status", "active")
        return f"The plan is now {tier} (active)."
