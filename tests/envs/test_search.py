from mosaic.envs.deepsearch import (
    SearchIndex, WorldConfig, format_hits, generate_world, make_tasks, retrieval_recall,
)


def test_retrieval_figure_at_least_95_percent(index, tasks):
    r = retrieval_recall(index, tasks, k=3)
    assert r["hops"] == sum(t.hops for t in tasks)
    assert r["recall"] >= 0.95, r


def test_index_results_deterministic_and_cached(world, tasks, tmp_path):
    a = SearchIndex(world, cache_dir=tmp_path)
    b = SearchIndex(world, cache_dir=tmp_path)
    assert a.built and not b.built and a.path == b.path and a.path.is_dir()
    mem = SearchIndex(world, persist=False)
    for t in tasks[:40]:
        q = t.gold_chain[0].query
        assert a.search(q, 3) == b.search(q, 3)
        assert [h.doc_id for h in a.search(q, 3)] == [h.doc_id for h in mem.search(q, 3)]
        assert format_hits(a.search(q, 3)) == format_hits(b.search(q, 3))


def test_same_seed_same_index_results(tmp_path):
    w1 = generate_world(WorldConfig(seed=4, n_entities=100))
    w2 = generate_world(WorldConfig(seed=4, n_entities=100))
    t1 = make_tasks(w1, 20, seed=0)
    i1 = SearchIndex(w1, cache_dir=tmp_path / "a")
    i2 = SearchIndex(w2, cache_dir=tmp_path / "b")
    assert i1.key == i2.key
    for t in t1:
        for h in t.gold_chain:
            assert i1.search(h.query, 5) == i2.search(h.query, 5)


def test_changed_world_gets_a_new_index(tmp_path):
    a = SearchIndex(generate_world(WorldConfig(seed=4, n_entities=100)), cache_dir=tmp_path)
    b = SearchIndex(generate_world(WorldConfig(seed=5, n_entities=100)), cache_dir=tmp_path)
    c = SearchIndex(generate_world(WorldConfig(seed=4, n_entities=100, distractor_density=0.1)),
                    cache_dir=tmp_path)
    assert len({a.key, b.key, c.key}) == 3 and b.built and c.built


def test_passage_snippet_shows_the_hop_fact(index, tasks):
    shown = total = 0
    for t in tasks:
        for h in t.gold_chain:
            hits = {x.doc_id: x for x in index.search(h.query, 3)}
            if h.doc_id in hits:
                total += 1
                shown += h.target in hits[h.doc_id].snippet
    assert shown / total >= 0.95


def test_snippet_length_and_lead_mode(world, tmp_path):
    lead = SearchIndex(world, cache_dir=tmp_path, snippet_tokens=8, snippet_mode="lead")
    hits = lead.search(world.documents[5].title, 3)
    assert hits and hits[0].doc_id == world.documents[5].id
    for h in hits:
        doc = world.doc_by_id[h.doc_id]
        words = h.snippet.removesuffix(" ...").split()
        assert len(words) == 8 and doc.text.split()[:8] == words


def test_edge_queries(index):
    assert index.search("", 3) == []
    assert index.search("the of and", 3) == []  # only stopwords
    assert index.search("zzqqxx", 3) == []
    assert format_hits([]) == "No results."
    hits = index.search("river source", 5)
    assert len(hits) == 5 and all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    text = format_hits(hits)
    assert text.splitlines()[0].startswith("[1] ") and len(text.splitlines()) == 5


def test_query_terms_match_bm25s_tokenizer(world, index, tasks):
    import bm25s

    texts = [d.text for d in world.documents[:100]] + [t.question for t in tasks[:50]] + ["", "The of"]
    ref = bm25s.tokenize(texts, stopwords="en", stemmer=index._stem, show_progress=False,
                         return_ids=False)
    assert [index._terms(t) for t in texts] == [list(r) for r in ref]


def test_ranking_matches_bm25s_retrieve(index, tasks):
    """Our top-k over non-zero scores ranks like bm25s's own retrieve (up to exact ties)."""
    for t in tasks[:60]:
        for h in t.gold_chain:
            terms = index._terms(h.query)
            docs, scores = index.retriever.retrieve([terms], k=5, show_progress=False)
            ours = index.search(h.query, 5)
            assert [round(x.score, 4) for x in ours] == [round(float(s), 4) for s in scores[0] if s > 0]
            assert ours[0].doc_id == index.docs[int(docs[0][0])].id or ours[0].score == ours[1].score
