import collections

import pytest

from mosaic.envs.deepsearch import WorldConfig, answer_set, generate_world, make_tasks
from mosaic.envs.rewards import normalize_answer
from mosaic.envs.world import RELATIONS_BY_KEY


def test_tasks_deterministic(world):
    a = make_tasks(world, 60, seed=5, split="train")
    b = make_tasks(world, 60, seed=5, split="train")
    c = make_tasks(world, 60, seed=6, split="train")
    assert a == b
    assert [t.question for t in a] != [t.question for t in c]


def test_every_answer_unique_by_graph_walk(world, tasks):
    for t in tasks:
        start = world.by_name[t.start]
        rels = [h.relation_name for h in t.gold_chain]
        reached = answer_set(world, start.id, rels)
        assert reached == {world.by_name[t.answer].id}
        same = [e for e in world.entities if normalize_answer(e.name) == normalize_answer(t.answer)]
        assert len(same) == 1


def test_gold_chain_is_consistent(world, tasks):
    for t in tasks:
        assert len(t.gold_chain) == t.hops
        assert t.gold_chain[0].title == t.start and t.start in t.question
        assert t.gold_chain[-1].target == t.answer
        visited = [t.start]
        for prev, hop in zip([None, *t.gold_chain], t.gold_chain):
            if prev is not None:
                assert hop.title == prev.target
            src = world.by_id[hop.doc_id]
            assert src.name == hop.title
            assert hop.query == f"{hop.title} {hop.relation}"
            assert RELATIONS_BY_KEY[(src.type, hop.relation_name)].word == hop.relation
            assert src.relations[hop.relation_name] == [hop.target_id]
            assert hop.target in world.doc_by_id[hop.doc_id].text
            visited.append(hop.target)
        assert len(set(visited)) == len(visited)  # no entity visited twice


def test_hop_mix_counts_distinct_questions_and_ids(tasks):
    assert collections.Counter(t.hops for t in tasks) == {2: 50, 3: 50, 4: 50, 5: 50}
    assert len({t.question for t in tasks}) == len(tasks)
    assert len({t.id for t in tasks}) == len(tasks)
    assert {t.style for t in tasks} == {"nested", "stepwise", "letters"}
    assert all(t.split == "train" for t in tasks)


def test_custom_hop_mix(world):
    ts = make_tasks(world, 10, hop_mix={2: 0.7, 3: 0.3}, seed=1)
    assert collections.Counter(t.hops for t in ts) == {2: 7, 3: 3}


def test_tiny_world_supports_cpu_preset_questions():
    w = generate_world(WorldConfig(seed=2, n_entities=60))
    ts = make_tasks(w, 200, hop_mix={2: 0.5, 3: 0.5})
    assert len(ts) == 200


def test_too_small_world_fails_loudly():
    w = generate_world(WorldConfig(seed=2, n_entities=14))
    with pytest.raises(ValueError, match="world too small"):
        make_tasks(w, 2000, hop_mix={5: 1.0}, max_attempts_per_task=20)


def test_bad_hop_mix():
    w = generate_world(WorldConfig(seed=2, n_entities=60))
    with pytest.raises(ValueError, match="hop_mix"):
        make_tasks(w, 5, hop_mix={0: 1.0})


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n_entities=st.integers(30, 90))
def test_unique_answers_on_random_worlds(seed, n_entities):
    w = generate_world(WorldConfig(seed=seed, n_entities=n_entities))
    for t in make_tasks(w, 20, hop_mix={2: 1, 3: 1, 4: 1}, seed=seed):
        start = w.by_name[t.start].id
        assert answer_set(w, start, [h.relation_name for h in t.gold_chain]) == {w.by_name[t.answer].id}
        assert t.answer not in {t.start, *(h.title for h in t.gold_chain)}
