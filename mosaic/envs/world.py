"""The seeded world: typed entities, relations, attributes and one document each.

Everything is drawn from one ``random.Random(seed)``, iterating in a fixed
order, so the same :class:`WorldConfig` always gives the same world (byte for
byte: see :attr:`World.content_hash`).

Each relation fact of an entity is stated in *that entity's* document (the
"source" document), so a hop ``entity --relation--> target`` is answered by
searching for the entity's name plus the relation word. Every sentence template
of a relation contains a word with the same stem as the relation word, in
varied phrasing; filler sentences never use relation words.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass, field

from mosaic.envs.names import in_partition, make_name, name_key, near_duplicate

ENTITY_TYPES = ("person", "city", "company", "university", "river", "mountain", "country")
# Share of entities per type (before the minimum of two per type).
TYPE_SHARES = {
    "person": 0.38, "city": 0.15, "company": 0.15, "university": 0.08,
    "river": 0.08, "mountain": 0.08, "country": 0.08,
}


@dataclass(frozen=True)
class Relation:
    """A typed relation. ``word`` is what a searcher pairs with the entity name."""

    name: str
    source: str
    target: str
    word: str
    templates: tuple[str, ...]  # "{s}" source name, "{t}" target name(s)
    phrases: tuple[str, ...]  # question noun phrases, "{x}" the source
    multi: bool = False  # more than one target possible


RELATIONS: tuple[Relation, ...] = (
    Relation("born_in", "person", "city", "born", (
        "{s} was born in {t}.", "{t} is the city where {s} was born.",
        "Records show that {s} was born in {t}.", "Born in {t}, {s} moved away young.",
    ), ("the birthplace of {x}", "the city where {x} was born")),
    Relation("studied_at", "person", "university", "studied", (
        "{s} studied at {t}.", "At {t}, {s} studied for several years.",
        "{t} is where {s} studied.",
    ), ("the university where {x} studied", "the place {x} studied at")),
    Relation("works_for", "person", "company", "works", (
        "{s} works for {t}.", "These days {s} works at {t}.", "{t} is the company {s} works for.",
    ), ("the employer of {x}", "the company {x} works for")),
    Relation("mentor", "person", "person", "mentor", (
        "The mentor of {s} was {t}.", "{t} served as mentor to {s}.",
        "{s} trained under a mentor, {t}.",
    ), ("the mentor of {x}", "the person who was mentor to {x}")),
    Relation("country", "city", "country", "country", (
        "{s} is a city in the country of {t}.", "{t} is the country that {s} belongs to.",
        "In the country of {t} lies {s}.",
    ), ("the country of {x}", "the country in which {x} lies")),
    Relation("founder", "company", "person", "founder", (
        "The founder of {s} is {t}.", "{s} names {t} as its founder.",
        "{t} is remembered as the founder of {s}.",
    ), ("the founder of {x}", "the person who is the founder of {x}")),
    Relation("headquarters", "company", "city", "headquarters", (
        "{s} is headquartered in {t}.", "{s} has its headquarters in {t}.",
        "{t} hosts the headquarters of {s}.",
    ), ("the city where {x} is headquartered", "the headquarters city of {x}")),
    Relation("director", "company", "person", "director", (
        "The director of {s} is {t}.", "{t} is director of {s}.",
        "{s} is run by its director, {t}.",
    ), ("the director of {x}", "the person serving as director of {x}")),
    Relation("founder", "university", "person", "founder", (
        "The founder of {s} was {t}.", "{s} honours {t} as its founder.",
        "{t} is known as the founder of {s}.",
    ), ("the founder of {x}", "the person who is the founder of {x}")),
    Relation("campus", "university", "city", "campus", (
        "The campus of {s} lies in {t}.", "{s} has its main campus in {t}.",
        "{t} is home to the campus of {s}.",
    ), ("the city with the campus of {x}", "the campus city of {x}")),
    Relation("source", "river", "mountain", "source", (
        "{s} has its source on {t}.", "The source of {s} is on the slopes of {t}.",
        "{t} is the source of {s}.",
    ), ("the mountain at the source of {x}", "the source mountain of {x}")),
    Relation("mouth", "river", "city", "mouth", (
        "The mouth of {s} is at {t}.", "{s} meets the sea at its mouth near {t}.",
        "{t} stands at the mouth of {s}.",
    ), ("the city at the mouth of {x}", "the mouth city of {x}")),
    Relation("flows_through", "river", "city", "flows", (
        "{s} flows through {t}.", "On its way, {s} flows past {t}.",
        "Travellers see {s} as it flows through {t}.",
    ), ("a city that {x} flows through",), multi=True),
    Relation("country", "mountain", "country", "country", (
        "{s} rises in the country of {t}.", "{t} is the country where {s} stands.",
        "In the country of {t} stands {s}.",
    ), ("the country of {x}", "the country in which {x} stands")),
    Relation("first_climber", "mountain", "person", "climbed", (
        "{s} was first climbed by {t}.", "{t} climbed {s} before anyone else.",
        "The first person to have climbed {s} was {t}.",
    ), ("the first person to climb {x}", "the person who first climbed {x}")),
    Relation("capital", "country", "city", "capital", (
        "The capital of {s} is {t}.", "{t} serves as the capital of {s}.",
        "{s} has {t} as its capital.",
    ), ("the capital of {x}", "the capital city of {x}")),
    Relation("president", "country", "person", "president", (
        "The president of {s} is {t}.", "{t} serves as president of {s}.",
        "{s} elected {t} as its president.",
    ), ("the president of {x}", "the person serving as president of {x}")),
)
RELATIONS_BY_KEY = {(r.source, r.name): r for r in RELATIONS}

# Filler: attributes and neutral facts. Never use a relation word here.
ATTRIBUTES: dict[str, tuple[tuple[str, str, tuple[int, int]], ...]] = {
    # (attribute, sentence template with {s} and {v}, value range)
    "person": (("birth_year", "{s} came into the world in {v}.", (1900, 2000)),
               ("height_cm", "{s} is {v} centimetres tall.", (150, 200))),
    "city": (("population", "{s} has a population of {v} people.", (5_000, 900_000)),
             ("settled", "The first houses of {s} date from {v}.", (900, 1900))),
    "company": (("employees", "{s} employs {v} people.", (12, 90_000)),
                ("established", "{s} opened its doors in {v}.", (1850, 2020))),
    "university": (("students", "{s} enrols {v} students.", (800, 60_000)),
                   ("chartered", "{s} received its charter in {v}.", (1500, 1990))),
    "river": (("length_km", "{s} is {v} kilometres long.", (20, 3_000)),
              ("basin_km2", "The basin of {s} covers {v} square kilometres.", (500, 90_000))),
    "mountain": (("height_m", "{s} is {v} metres high.", (900, 8_000)),
                 ("glaciers", "{s} carries {v} small glaciers.", (0, 40))),
    "country": (("population", "{s} counts {v} inhabitants.", (200_000, 90_000_000)),
                ("area_km2", "{s} covers {v} square kilometres.", (2_000, 900_000))),
}
FILLER = (
    "{s} is often described in guidebooks.", "Local archives hold many papers about {s}.",
    "Little else is recorded about {s}.", "{s} appears in several old maps and letters.",
    "Scholars still debate parts of the history of {s}.", "Photographs of {s} are common.",
)
DISTRACTORS = (
    "{s} is sometimes confused with {o}.", "A delegation from {o} once visited {s}.",
    "Articles about {s} often also mention {o}.", "{o} and {s} signed an agreement in {y}.",
    "A well-known painting shows {s} next to {o}.", "Many people compare {s} with {o}.",
)
INTROS = {
    "person": "{s} is a person of some renown.", "city": "{s} is a city.",
    "company": "{s} is a company.", "university": "{s} is a university.",
    "river": "{s} is a river.", "mountain": "{s} is a mountain.", "country": "{s} is a country.",
}


@dataclass(frozen=True)
class WorldConfig:
    """Knobs of a generated world. Same config, same world."""

    seed: int = 0
    """Seed of the world's random generator."""
    n_entities: int = 500
    """Total number of entities (one document each)."""
    sentences_per_doc: int = 7
    """Sentences per document: intro + relation facts + filler/distractors up to this count
    (relation facts are never dropped, so a document may be longer)."""
    distractor_density: float = 0.5
    """Share of the non-relation sentences that mention another entity (a distractor)."""
    near_duplicate_rate: float = 0.12
    """Share of names made as a one-edit variant of an existing name of the same type."""
    name_partition: tuple[int, int] | None = None
    """``(index, modulo)``: keep only names whose hash falls in this slice (disjoint splits)."""

    def __post_init__(self) -> None:
        if self.n_entities < 2 * len(ENTITY_TYPES):
            raise ValueError(f"n_entities must be >= {2 * len(ENTITY_TYPES)} (two per type), "
                             f"got {self.n_entities}")
        if self.sentences_per_doc < 2:
            raise ValueError(f"sentences_per_doc must be >= 2, got {self.sentences_per_doc}")
        if not 0.0 <= self.distractor_density <= 1.0:
            raise ValueError(f"distractor_density must be in [0, 1], got {self.distractor_density}")
        if not 0.0 <= self.near_duplicate_rate < 1.0:
            raise ValueError(f"near_duplicate_rate must be in [0, 1), got {self.near_duplicate_rate}")
        if self.name_partition is not None:
            index, modulo = self.name_partition
            if not (modulo >= 1 and 0 <= index < modulo):
                raise ValueError(f"name_partition must be (index, modulo) with 0 <= index < modulo, "
                                 f"got {self.name_partition}")


@dataclass
class Entity:
    id: str
    type: str
    name: str
    attributes: dict[str, int] = field(default_factory=dict)
    relations: dict[str, list[str]] = field(default_factory=dict)  # relation name -> target ids


@dataclass(frozen=True)
class Document:
    id: str  # the entity id
    title: str  # the entity name
    text: str  # sentences joined by single spaces
    sentences: tuple[str, ...] = ()


@dataclass
class World:
    config: WorldConfig
    entities: list[Entity]
    documents: list[Document]

    def __post_init__(self) -> None:
        self.by_id = {e.id: e for e in self.entities}
        self.by_name = {e.name: e for e in self.entities}
        self.doc_by_id = {d.id: d for d in self.documents}

    @property
    def content_hash(self) -> str:
        """sha256 over the documents; keys the search-index cache."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.id.encode() + b"\0" + d.title.encode() + b"\0" + d.text.encode() + b"\1")
        return h.hexdigest()

    def names(self) -> set[str]:
        return {e.name for e in self.entities}

    def to_json(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "entities": [dataclasses.asdict(e) for e in self.entities],
            "documents": [{"id": d.id, "title": d.title, "sentences": list(d.sentences)}
                          for d in self.documents],
        }

    @classmethod
    def from_json(cls, data: dict) -> "World":
        cfg = dict(data["config"])
        if cfg.get("name_partition") is not None:
            cfg["name_partition"] = tuple(cfg["name_partition"])
        docs = [Document(d["id"], d["title"], " ".join(d["sentences"]), tuple(d["sentences"]))
                for d in data["documents"]]
        return cls(WorldConfig(**cfg), [Entity(**e) for e in data["entities"]], docs)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def _type_counts(n: int) -> dict[str, int]:
    counts = {t: max(2, int(n * TYPE_SHARES[t])) for t in ENTITY_TYPES}
    counts["person"] += n - sum(counts.values())  # remainder goes to people
    if counts["person"] < 2:
        raise ValueError(f"n_entities={n} is too small for the type minimums")
    return counts


def _draw_names(rng: random.Random, cfg: WorldConfig, kind: str, count: int,
                taken: set[str]) -> list[str]:
    names: list[str] = []
    attempts = 0
    while len(names) < count:
        attempts += 1
        if attempts > 1000 * count + 10_000:
            raise RuntimeError(f"could not draw {count} unique {kind} names")
        if names and rng.random() < cfg.near_duplicate_rate:
            name = near_duplicate(rng, rng.choice(names), kind)
        else:
            name = make_name(rng, kind)
        key = name_key(name)
        if key in taken or not in_partition(name, cfg.name_partition):
            continue
        taken.add(key)
        names.append(name)
    return names


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def generate_world(config: WorldConfig) -> World:
    """Generate the world for ``config`` (deterministic)."""
    rng = random.Random(config.seed)
    counts = _type_counts(config.n_entities)
    taken: set[str] = set()
    entities: list[Entity] = []
    by_type: dict[str, list[Entity]] = {t: [] for t in ENTITY_TYPES}
    for kind in ENTITY_TYPES:
        for name in _draw_names(rng, config, kind, counts[kind], taken):
            ent = Entity(id=f"e{len(entities):05d}", type=kind, name=name)
            for attr, _tmpl, (lo, hi) in ATTRIBUTES[kind]:
                ent.attributes[attr] = rng.randint(lo, hi)
            entities.append(ent)
            by_type[kind].append(ent)

    for ent in entities:
        for rel in RELATIONS:
            if rel.source != ent.type:
                continue
            pool = by_type[rel.target]
            if rel.name == "mentor" and rng.random() < 0.3:
                continue  # not everyone has a mentor
            n = rng.choice((1, 2, 2, 3)) if rel.multi else 1
            n = min(n, len(pool) - (rel.target == ent.type))
            picks: list[str] = []
            while len(picks) < n:  # rejection sampling: O(1) per pick, no pool copies
                cand = pool[rng.randrange(len(pool))].id
                if cand != ent.id and cand not in picks:
                    picks.append(cand)
            ent.relations[rel.name] = picks
    # A capital lies in its own country.
    capitals: set[str] = set()
    for country in by_type["country"]:
        free = [c for c in by_type["city"] if c.id not in capitals]
        own = [c for c in free if c.relations["country"] == [country.id]]
        if not (own or free):
            continue  # more countries than cities: this one has no capital
        capital = rng.choice(own or free)
        capital.relations["country"] = [country.id]
        country.relations["capital"] = [capital.id]
        capitals.add(capital.id)

    by_id = {e.id: e for e in entities}
    documents = [_write_document(rng, config, ent, by_id, entities) for ent in entities]
    return World(config, entities, documents)


def _write_document(rng: random.Random, cfg: WorldConfig, ent: Entity,
                    by_id: dict[str, Entity], entities: list[Entity]) -> Document:
    s = ent.name
    facts = []
    for rel_name, targets in ent.relations.items():
        rel = RELATIONS_BY_KEY[(ent.type, rel_name)]
        facts.append(rng.choice(rel.templates).format(s=s, t=_join([by_id[t].name for t in targets])))
    extra: list[str] = []
    for attr, tmpl, _rng in ATTRIBUTES[ent.type]:
        extra.append(tmpl.format(s=s, v=f"{ent.attributes[attr]:,}" if ent.attributes[attr] >= 10_000
                                 else ent.attributes[attr]))
    n_rest = max(0, cfg.sentences_per_doc - 1 - len(facts))
    rest: list[str] = []
    for _ in range(n_rest):
        if rng.random() < cfg.distractor_density:
            other = entities[rng.randrange(len(entities))]
            if other.id == ent.id:
                other = by_id[entities[0].id if other.id != entities[0].id else entities[1].id]
            rest.append(rng.choice(DISTRACTORS).format(s=s, o=other.name, y=rng.randint(1700, 2020)))
        elif extra:
            rest.append(extra.pop(0))
        else:
            rest.append(rng.choice(FILLER).format(s=s))
    body = facts + rest
    rng.shuffle(body)
    sentences = (INTROS[ent.type].format(s=s), *body)
    return Document(ent.id, ent.name, " ".join(sentences), tuple(sentences))
