import re

import pytest

from mosaic.envs.names import in_partition, name_key
from mosaic.envs.world import ENTITY_TYPES, RELATIONS, RELATIONS_BY_KEY, WorldConfig, generate_world


def test_same_seed_same_world_different_seed_different():
    a = generate_world(WorldConfig(seed=11, n_entities=120))
    b = generate_world(WorldConfig(seed=11, n_entities=120))
    c = generate_world(WorldConfig(seed=12, n_entities=120))
    assert a.dumps() == b.dumps() and a.content_hash == b.content_hash
    assert a.content_hash != c.content_hash


def test_json_round_trip(world):
    from mosaic.envs.world import World

    back = World.from_json(world.to_json())
    assert back.dumps() == world.dumps() and back.content_hash == world.content_hash


def test_names_unique_after_normalisation_and_multi_token(world):
    keys = [name_key(e.name) for e in world.entities]
    assert len(set(keys)) == len(keys)
    assert all(len(e.name.split()) >= 2 for e in world.entities)


def test_all_types_present_and_typed_relations(world):
    assert {e.type for e in world.entities} == set(ENTITY_TYPES)
    for e in world.entities:
        for rel, targets in e.relations.items():
            r = RELATIONS_BY_KEY[(e.type, rel)]
            assert targets and all(world.by_id[t].type == r.target for t in targets)
            assert e.id not in targets
            if not r.multi:
                assert len(targets) == 1


@pytest.mark.parametrize("seed", [7, 0, 1, 2])
def test_capital_lies_in_its_country(seed):
    world = generate_world(WorldConfig(seed=seed, n_entities=400))
    for e in world.entities:
        if e.type == "country":
            capital = world.by_id[e.relations["capital"][0]]
            assert capital.relations["country"] == [e.id]


def test_every_relation_has_three_templates_with_the_relation_stem():
    import Stemmer

    stem = Stemmer.Stemmer("english")
    for r in RELATIONS:
        assert len(r.templates) >= 3, r
        word = stem.stemWord(r.word)
        for t in r.templates:
            words = stem.stemWords(re.findall(r"\w+", t.lower()))
            assert word in words, (r.name, t)


def test_documents_state_every_relation_fact(world):
    for e in world.entities:
        doc = world.doc_by_id[e.id]
        assert doc.title == e.name and doc.text.startswith(e.name)
        for targets in e.relations.values():
            for t in targets:
                assert world.by_id[t].name in doc.text


def test_documents_have_distractors_and_near_duplicate_names(world):
    # distractor mentions: a document naming an entity that is not one of its relation targets
    mentions = 0
    for e in world.entities:
        targets = {world.by_id[t].name for ts in e.relations.values() for t in ts}
        text = world.doc_by_id[e.id].text
        mentions += any(o.name in text and o.name not in targets and o.id != e.id
                        for o in world.entities[:200])
    assert mentions > len(world.entities) // 4
    # near duplicates: two names of the same type that share a token
    by_first = {}
    for e in world.entities:
        by_first.setdefault((e.type, e.name.split()[0]), []).append(e.name)
    assert sum(len(v) > 1 for v in by_first.values()) >= 5


def test_size_knobs():
    w = generate_world(WorldConfig(seed=1, n_entities=80, sentences_per_doc=10, distractor_density=1.0))
    assert len(w.documents) == 80
    assert all(len(d.sentences) >= 10 for d in w.documents)
    w0 = generate_world(WorldConfig(seed=1, n_entities=80, sentences_per_doc=10, distractor_density=0.0))
    assert sum(d.text.count("confused with") for d in w0.documents) == 0


def test_name_partition_is_respected():
    w = generate_world(WorldConfig(seed=1, n_entities=60, name_partition=(1, 3)))
    assert all(in_partition(e.name, (1, 3)) and not in_partition(e.name, (0, 3)) for e in w.entities)


@pytest.mark.parametrize("kwargs, field", [
    ({"n_entities": 5}, "n_entities"), ({"sentences_per_doc": 1}, "sentences_per_doc"),
    ({"distractor_density": 1.5}, "distractor_density"), ({"name_partition": (3, 3)}, "name_partition"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WorldConfig(**kwargs)


def test_world_and_tasks_identical_across_processes(tmp_path):
    """No dependence on hash randomisation or process state."""
    import os
    import subprocess
    import sys

    code = ("from mosaic.envs.deepsearch import *; w = generate_world(WorldConfig(seed=3, n_entities=150)); "
            "t = make_tasks(w, 30, seed=1); print(w.content_hash, [x.id for x in t][-1], t[-1].answer)")
    outs = set()
    for hashseed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1
