"""Generated users and their episodes: an account, visits over simulated days, events between them.

An :class:`Episode` is one user's series of visits. Between two visits, ``events_between`` events change
the world: an order ships or is delivered, the plan lapses, the user moves, gets a new card or changes
the contact channel. Each event is *announced* (the user mentions it at the next visit) with probability
``1 - unannounced_share``:

- an unannounced event is visible only in the backend (the user changed the address online, the
  carrier shipped the order): an agent that does not look it up acts on a stale value;
- an announced order / plan / channel event is in the backend *and* told by the user;
- an announced move or new card is told by the user and is *not* in the backend yet: recording it
  (``update_address`` / ``update_card``) is one of the visit's required actions.

Each visit asks for one request (:data:`~mosaic.envs.service.state.REQUEST_KINDS`), biased toward the
fields the last events changed; its required actions are the rules of :mod:`~mosaic.envs.service.state`
applied to the *true* state at that moment (the target path). The last visit also asks a question
with a short answer about the current state.

``Episode.trap``: the trusting reading of the account (what was looked up at the first visit, plus
what the user announced and the agent's own actions since) gives a different required action, or a
different final answer, than the true state: the trusting expert fails exactly these episodes.

Deterministic per :class:`ServiceConfig` (one ``random.Random`` per config, fixed iteration order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass, field

from mosaic.envs.names import in_partition, make_name, make_word, name_key
from mosaic.envs.service.state import (
    CHANNELS, PLANS, Call, Request, answer_for, apply_event, new_state, snapshot, visit_plan,
)
from mosaic.envs.service.text import announcement, call_from_json, visit_text

ITEM_NOUNS = ("lamp", "kettle", "backpack", "chair", "blender", "jacket", "speaker", "tent", "clock", "rug")
STREET_SUFFIXES = ("Road", "Street", "Lane", "Way")
MAX_VISITS = 50  # visits per episode (``data.visits`` repeats the bound: config sits below envs)


@dataclass(frozen=True)
class ServiceConfig:
    """Knobs of a generated set of service episodes. Same config, same episodes."""

    seed: int = 0
    """Seed of the generator."""
    n_users: int = 100
    """Episodes (one user each)."""
    visits: int = 3
    """Visits per episode (the last one ends with the question)."""
    events_between: int = 2
    """World events between two consecutive visits (at most as many as can happen: each of plan lapse, move,
    card and channel once per gap, and an order shipped or delivered while one is left to)."""
    unannounced_share: float = 0.5
    """Probability that an event is not announced by the user (visible only in the backend)."""
    orders_per_user: int = 3
    """Orders on the account at the first visit."""
    name_partition: tuple[int, int] | None = None
    """``(index, modulo)``: keep only user, city, street and item names in this slice (disjoint splits)."""

    def __post_init__(self) -> None:
        for name, low in (("n_users", 1), ("visits", 1), ("events_between", 0), ("orders_per_user", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"ServiceConfig.{name} must be an int >= {low}, got {value!r}")
        if self.visits > MAX_VISITS:  # generation time grows faster than the visits
            raise ValueError(f"ServiceConfig.visits must be <= {MAX_VISITS}, got {self.visits}")
        if not 0.0 <= self.unannounced_share <= 1.0:
            raise ValueError(f"ServiceConfig.unannounced_share must be in [0, 1], got {self.unannounced_share}")
        if self.orders_per_user > len(ITEM_NOUNS):
            raise ValueError(f"ServiceConfig.orders_per_user must be <= {len(ITEM_NOUNS)}")
        if self.name_partition is not None:
            index, modulo = self.name_partition
            if not (modulo >= 1 and 0 <= index < modulo):
                raise ValueError(f"name_partition must be (index, modulo) with 0 <= index < modulo, "
                                 f"got {self.name_partition}")


@dataclass(frozen=True)
class Event:
    """A change of the world before visit ``visit``, on day ``day``."""

    kind: str  # ship | deliver | lapse | move | card | channel
    day: int
    visit: int
    announced: bool
    target: str = ""  # the order id (ship, deliver)
    field: str = ""  # the account field it changes
    value: str = ""  # the new value (move, card, channel)

    @property
    def in_backend(self) -> bool:
        """Applied to the backend (an announced move or new card waits for the agent to record it)."""
        return not (self.announced and self.kind in ("move", "card"))


@dataclass(frozen=True)
class Visit:
    index: int
    day: int
    request: Request
    required: tuple[Call, ...]
    text: str
    question: str = ""  # the last visit's question kind ("" otherwise)
    question_item: str = ""


@dataclass
class Episode:
    """One user's visits; ``question`` is the first visit's text (what the harness opens with)."""

    id: str
    split: str
    user: str
    initial: dict
    events: list[Event]
    visits: list[Visit]
    target: dict
    answer: str
    trap: bool
    trap_reason: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def question(self) -> str:
        return self.visits[0].text

    @property
    def unannounced(self) -> int:
        return sum(not e.announced for e in self.events)

    def events_before(self, visit: int) -> list[Event]:
        return [e for e in self.events if e.visit == visit]

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for v, visit in zip(data["visits"], self.visits):
            v["required"] = [c.to_json() for c in visit.required]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Episode":
        data = dict(data)
        data["events"] = [Event(**e) for e in data["events"]]
        data["visits"] = [Visit(**{**v, "request": Request(**v["request"]),
                                   "required": tuple(call_from_json(c) for c in v["required"])})
                          for v in data["visits"]]
        return cls(**data)


class _Names:
    """Unique names per kind, drawn from the config's partition."""

    def __init__(self, rng: random.Random, cfg: ServiceConfig):
        self.rng, self.cfg, self.taken = rng, cfg, set()

    def draw(self, make) -> str:
        for _ in range(10_000):
            name = make()
            key = name_key(name)
            if key not in self.taken and in_partition(name, self.cfg.name_partition):
                self.taken.add(key)
                return name
        raise RuntimeError("could not draw a unique name in the partition")

    def user(self) -> str:
        return self.draw(lambda: make_name(self.rng, "person"))

    def city(self) -> str:
        return self.draw(lambda: make_name(self.rng, "city"))

    def street(self) -> str:
        return self.draw(lambda: f"{make_word(self.rng)} {self.rng.choice(STREET_SUFFIXES)}")

    def item(self) -> str:
        return self.draw(lambda: f"{make_word(self.rng)} {self.rng.choice(ITEM_NOUNS)}")


def _address(rng: random.Random, names: _Names, cities: list[str]) -> str:
    return f"{rng.randint(1, 99)} {names.street()}, {rng.choice(cities)}"


def _card(rng: random.Random, old: str = "") -> str:
    while True:
        card = f"{rng.randint(0, 9999):04d}"
        if card != old:
            return card


def _draw_event(rng: random.Random, truth: dict, used: set[str], cfg: ServiceConfig, names: _Names,
                cities: list[str], day: int, visit: int) -> Event | None:
    """One event of a gap between visits; None when no kind of event can happen any more in this gap (every
    once-per-gap kind used and no order left to ship or deliver): the gap then has fewer events."""
    orders = truth["orders"]
    kinds = [k for k, ok in (
        ("ship", any(o["status"] == "placed" for o in orders.values())),
        ("deliver", any(o["status"] == "shipped" for o in orders.values())),
        ("lapse", truth["plan_status"] == "active" and "lapse" not in used),
        ("move", "move" not in used), ("card", "card" not in used), ("channel", "channel" not in used),
    ) if ok]
    if not kinds:
        return None
    kind = rng.choice(kinds)
    used.add(kind)
    announced = rng.random() >= cfg.unannounced_share
    if kind in ("ship", "deliver"):
        want = "placed" if kind == "ship" else "shipped"
        target = rng.choice([oid for oid, o in orders.items() if o["status"] == want])
        return Event(kind, day, visit, announced, target=target, field=f"order:{target}:status")
    if kind == "lapse":
        return Event(kind, day, visit, announced, field="plan_status", value="lapsed")
    if kind == "move":
        return Event(kind, day, visit, announced, field="address", value=_address(rng, names, cities))
    if kind == "card":
        return Event(kind, day, visit, announced, field="card", value=_card(rng, truth["card"]))
    value = rng.choice([c for c in CHANNELS if c != truth["channel"]])
    return Event(kind, day, visit, announced, field="channel", value=value)


def _related(events: list[Event], truth: dict) -> list[Request]:
    """Requests whose correct form depends on what ``events`` changed."""
    out = []
    for e in events:
        if e.kind in ("ship", "deliver"):
            out.append(Request("cancel", item=truth["orders"][e.target]["item"]))
        elif e.kind == "move":
            out += [Request("redirect"), Request("reorder", item=next(iter(truth["orders"].values()))["item"])]
        elif e.kind == "card":
            out.append(Request("reorder", item=next(iter(truth["orders"].values()))["item"]))
        elif e.kind == "lapse":
            out.append(Request("upgrade", tier=truth["plan"]))
    return out


def _feasible(req: Request, truth: dict) -> bool:
    orders = truth["orders"].values()
    if req.kind == "cancel":
        active = [o for o in orders if o["item"] == req.item and o["status"] in ("placed", "shipped", "delivered")]
        return len(active) == 1
    if req.kind == "redirect":
        return any(o["status"] == "placed" and o["address"] != truth["address"] for o in orders)
    if req.kind == "upgrade":
        return truth["plan_status"] == "lapsed" or req.tier != truth["plan"]
    return True


def _draw_request(rng: random.Random, truth: dict, events: list[Event]) -> Request:
    related = [r for r in _related(events, truth) if _feasible(r, truth)]
    if related and rng.random() < 0.7:
        return rng.choice(related)
    items = sorted({o["item"] for o in truth["orders"].values()})
    options = [Request("reorder", item=rng.choice(items)), Request("upgrade", tier=rng.choice(PLANS)),
               Request("redirect")] + [Request("cancel", item=i) for i in items]
    options = [r for r in options if _feasible(r, truth)]
    kind = rng.choice(sorted({r.kind for r in options}))  # a kind first, so cancel (one option per item) is not favoured
    return rng.choice([r for r in options if r.kind == kind])


def _draw_question(rng: random.Random, truth: dict, events: list[Event]) -> tuple[str, str]:
    by_kind = {"ship": "status", "deliver": "status", "move": "city", "card": "card", "lapse": "plan",
               "channel": "channel"}
    changed = [e for e in events if not e.announced]
    if changed and rng.random() < 0.6:
        e = rng.choice(changed)
        kind = by_kind[e.kind]
        return kind, truth["orders"][e.target]["item"] if kind == "status" else ""
    kind = rng.choice(("status", "city", "card", "plan", "channel"))
    return kind, rng.choice(sorted({o["item"] for o in truth["orders"].values()})) if kind == "status" else ""


def generate_episode(rng: random.Random, cfg: ServiceConfig, names: _Names, cities: list[str], index: int,
                     split: str) -> Episode:
    user = names.user()
    items = [names.item() for _ in range(cfg.orders_per_user)]
    statuses = [rng.choice(("placed", "placed", "shipped", "delivered")) for _ in items]
    truth = new_state(user, _address(rng, names, cities), _card(rng), rng.choice(PLANS),
                      rng.choice(CHANNELS), list(zip(items, statuses)))
    initial, belief = snapshot(truth), snapshot(truth)
    events: list[Event] = []
    visits: list[Visit] = []
    trap, reason, day = False, "", rng.randint(1, 5)
    for v in range(cfg.visits):
        gap: list[Event] = []
        if v:
            used: set[str] = set()
            for k in range(cfg.events_between):
                e = _draw_event(rng, truth, used, cfg, names, cities, day + k + 1, v)
                if e is None:  # (more events asked than can happen between two visits)
                    break
                if e.in_backend:
                    apply_event(truth, e)
                gap.append(e)
            day += cfg.events_between + rng.randint(1, 7)
        events += gap
        req = _draw_request(rng, truth, gap)
        before_truth = snapshot(truth)
        required = visit_plan(truth, gap, req, believe=False)
        believed = visit_plan(belief, gap, req, believe=True)
        if not trap and believed != required:
            trap, reason = True, f"visit {v + 1}: {req.kind} needs {required}, memory gives {believed}"
        last = v == cfg.visits - 1
        q_kind, q_item = _draw_question(rng, truth, events) if last else ("", "")
        text = visit_text(v, cfg.visits, day, user, [announcement(e, before_truth) for e in gap if e.announced],
                          req, q_kind, q_item)
        visits.append(Visit(v, day, req, tuple(required), text, q_kind, q_item))
    answer = answer_for(truth, visits[-1].question, visits[-1].question_item)
    if not trap and answer_for(belief, visits[-1].question, visits[-1].question_item) != answer:
        trap, reason = True, f"question {visits[-1].question}: true {answer!r}, memory gives another value"
    digest = hashlib.sha1(json.dumps([user, visits[0].text, answer]).encode()).hexdigest()[:8]
    return Episode(f"{split}-{index:05d}-{digest}", split, user, initial, events, visits, snapshot(truth),
                   answer, trap, reason)


def generate_episodes(cfg: ServiceConfig, split: str = "none") -> list[Episode]:
    """``cfg.n_users`` episodes (deterministic in ``cfg`` and ``split``)."""
    rng = random.Random(f"service/{cfg.seed}")
    names = _Names(rng, cfg)
    cities = [names.city() for _ in range(max(6, cfg.n_users // 4))]
    return [generate_episode(rng, cfg, names, cities, i, split) for i in range(cfg.n_users)]


def dumps(episodes: list[Episode]) -> str:
    return json.dumps([e.to_json() for e in episodes], sort_keys=True)
