"""BM25 search over a world's documents (``bm25s``), persisted and reused.

The index is saved under ``<cache_dir>/bm25/<key>/`` where ``key`` hashes the
world's documents and the tokenizer settings, so a changed world gets a new
index and an unchanged one loads from disk.

Snippets. A hit shows the title and ``snippet_tokens`` whitespace tokens of the
document. ``snippet_mode="passage"`` (default, *our choice*) starts the window at
the sentence that matches the most query terms (ties: the earliest, so a query
that matches the opening gives the lead); ``"lead"`` always shows the first
tokens. Passage mode is the default because a relation fact can sit anywhere in
a document and the only tool is ``search``: with lead snippets most facts
would be unreachable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mosaic.envs.world import World
from bm25s.stopwords import STOPWORDS_EN
import Stemmer
import bm25s
import numpy as np

from mosaic.envs.cache import default_cache_dir  # noqa: F401  (re-exported)

INDEX_FORMAT = 1
_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default token pattern
DEFAULT_SNIPPET_TOKENS = 24




@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    title: str
    snippet: str
    score: float


@functools.lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:

    return frozenset(STOPWORDS_EN)


def stemmer():

    return Stemmer.Stemmer("english")


class SearchIndex:
    """BM25 over ``world.documents`` (title + text).

    ``cache_dir=None`` uses :func:`default_cache_dir`; ``persist=False`` keeps the
    index in memory only. ``built`` tells whether this instance built the index
    (True) or loaded it from the cache (False).
    """

    def __init__(self, world: World, cache_dir: str | Path | None = None, *,
                 snippet_tokens: int = DEFAULT_SNIPPET_TOKENS,
                 snippet_mode: Literal["passage", "lead"] = "passage", persist: bool = True):

        if snippet_tokens < 1:
            raise ValueError(f"snippet_tokens must be >= 1, got {snippet_tokens}")
        if snippet_mode not in ("passage", "lead"):
            raise ValueError(f"snippet_mode must be 'passage' or 'lead', got {snippet_mode!r}")
        self.world = world
        self.snippet_tokens = snippet_tokens
        self.snippet_mode = snippet_mode
        self.docs = world.documents
        self._stem = stemmer()
        self._stopwords = _stopwords()
        self.key = hashlib.sha256(
            f"bm25s/{INDEX_FORMAT}/stopwords=en/stemmer=english/{world.content_hash}".encode()
        ).hexdigest()[:24]
        self.path = Path(cache_dir or default_cache_dir()) / "bm25" / self.key if persist else None
        self.built = False
        if self.path is not None and (self.path / "params.index.json").exists():
            self.retriever = bm25s.BM25.load(str(self.path), show_progress=False)
        else:
            corpus = [f"{d.title}. {d.text}" for d in self.docs]
            tokens = bm25s.tokenize(corpus, stopwords="en", stemmer=self._stem, show_progress=False)
            self.retriever = bm25s.BM25()
            self.retriever.index(tokens, show_progress=False)
            self.built = True
            if self.path is not None:
                self._save()
        self._sentence_terms: dict[int, list[set[str]]] = {}

    def _save(self) -> None:
        # Write to a temporary sibling, then rename: a concurrent reader never sees half an index.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=".tmp-"))
        self.retriever.save(str(tmp), show_progress=False)
        (tmp / "mosaic.json").write_text(json.dumps({"n_docs": len(self.docs), "key": self.key}))
        try:
            tmp.rename(self.path)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)

    def _terms(self, text: str) -> list[str]:
        """Same terms as ``bm25s.tokenize(stopwords="en", stemmer=...)`` (tested), without its
        per-call progress-bar overhead, which dominated query time."""
        words = [w for w in _TOKEN.findall(text.lower()) if w not in self._stopwords]
        return self._stem.stemWords(words) if words else []

    def search(self, query: str, k: int = 3) -> list[SearchHit]:
        """Top-``k`` hits (score > 0), best first; ties broken by document order."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = self._terms(query)
        if not terms:
            return []

        # bm25s's own top-k (argpartition over every document, mostly zeros) was 3x slower
        # here than partitioning only the non-zero scores; ties go to the earlier document.
        scores = self.retriever.get_scores(terms)  # (n_docs,)
        nz = np.flatnonzero(scores > 0)
        if len(nz) > k:
            kth = np.partition(scores[nz], len(nz) - k)[len(nz) - k]
            nz = nz[scores[nz] >= kth]
        top = nz[np.lexsort((nz, -scores[nz]))][:k]
        qset = set(terms)
        return [SearchHit(self.docs[i].id, self.docs[i].title, self.snippet(int(i), qset),
                          float(scores[i])) for i in top]

    def snippet(self, i: int, query_terms: set[str] | None = None) -> str:
        doc = self.docs[i]
        sentences = doc.sentences or (doc.text,)
        start = 0
        if self.snippet_mode == "passage" and query_terms:
            terms = self._sentence_terms.get(i)
            if terms is None:
                terms = self._sentence_terms[i] = [set(self._terms(s)) for s in sentences]
            best = max(range(len(sentences)), key=lambda j: (len(terms[j] & query_terms), -j))
            start = best
        words = " ".join(sentences[start:]).split()
        text = " ".join(words[: self.snippet_tokens])
        if len(words) > self.snippet_tokens:
            text += " ..."
        if start > 0:
            text = "... " + text
        return text


def format_hits(hits: list[SearchHit]) -> str:
    """The tool response the model reads: one line per hit, numbered, no scores."""
    if not hits:
        return "No results."
    return "\n".join(f"[{i}] {h.title}: {h.snippet}" for i, h in enumerate(hits, 1))
