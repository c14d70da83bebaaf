"""The offline deep-search environment (docs/algorithm.md §7): one import point.

A seeded world of fictional entities (:mod:`mosaic.envs.world`), multi-hop
questions with unique answers (:mod:`mosaic.envs.questions`), BM25 search
(:mod:`mosaic.envs.search`) and disjoint splits (:mod:`mosaic.envs.splits`).
"""

from mosaic.envs.questions import DEFAULT_HOP_MIX, Hop, Task, answer_set, make_tasks
from mosaic.envs.search import SearchHit, SearchIndex, default_cache_dir, format_hits
from mosaic.envs.splits import (
    PRESETS, SPLITS, Split, SplitConfig, check_disjoint, load_split, load_splits, split_config,
)
from mosaic.envs.world import (
    ENTITY_TYPES, RELATIONS, Document, Entity, Relation, World, WorldConfig, generate_world,
)

__all__ = [
    "DEFAULT_HOP_MIX", "Hop", "Task", "answer_set", "make_tasks",
    "SearchHit", "SearchIndex", "default_cache_dir", "format_hits",
    "PRESETS", "SPLITS", "Split", "SplitConfig", "check_disjoint", "load_split", "load_splits",
    "split_config", "ENTITY_TYPES", "RELATIONS", "Document", "Entity", "Relation", "World",
    "WorldConfig", "generate_world", "retrieval_recall",
]


def retrieval_recall(index: SearchIndex, tasks: list[Task], k: int = 3) -> dict:
    """Share of gold-chain hops whose document is in the top-``k`` for the hop's query.

    Returns ``{"hops": n, "recall": share, "top1": share at rank 1}``.
    """
    n = hit = top1 = 0
    for task in tasks:
        for hop in task.gold_chain:
            ids = [h.doc_id for h in index.search(hop.query, k)]
            n += 1
            hit += hop.doc_id in ids
            top1 += bool(ids) and ids[0] == hop.doc_id
    return {"hops": n, "recall": hit / n if n else 0.0, "top1": top1 / n if n else 0.0}
