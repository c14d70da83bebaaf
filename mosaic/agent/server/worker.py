"""The batching worker: one thread owns the model and decodes queued jobs in batches."""

from __future__ import annotations

import asyncio
import contextlib
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
                 decode: Callable[[list[int], bool], str] | None = None,
                 after_step: Callable[[], None] | None = None) -> None:
        """``decode(ids, skip_special)``: the tokenizer's text, for jobs with stop strings; ``after_step()``: called
        after each decode step's tokens went to their jobs (a worker process sends them on then)."""
        self.policy = policy
        self.decode = decode
        self.after_step = after_step
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._deferred: list[Job] = []  # taken off the queue while a batch ran, not joinable to it: next
        self.weights_lock = threading.Lock()
        self.update_waiting = threading.Event()  # a weights update waits: running batches take no new rows
        self.version = 0
        self.stats = {"batches": 0, "sequences": 0, "max_batch": 0, "stop_string_ends": 0,  # tests, /health
                      "joined_jobs": 0}
        self._thread = threading.Thread(target=self._run, name="mosaic-model-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    @property
    def prefix_cache(self) -> LocalPolicy:
        """What a scorer reads the rollouts' cached contexts from (``model`` and ``longest_cached(ids)``)."""
        return self.policy

    @contextlib.contextmanager
    def weights_update(self):
        """Held while the caller changes the weights in place: no batch decodes meanwhile (running batches
        take no new rows, so the lock comes soon); on exit the prefix cache is dropped and ``version`` goes up."""
        self.update_waiting.set()
        try:
            with self.weights_lock:
                try:
                    yield
                finally:
                    self.policy.clear_cache()  # (the policy also notices in-place updates; a swap may not be one)
                    self.version += 1
        finally:
            self.update_waiting.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self._deferred.pop(0) if self._deferred else self._queue.get()
            if job is None:  # closing: whatever still waits hears so
                for j in self._deferred:
                    if j is not None:
                        j.send(("error", "server shutting down"))
                self._deferred.clear()
                return
            groups: dict[tuple, list[Job]] = {}
            for j in self._gather(job):  # a seeded request gets its own generator, hence its own group
                groups.setdefault(self._key(j), []).append(j)
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
        while self._deferred and self._deferred[0] is not None and n < self.max_batch_size:
            jobs.append(self._deferred.pop(0))
            n += len(jobs[-1].reqs)
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

    @staticmethod
    def _key(j: Job) -> tuple:
        """Jobs with the same key decode together (sampling parameters; a seeded job alone)."""
        return (j.temperature, j.top_p, j.stop_ids) if j.seed is None else ("seeded", id(j))

    def _more(self, key: tuple, add: Callable[[Job], list]) -> Callable[[int], list]:
        """The running batch's source of new rows: queued jobs with the batch's sampling (continuous batching);
        others wait for the next batch. Nothing joins while a weights update waits."""
        def more(free: int) -> list:
            out: list = []
            # nothing joins while a job waits for the next batch (other sampling, too many sequences, closing):
            # the running batch then drains, and the waiting job is not starved
            while len(out) < free and not self._deferred and not self.update_waiting.is_set():
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or self._key(nxt) != key or len(out) + len(nxt.reqs) > free:
                    self._deferred.append(nxt)
                    break
                self.stats["joined_jobs"] += 1
                out += add(nxt)
            return out
        return more

    def _step_hook(self, flat: list[tuple[Job, int]]) -> Callable[[list[int], list[int], list[float]], list[int]]:
        """The decode's step callback: streams each token to its job; returns the sequences a stop string ended."""
        sampled: dict[int, list[int]] = {}

        def on_step(indices: list[int], toks: list[int], lps: list[float]) -> list[int]:
            ended = []
            for i, t, lp in zip(indices, toks, lps):
                j, c = flat[i]
                if j.stream:
                    j.send(("token", c, t, lp))
                if j.stop_strings and self.decode is not None:
                    ids = sampled.setdefault(i, [])
                    ids.append(t)
                    # A stop string that ends with this token lies within its last len(s) + 1 tokens.
                    window = ids[-(max(len(s) for s in j.stop_strings) + 1):]
                    tail = self.decode(window, j.skip_special)
                    if any(s in tail for s in j.stop_strings):
                        ended.append(i)
            self.stats["stop_string_ends"] += len(ended)
            if self.after_step is not None:
                self.after_step()
            return ended
        return on_step

    def _decode(self, jobs: list[Job]) -> None:
        flat: list[tuple[Job, int]] = []
        per_job: dict[int, list] = {}
        left: dict[int, int] = {}

        def add(j: Job) -> list:
            """Number a job's sequences after the batch's; its requests."""
            j.version = self.version
            flat.extend((j, c) for c in range(len(j.reqs)))
            per_job[id(j)] = [None] * len(j.reqs)
            left[id(j)] = len(j.reqs)
            self.stats["sequences"] += len(j.reqs)
            return list(j.reqs)

        reqs = [r for j in jobs for r in add(j)]
        first = jobs[0]
        self.stats["batches"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(reqs))
        gen = None
        if first.seed is not None:
            gen = torch.Generator(device=self.policy.device).manual_seed(first.seed)

        on_step = self._step_hook(flat)

        def on_result(i: int, res) -> None:
            """Hand a job its results as soon as its last sequence finishes."""
            j, c = flat[i]
            per_job[id(j)][c] = res
            left[id(j)] -= 1
            if left[id(j)] == 0:
                j.send(("done", per_job.pop(id(j))))

        # a seeded job keeps its generator to itself: nothing joins it
        try:
            results = self.policy.generate_with(  # turns batch failures into error results
                reqs, temperature=first.temperature, top_p=first.top_p,
                stop_token_ids=first.stop_ids, generator=gen, on_step=on_step, on_result=on_result,
                more=self._more(self._key(first), add) if first.seed is None else None)
        except Exception as exc:  # every job of the batch, joined ones too, hears of it once
            log.exception("model worker failed")
            for j in {id(j): j for j, _ in flat}.values():  # (a Job is not hashable)
                if left[id(j)] > 0:
                    left[id(j)] = 0
                    j.send(("error", f"{type(exc).__name__}: {exc}"))
            return
        for i, res in enumerate(results):  # whatever was not handed over as it finished
            j, c = flat[i]
            if left[id(j)] > 0 and per_job[id(j)][c] is None:
                on_result(i, res)
