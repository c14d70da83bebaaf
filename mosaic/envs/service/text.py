"""What the agent reads: visit messages, announcements, and the lookup tools' text (and how to read it back).

The lookup formats are fixed so the scripted experts can parse them (:func:`parse_account`,
:func:`parse_orders`); a model reads the same text.
"""

from __future__ import annotations

import re

from mosaic.envs.service.state import Call, Request, call

REQUEST_TEXT = {
    "reorder": "Please order another {item} for me.",
    "cancel": "I no longer want my {item}; please take care of it.",
    "upgrade": "Please put me on the {tier} plan.",
    "redirect": "Please make sure my pending orders ship to the address on my account.",
}
QUESTION_TEXT = {
    "status": "Also, what is the status of my {item} order now?",
    "city": "Also, which city is the address on my account in?",
    "card": "Also, what are the last four digits of the card on my account?",
    "plan": "Also, is my plan active or lapsed?",
    "channel": "Also, which contact channel is on my account?",
}
VISIT_RE = re.compile(r"^Visit (\d+) of (\d+), day (\d+)\.", re.M)


def announcement(event, state: dict) -> str:
    """What the user says about an announced ``event`` (``state``: the account before the visit)."""
    if event.kind == "ship":
        return f"I saw that my {state['orders'][event.target]['item']} order has shipped."
    if event.kind == "deliver":
        return f"My {state['orders'][event.target]['item']} was delivered."
    if event.kind == "lapse":
        return "I noticed that my plan lapsed."
    if event.kind == "channel":
        return f"I switched my contact channel to {event.value} online."
    if event.kind == "move":
        return f"I have moved; my new address is {event.value}."
    if event.kind == "card":
        return f"I have a new card, ending {event.value}."
    raise ValueError(f"unknown event kind {event.kind!r}")


def visit_text(index: int, n_visits: int, day: int, user: str, said: list[str], req: Request,
               question: str = "", item: str = "") -> str:
    parts = [f"Visit {index + 1} of {n_visits}, day {day}. Customer {user} says:", *said,
             REQUEST_TEXT[req.kind].format(item=req.item, tier=req.tier)]
    if question:
        parts.append(QUESTION_TEXT[question].format(item=item))
        parts.append("(Last visit: when the request is done, answer with <answer>...</answer>.)")
    else:
        parts.append("(When the request is done, call end_visit.)")
    return " ".join(parts)


def call_from_json(data: dict) -> Call:
    return call(data["name"], **data["arguments"])


def format_account(row: dict) -> str:
    return (f"Account of {row['name']}\naddress: {row['address']}\ncard: ending {row['card']}\n"
            f"plan: {row['plan']} ({row['plan_status']})\ncontact: {row['channel']}")


def format_order(oid: str, o: dict) -> str:
    return f"{oid} | {o['item']} | {o['status']} | ship to {o['address']}"


def format_orders(orders: dict) -> str:
    if not orders:
        return "No orders."
    return "\n".join(format_order(oid, o) for oid, o in orders.items())


_ACCOUNT = re.compile(r"^Account of (?P<name>.+)\naddress: (?P<address>.+)\ncard: ending (?P<card>\d{4})\n"
                      r"plan: (?P<plan>\w+) \((?P<plan_status>\w+)\)\ncontact: (?P<channel>\w+)$")
_ORDER = re.compile(r"^(?P<id>o\d+) \| (?P<item>.+?) \| (?P<status>\w+) \| ship to (?P<address>.+)$")


def parse_account(text: str) -> dict | None:
    """The fields of a :func:`format_account` text (None if it is not one)."""
    m = _ACCOUNT.match(text.strip())
    return m.groupdict() if m else None


def parse_orders(text: str) -> dict | None:
    """``{order_id: {item, status, address}}`` from a :func:`format_orders` text (None if not one)."""
    text = text.strip()
    if text == "No orders.":
        return {}
    out = {}
    for line in text.splitlines():
        m = _ORDER.match(line)
        if m is None:
            return None
        d = m.groupdict()
        out[d.pop("id")] = d
    return out
