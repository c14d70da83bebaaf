"""Bookkeeping of :class:`~mosaic.agent.policies.local.LocalPolicy`'s decode calls (see that module's docstring).

:class:`Call` is one ``generate_with`` call: its requests (more may arrive from a server's queue while it
runs), their checks, prefix-cache lookups and results, and the queue of those waiting to start
(continuous batching). :class:`Rows` is one running batch's per-row state: which request each batch row
decodes, its sampled ids and log-probs so far, its decode budget and how it finished.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch

from mosaic.agent.policy import GenRequest, GenResult


class Call:
    """The requests of one decode call, numbered in arrival order; ``results[i]`` once request ``i`` is done.

    ``more(free)`` (a server's queue, or None) is asked for new requests when the waiting ones run short;
    ``on_result(i, result)`` hears of every result as it is set."""

    def __init__(self, pol, requests: Sequence[GenRequest], more: Callable[[int], Sequence[GenRequest]] | None,
                 on_result: Callable[[int, GenResult], None] | None, result_type) -> None:
        self.pol, self.more, self.on_result, self.result_type = pol, more, on_result, result_type
        self.requests: list[GenRequest] = []
        self.results: list[GenResult | None] = []
        self.prefixes: dict[int, object] = {}
        self.waiting: deque[int] = deque()
        self.started: list[int] = []  # taken off the queue (failed together on a crash)
        self.waiting.extend(self.admit(requests))

    def admit(self, new: Sequence[GenRequest]) -> list[int]:
        """Number new requests, finish at once those that need no decode; the runnable indices."""
        out = []
        for req in new:
            i = len(self.requests)
            self.requests.append(req)
            self.results.append(None)
            problem = self.pol._check(req)
            if problem is not None:
                self.finish(i, self.result_type([], [], "error", problem, []))
            elif req.max_new_tokens <= 0:
                self.finish(i, self.result_type([], [], "length", None, []))
            else:
                out.append(i)
                self.prefixes[i] = self.pol._lookup(req)
        return out

    def finish(self, i: int, res: GenResult) -> GenResult:
        self.results[i] = res
        if self.on_result is not None:
            self.on_result(i, res)
        return res

    def sort_waiting(self) -> None:
        """Similar amounts of new work together: less padding in each batch."""
        key = {i: len(self.requests[i].prompt_ids) - (self.prefixes[i][1] if self.prefixes[i] else 0)
               for i in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=key.__getitem__))

    def take(self, free: int) -> list[int]:
        """Up to ``free`` waiting request indices to start now (asking ``more`` when they run short)."""
        if self.more is not None and len(self.waiting) < free:
            self.waiting.extend(self.admit(list(self.more(free - len(self.waiting)))))
        got = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        self.started.extend(got)
        return got

    def fail(self, idx: Sequence[int], exc: Exception) -> None:
        """Requests of a batch that crashed: an error result each (those already done keep theirs)."""
        for i in idx:
            if self.results[i] is None:
                self.pol.release(self.requests[i].session_key)
                self.finish(i, self.result_type([], [], "error", f"{type(exc).__name__}: {exc}", []))


class Rows:
    """Per-row state of one running batch; batch row ids number the rows in the order they joined."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rid: list[int] = []  # batch row id -> request index
        self.toks: list[list[int]] = []
        self.lps: list[list[float]] = []
        self.raws: list[list[float]] = []
        self.finish: list[str] = []
        self.max_new = torch.zeros(0, dtype=torch.long, device=device)
        self.n_gen = torch.zeros(0, dtype=torch.long, device=device)
        self._row_of: dict[int, int] = {}

    def add(self, idx: Sequence[int], max_new: Sequence[int]) -> int:
        """New rows for requests ``idx``; returns the first new row id."""
        first = len(self.rid)
        for i in idx:
            self._row_of[i] = len(self.rid)
            self.rid.append(i)
            self.toks.append([])
            self.lps.append([])
            self.raws.append([])
            self.finish.append("length")
        add = torch.tensor(list(max_new), dtype=torch.long, device=self.device)
        self.max_new = torch.cat([self.max_new, add])
        self.n_gen = torch.cat([self.n_gen, torch.zeros_like(add)])
        return first

    def record(self, rows: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, raw: torch.Tensor) -> tuple[list, list, list]:
        """One step's samples of batch rows ``rows``; (request indices, tokens, log-probs) for the callback."""
        row_l, tok_l, lp_l, raw_l = rows.tolist(), tok.tolist(), lp.tolist(), raw.tolist()
        for r, t, a, c in zip(row_l, tok_l, lp_l, raw_l):
            self.toks[r].append(t)
            self.lps[r].append(a)
            self.raws[r].append(c)
        self.n_gen[rows] += 1
        return [self.rid[r] for r in row_l], tok_l, lp_l

    def rows_of(self, requests: Sequence[int]) -> list[int]:
        """Batch row ids of request indices (those in this batch)."""
        return sorted(self._row_of[i] for i in requests if i in self._row_of)

    def left(self, rows: torch.Tensor) -> torch.Tensor:
        """Tokens each of ``rows`` may still sample."""
        return self.max_new[rows] - self.n_gen[rows]
