"""Multi-hop questions over a world: k composed relations, one answer.

A question names a start entity and a chain of k relations; the answer is the
entity the chain ends on. Every question is checked by walking the knowledge
graph with *all* targets of each relation (some relations have several): the
question is kept only if that walk ends on exactly one entity, and the chain
never visits an entity twice.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field

from mosaic.envs.names import name_key
from mosaic.envs.world import RELATIONS_BY_KEY, World

DEFAULT_HOP_MIX = {2: 0.25, 3: 0.25, 4: 0.25, 5: 0.25}
LETTERS = "ABCDEFG"


@dataclass(frozen=True)
class Hop:
    """One step of a gold chain: search ``query``, read ``doc_id``, learn ``target``."""

    doc_id: str  # the document stating the fact (the source entity's document)
    title: str  # the entity name searched for (source entity)
    relation: str  # the relation word ("founder", "born", ...)
    target: str  # the entity name this hop yields
    query: str  # entity name + relation word
    relation_name: str = ""  # the relation's identifier ("born_in", ...)
    target_id: str = ""


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answer: str
    hops: int
    split: str
    gold_chain: list[Hop] = field(default_factory=list)
    start: str = ""  # the start entity's name
    style: str = ""  # question template family

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        data = dict(data)
        data["gold_chain"] = [Hop(**h) for h in data["gold_chain"]]
        return cls(**data)


def answer_set(world: World, start_id: str, relation_names: list[str]) -> set[str]:
    """Entity ids reached from ``start_id`` following every target of each relation."""
    frontier = {start_id}
    for rel in relation_names:
        frontier = {t for e in frontier for t in world.by_id[e].relations.get(rel, ())}
    return frontier


def _allocate(n: int, hop_mix: dict[int, float]) -> dict[int, int]:
    """Split n into per-k counts by largest remainder (deterministic)."""
    for k, w in hop_mix.items():
        if not (isinstance(k, int) and 1 <= k <= 7):
            raise ValueError(f"hop_mix keys must be hop counts in 1..7, got {k!r}")
        if w < 0:
            raise ValueError(f"hop_mix weights must be >= 0, got {w} for k={k}")
    total = sum(hop_mix.values())
    if total <= 0:
        raise ValueError("hop_mix weights must sum to > 0")
    raw = {k: n * w / total for k, w in sorted(hop_mix.items())}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: (-(raw[k] - counts[k]), k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def _random_chain(rng: random.Random, world: World, k: int) -> list[tuple[str, str]] | None:
    """A walk of k functional hops from a random entity: [(source_id, relation), ...]."""
    ent = world.entities[rng.randrange(len(world.entities))]
    seen = {ent.id}
    chain = []
    for _ in range(k):
        options = sorted(r for r, ts in ent.relations.items() if len(ts) == 1 and ts[0] not in seen)
        if not options:
            return None
        rel = rng.choice(options)
        chain.append((ent.id, rel))
        ent = world.by_id[ent.relations[rel][0]]
        seen.add(ent.id)
    return chain


def _phrase(world: World, rng: random.Random, src_id: str, rel: str, x: str) -> str:
    return rng.choice(RELATIONS_BY_KEY[(world.by_id[src_id].type, rel)].phrases).format(x=x)


def _question(rng: random.Random, world: World, chain: list[tuple[str, str]], answer_type: str,
              style: str) -> str:
    start = world.by_id[chain[0][0]].name
    if style == "nested":
        np = start
        for src, rel in chain:
            np = _phrase(world, rng, src, rel, np)
        tmpl = rng.choice(("What is {np}?", "Which {t} is {np}?", "Name {np}.", "Identify {np}."))
        q = tmpl.format(np=np, t=answer_type)
    elif style == "stepwise":
        steps = []
        for i, (src, rel) in enumerate(chain):
            x = start if i == 0 else f"that {world.by_id[src].type}"
            steps.append(_phrase(world, rng, src, rel, x))
        tmpl = rng.choice(("Start from {start}: find {steps}. Which {t} do you reach?",
                           "Begin with {start}. Take {steps}. Name the {t} you end at."))
        q = tmpl.format(start=start, steps=", then ".join(steps), t=answer_type)
    elif style == "letters":
        lead, verb, tail = rng.choice((("Suppose", "is", "Which {t} is {last}?"),
                                       ("Let", "be", "What is {last}?")))
        parts = []
        for i, (src, rel) in enumerate(chain):
            x = start if i == 0 else LETTERS[i - 1]
            parts.append(f"{LETTERS[i]} {verb} {_phrase(world, rng, src, rel, x)}")
        q = f"{lead} {'; '.join(parts)}. " + tail.format(t=answer_type, last=LETTERS[len(chain) - 1])
    else:
        raise ValueError(f"unknown question style {style!r}")
    return q[0].upper() + q[1:]


STYLES = ("nested", "stepwise", "letters")


def make_tasks(world: World, n: int, hop_mix: dict[int, float] | None = None, seed: int = 0,
               *, split: str = "none", max_attempts_per_task: int = 400) -> list[Task]:
    """``n`` distinct questions with unique answers, hop counts drawn per ``hop_mix``.

    Deterministic in (world, n, hop_mix, seed, split). Raises ValueError when the world
    is too small to supply ``n`` distinct chains of the requested lengths.
    """
    counts = _allocate(n, hop_mix or DEFAULT_HOP_MIX)
    rng = random.Random(f"tasks/{seed}/{world.content_hash}")
    tasks: list[Task] = []
    seen_chains: set[tuple] = set()
    key_counts: dict[str, int] = {}
    for e in world.entities:
        key_counts[name_key(e.name)] = key_counts.get(name_key(e.name), 0) + 1
    for k, count in counts.items():
        made, attempts = 0, 0
        while made < count:
            attempts += 1
            if attempts > max_attempts_per_task * max(count, 1):
                raise ValueError(f"world too small: made {made}/{count} distinct {k}-hop questions "
                                 f"(n_entities={len(world.entities)}); enlarge the world or lower n")
            chain = _random_chain(rng, world, k)
            if chain is None:
                continue
            key = tuple(chain)
            if key in seen_chains:
                continue
            rels = [rel for _src, rel in chain]
            reached = answer_set(world, chain[0][0], rels)
            if len(reached) != 1:
                continue
            answer = world.by_id[next(iter(reached))]
            # Guard: no other entity shares the answer's normalised name.
            if key_counts[name_key(answer.name)] != 1:
                continue
            seen_chains.add(key)
            hops = []
            for src, rel in chain:
                s_ent = world.by_id[src]
                t_ent = world.by_id[s_ent.relations[rel][0]]
                word = RELATIONS_BY_KEY[(s_ent.type, rel)].word
                hops.append(Hop(doc_id=s_ent.id, title=s_ent.name, relation=word, target=t_ent.name,
                                query=f"{s_ent.name} {word}", relation_name=rel, target_id=t_ent.id))
            style = STYLES[rng.randrange(len(STYLES))]
            question = _question(rng, world, chain, answer.type, style)
            digest = hashlib.sha1(f"{question}\0{answer.name}".encode()).hexdigest()[:8]
            tasks.append(Task(id=f"{split}-{len(tasks):05d}-{digest}", question=question,
                              answer=answer.name, hops=k, split=split, gold_chain=hops,
                              start=world.by_id[chain[0][0]].name, style=style))
            made += 1
    return tasks
