"""Benchmark the deep-search tool: bm25s ``SearchIndex.search`` vs a naive scan.

Prints, for a world of ``--docs`` documents (default 10,000):
- index build time (tokenize + index, in memory), save and cached-load times;
- queries/s of ``SearchIndex.search`` (bm25s retrieval + snippet) on gold-chain queries;
- queries/s of a naive pure-Python BM25 loop over every document with the same
  tokenizer, precomputed term counts and the same k1/b (the peer), and the ratio;
- top-1 agreement between the two (a sanity check that both rank alike).

Usage: python bench/search.py [--docs 10000] [--queries 300]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections import Counter


def naive_scorer(docs_terms: list[list[str]], k1: float = 1.5, b: float = 0.75):
    """Plain BM25 (Lucene idf), scanning every document per query."""
    n = len(docs_terms)
    tfs = [Counter(t) for t in docs_terms]
    lens = [len(t) for t in docs_terms]
    avg = sum(lens) / n
    df = Counter(term for tf in tfs for term in tf)
    idf = {t: math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}

    def search(q_terms: list[str], k: int) -> list[int]:
        scores = []
        for i, tf in enumerate(tfs):
            s = 0.0
            for t in q_terms:
                f = tf.get(t)
                if f:
                    s += idf[t] * f * (k1 + 1) / (f + k1 * (1 - b + b * lens[i] / avg))
            scores.append((s, i))
        scores.sort(key=lambda p: (-p[0], p[1]))
        return [i for s, i in scores[:k] if s > 0]

    return search


def main() -> None:
    import bm25s

    from mosaic.envs.deepsearch import SearchIndex, WorldConfig, generate_world, make_tasks
    from mosaic.envs.search import stemmer

    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=300)
    args = ap.parse_args()

    t0 = time.perf_counter()
    world = generate_world(WorldConfig(seed=123, n_entities=args.docs))
    t_world = time.perf_counter() - t0
    tasks = make_tasks(world, max(1, args.queries // 3), seed=0)
    queries = [h.query for t in tasks for h in t.gold_chain][: args.queries]

    t0 = time.perf_counter()
    index = SearchIndex(world, persist=False)
    t_build = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        SearchIndex(world, cache_dir=tmp)
        t_build_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = SearchIndex(world, cache_dir=tmp)
        t_load = time.perf_counter() - t0
        assert not loaded.built

    for q in queries[:10]:  # warm-up
        index.search(q, 3)
    t0 = time.perf_counter()
    ours = [index.search(q, 3) for q in queries]
    t_ours = time.perf_counter() - t0

    stem = stemmer()
    corpus = [f"{d.title}. {d.text}" for d in world.documents]
    t0 = time.perf_counter()
    docs_terms = bm25s.tokenize(corpus, stopwords="en", stemmer=stem, show_progress=False,
                                return_ids=False)
    naive = naive_scorer(docs_terms)
    t_naive_build = time.perf_counter() - t0
    q_terms = [bm25s.tokenize([q], stopwords="en", stemmer=stem, show_progress=False,
                              return_ids=False)[0] for q in queries]
    n_naive = min(len(queries), 60)  # the scan is slow; time a subset
    t0 = time.perf_counter()
    theirs = [naive(q, 3) for q in q_terms[:n_naive]]
    t_naive = time.perf_counter() - t0

    pos = {d.id: i for i, d in enumerate(world.documents)}
    agree = sum(bool(o) and bool(t) and pos[o[0].doc_id] == t[0] for o, t in zip(ours, theirs))
    qps_ours, qps_naive = len(queries) / t_ours, n_naive / t_naive
    print(f"world: {len(world.documents)} documents, generated in {t_world:.2f}s")
    print(f"index build (tokenize + bm25s index, in memory): {t_build:.2f}s")
    print(f"index build + save to disk: {t_build_save:.2f}s; load from cache: {t_load:.3f}s")
    print(f"naive scan setup (tokenize + term counts): {t_naive_build:.2f}s")
    print(f"SearchIndex.search (k=3, with snippets): {qps_ours:,.0f} queries/s over {len(queries)} queries")
    print(f"naive Python BM25 scan (k=3):           {qps_naive:,.1f} queries/s over {n_naive} queries")
    print(f"speed-up: {qps_ours / qps_naive:,.0f}x; top-1 agreement: {agree}/{n_naive}")


if __name__ == "__main__":
    main()
