"""The batching worker: one thread owns the model and decodes queued jobs in batches."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mosaic.agent.policies.local import LocalPolicy
from mosaic.agent.policy import GenRequest

log = logging.getLogger(__name__)


@dataclass
class Job:
    """The sequences of one HTTP request, with their sampling parameters and where events go."""

    reqs: list[GenRequest]
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]
    seed: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # ("token", choice, id, logprob) | ("done", results) | ("error", msg)
    stream: bool
    stop_strings: tuple[str, ...] = ()  # a sequence ends once its text holds one (cut later, see textops)
    skip_special: bool = True
    version: int | None = None  # the policy version that decoded it (set by the worker before any token)

    def send(self, event: tuple) -> None:
        """Hand an event to the request's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            pass


class ModelWorker:
    """One thread that owns the model and decodes queued jobs in batches.

    ``weights_lock`` is held while a batch decodes; a trainer that changes the weights in place holds it
    too (:meth:`mosaic.agent.server.app.ModelServer.weights_update`), so no batch ever mixes weights and
    ``version`` (stamped on every job) says which weights answered a request.
    """

    def __init__(self, policy: LocalPolicy, *, max_batch_size: int, batch_window_s: float,
                 decode: Callable[[list[int], bool], str] | None = None) -> None:
        """``decode(ids, skip_special)``: the tokenizer's text, for jobs with stop strings."""
        self.policy = policy
        self.decode = decode
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.weights_lock = threading.Lock()
        self.version = 0
        self.stats = {"batches": 0, "sequences": 0, "max_batch": 0, "stop_string_ends": 0}  # tests, /health
        self._thread = threading.Thread(target=self._run, name="mosaic-model-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            groups: dict[tuple, list[Job]] = {}
            for j in self._gather(job):  # a seeded request gets its own generator, hence its own group
                key = (j.temperature, j.top_p, j.stop_ids) if j.seed is None else ("seeded", id(j))
                groups.setdefault(key, []).append(j)
            for group in groups.values():
                try:
                    with self.weights_lock:
                        self._decode(group)
                except Exception as exc:  # keep the worker alive whatever happens
                    log.exception("model worker failed")
                    for j in group:
                        j.send(("error", f"{type(exc).__name__}: {exc}"))

    def _gather(self, job: Job) -> list[Job]:
        """``job`` and whatever else arrives within the batch window (up to ``max_batch_size`` sequences)."""
        jobs = [job]
        n = len(job.reqs)
        deadline = time.monotonic() + self.batch_window_s
        while n < self.max_batch_size:
            try:
                nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)
                break
            jobs.append(nxt)
            n += len(nxt.reqs)
        return jobs

    def _decode(self, jobs: list[Job]) -> None:
        flat: list[tuple[Job, int]] = [(j, c) for j in jobs for c in range(len(j.reqs))]
        reqs = [j.reqs[c] for j, c in flat]
        first = jobs[0]
        for j in jobs:
            j.version = self.version
        self.stats["batches"] += 1
        self.stats["sequences"] += len(reqs)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(reqs))
        gen = None
        if first.seed is not None:
            gen = torch.Generator(device=self.policy.device).manual_seed(first.seed)

        sampled: dict[int, list[int]] = {i: [] for i, (j, _) in enumerate(flat) if j.stop_strings}

        def on_step(indices: list[int], toks: list[int], lps: list[float]) -> list[int]:
            ended = []
            for i, t, lp in zip(indices, toks, lps):
                j, c = flat[i]
                if j.stream:
                    j.send(("token", c, t, lp))
                if j.stop_strings and self.decode is not None:
                    ids = sampled[i]
                    ids.append(t)
                    # A stop string that ends with this token lies within its last len(s) + 1 tokens.
                    window = ids[-(max(len(s) for s in j.stop_strings) + 1):]
                    tail = self.decode(window, j.skip_special)
                    if any(s in tail for s in j.stop_strings):
                        ended.append(i)
            self.stats["stop_string_ends"] += len(ended)
            return ended

        hooked = any(j.stream or j.stop_strings for j in jobs)
        results = self.policy.generate_with(  # turns batch failures into error results
            reqs, temperature=first.temperature, top_p=first.top_p,
            stop_token_ids=first.stop_ids, generator=gen,
            on_step=on_step if hooked else None)
        per_job: dict[int, list] = {}
        for (j, c), res in zip(flat, results):
            per_job.setdefault(id(j), [None] * len(j.reqs))[c] = res
        for j in jobs:
            j.send(("done", per_job[id(j)]))
