"""The batching model worker in its own process: the served model decodes beside the serving threads, not
between them (in one process their Python takes the interpreter lock between the model's small tensor calls;
docs/speed.md). :class:`ProcessWorker` runs the same :class:`~mosaic.agent.server.worker.ModelWorker` in a child
started with ``spawn``, one intra-op thread less than the caller (:func:`child_threads`):

- **Weights are shared, not copied**: ``torch.multiprocessing`` moves the parameters' storage to shared
  memory, so in-place updates (an optimizer step, ``load_state_dict``) are what the child reads; an update that
  swaps tensors instead stops the child (the server starts one over the new tensors). The parent's
  :meth:`~ProcessWorker.weights_update` holds the child's own meanwhile.
- **Two pipes**: jobs go down (token ids, sampling parameters) through a sender thread; each decode step's
  tokens come back as one message, a job's result as one; a reader thread hands them to the event loops.
  ``longest_cached(ids)`` (what a trainer scores gains off) comes back through a shared buffer.
- **The caller's script is not run again**: the child gets a bare ``__main__``, so what it unpickles must be
  importable by name (a model class defined in the script is not: that child fails to start).
- **Failure is loud and contained**: a child that cannot start raises :class:`WorkerStartError` (the server
  then serves from a thread); one that dies fails every waiting and later job, it hangs none (a trainer
  replaces it at its next step: ``ModelServer.revive_worker``).
"""

# long: both ends of one pipe protocol (the child's loop and the parent's proxy of it), read together

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import math
import queue
import sys
import threading
import types
import weakref
from multiprocessing.connection import wait as mp_wait
from typing import Any

import torch
import torch.multiprocessing as tmp

from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.server.worker import Job, ModelWorker

log = logging.getLogger(__name__)

__all__ = ["CallFailed", "ProcessWorker", "WorkerStartError", "child_threads", "decodes_in", "start_worker"]

START_TIMEOUT_S = 300.0  # importing torch and transformers in a fresh interpreter, and building the policy
CALL_TIMEOUT_S = 600.0  # a control call ("hold" waits as long as the running batch takes)


class WorkerStartError(RuntimeError):
    """The worker process did not come up (shared memory, pickling, the child's own error)."""


class _Outbox:
    """The child's way back: events gathered per decode step, sent as one message (with the worker's counters
    when a job finished)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # the worker thread (events) and the main thread (replies) both send
        self.events: list[tuple] = []
        self.stats: dict | None = None  # the worker's counters (set once it exists)
        self.ended = False  # a job finished since the last message

    def add(self, item: tuple, now: bool) -> None:
        with self.lock:
            self.events.append(item)
            self.ended |= now
        if now:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            if self.events:
                stats = dict(self.stats) if self.ended and self.stats is not None else None
                batch, self.events, self.ended = self.events, [], False
                self.conn.send(("events", batch, stats))

    def reply(self, rid: int, value: Any) -> None:
        self.flush()  # a reply never overtakes events sent before it
        with self.lock:
            self.conn.send(("reply", rid, value))


class _ChildJob(Job):
    """A job in the child: its events go to the outbox under the parent's job id."""

    def __init__(self, jid: int, outbox: _Outbox, reqs, temperature, top_p, stop_ids, seed, stream,
                 stop_strings, skip_special) -> None:
        super().__init__(reqs, temperature, top_p, stop_ids, seed, None, None, stream,  # type: ignore[arg-type]
                         stop_strings, skip_special)
        self.jid, self.outbox = jid, outbox

    def send(self, event: tuple) -> None:
        self.outbox.add((self.jid, self.version, event), now=event[0] != "token")


class _Board:
    """A shared-memory buffer the child copies a cache hit's keys/values into and the parent copies them out of:
    one copy each way (a new shared tensor per hit costs far more: a segment and a file descriptor each)."""

    buf: torch.Tensor | None = None

    def put(self, hit) -> tuple | None:
        """``(n, shape, new buffer or None)`` of a :meth:`LocalPolicy.longest_cached` hit, its tensors copied in."""
        if hit is None:
            return None
        n, kv = hit
        shape = (len(kv), 2, *kv[0][0].shape)
        numel, fresh = math.prod(shape), None
        if self.buf is None or self.buf.numel() < numel or self.buf.dtype != kv[0][0].dtype:
            self.buf = fresh = torch.empty(max(numel, 2 * (self.buf.numel() if self.buf is not None else 0)),
                                           dtype=kv[0][0].dtype).share_memory_()
        dst = self.buf[:numel].view(shape)
        for i, (K, V) in enumerate(kv):
            dst[i, 0].copy_(K), dst[i, 1].copy_(V)
        return n, shape, fresh


class _Control:
    """The child's control calls (the parent waits for each reply): ``hold``/``release`` around a weights
    update (the worker's own :meth:`~mosaic.agent.server.worker.ModelWorker.weights_update`, entered and left
    across two calls), ``longest`` (a cache hit), ``cache_stats``."""

    def __init__(self, worker: ModelWorker, policy: LocalPolicy) -> None:
        self.worker, self.policy = worker, policy
        self.board = _Board()
        self.update, self.held = contextlib.ExitStack(), False  # the weights update between "hold" and "release"

    def hold(self) -> bool:  # the parent changes the weights: no batch runs until "release"
        self.update.enter_context(self.worker.weights_update())
        self.held = True
        return True

    def release(self) -> int:
        if not self.held:  # (a hold that failed: the update still drops the cache and bumps the version)
            self.hold()
        self.held = False
        self.update.close()  # the prefix cache dropped (the child's version counters miss the parent's writes)
        return self.worker.version

    def longest(self, ids: list[int]):
        with contextlib.nullcontext() if self.held else self.worker.weights_lock:  # not while a batch writes it
            return self.board.put(self.policy.longest_cached(ids))

    def cache_stats(self) -> dict:
        return dict(self.policy.cache_stats)


class CallFailed(RuntimeError):
    """A control call that raised in the worker process (sent back in its reply; the child lives on)."""


def _serve(conn_in, outbox: _Outbox, worker: ModelWorker, policy: LocalPolicy) -> None:
    """The child's main loop: jobs and control calls from the parent, until it closes or goes away."""
    control = _Control(worker, policy)
    while True:
        try:
            msg = conn_in.recv()
        except (EOFError, OSError):  # the parent is gone
            worker.close()
            return
        op = msg[0]
        if op == "job":
            worker.submit(_ChildJob(msg[1], outbox, *msg[2:]))
            continue
        if op == "close":
            worker.close()
            outbox.reply(msg[1], True)
            return
        try:
            value = getattr(control, op)(*msg[2:])
        except Exception as exc:  # an unknown call or its own failure: the parent hears of it, the child lives
            log.exception("model worker process: %s failed", op)
            value = CallFailed(f"{op}: {type(exc).__name__}: {exc}")
        outbox.reply(msg[1], value)


def _child_main(conn_in, conn_out, model, tokenizer, config: LocalPolicyConfig, device: str | None,
                max_batch_size: int, batch_window_s: float, threads: int, version: int) -> None:
    """Entry point of the worker process."""
    outbox = _Outbox(conn_out)
    try:
        torch.set_num_threads(threads)
        policy = LocalPolicy(model, tokenizer, config, device=device)
        worker = ModelWorker(policy, max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                             decode=_decoder(tokenizer), after_step=outbox.flush)
        outbox.stats, worker.version = worker.stats, version
    except Exception as exc:  # the parent raises WorkerStartError with this
        conn_out.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn_out.send(("ready", dict(worker.stats)))
    _serve(conn_in, outbox, worker, policy)


@contextlib.contextmanager
def _bare_main():
    """``__main__`` without a file or spec while a child is spawned: it does not re-import the caller's script."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class ProcessWorker:
    """:class:`~mosaic.agent.server.worker.ModelWorker`'s interface (``submit``, ``close``, ``weights_update``,
    ``version``, ``stats``, ``prefix_cache``) over a worker process that holds the model's shared weights."""

    def __init__(self, model, tokenizer, config: LocalPolicyConfig, *, device: str | None, max_batch_size: int,
                 batch_window_s: float, version: int = 0, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.model = model
        self.version = version
        self.dead: str | None = None  # why the child is gone (every later job fails with it)
        self.replaced = False  # an update swapped the weights' tensors: the child read stale ones and was stopped
        self.closing = False
        self._stats: dict = {}
        self._jobs: dict[int, Job] = {}
        self._replies: dict[int, list] = {}
        self._ids = itertools.count()
        self._state = threading.Condition()
        self._update = threading.Lock()  # one weights update at a time
        self._board: torch.Tensor | None = None  # the child's shared buffer of cache hits
        self._board_lock = threading.Lock()
        self._outq: queue.Queue = queue.Queue()  # what goes down: a thread sends it, nobody else blocks on the pipe
        ctx = tmp.get_context("spawn")
        down_r, self._down = ctx.Pipe(duplex=False)
        self._up, up_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_child_main, name="mosaic-model-worker", daemon=True,
            args=(down_r, up_w, model, tokenizer, config, device, max_batch_size, batch_window_s,
                  child_threads(), version))
        try:
            model.share_memory()  # (before the start: what is pickled while __main__ is bare is handles only)
            self._storages = _storages(model)  # what the child reads: an update that swaps tensors leaves them
            with _bare_main():
                self.process.start()
        except Exception as exc:  # pickling the model or tokenizer, no shared memory
            raise WorkerStartError(f"could not start the model worker process: {type(exc).__name__}: {exc}") from exc
        finally:
            down_r.close(), up_w.close()
        self._await_ready(start_timeout_s)
        self._reader = threading.Thread(target=self._read, name="mosaic-worker-reader", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_loop, name="mosaic-worker-sender", daemon=True)
        self._sender.start()
        _LIVE.add(self)

    def _await_ready(self, timeout_s: float) -> None:
        try:
            ok = self._up.poll(timeout_s)
            msg = self._up.recv() if ok else ("failed", f"not ready after {timeout_s:.0f} s")
        except (EOFError, OSError):  # e.g. it could not unpickle what it was sent
            self.process.join(timeout=10)
            msg = ("failed", f"the process exited with code {self.process.exitcode} (its error is on stderr)")
        if msg[0] != "ready":
            self.process.kill()
            raise WorkerStartError(f"the model worker process did not start: {msg[1]}")
        self._stats = msg[1]

    # ------------------------------------------------------------------ the wire
    def _read(self) -> None:
        """The parent's reader: events to their jobs' loops, replies to their callers; fails all on EOF."""
        while True:
            try:
                msg = self._up.recv()
            except (EOFError, OSError):
                self.process.join(timeout=2)  # (its exit code, when it has one)
                self._fail_all(f"the model worker process exited (code {self.process.exitcode})")
                return
            if msg[0] == "events":
                if msg[2] is not None:
                    self._stats = msg[2]
                for jid, version, event in msg[1]:
                    job = self._jobs.get(jid)
                    if job is None:
                        continue
                    job.version = version
                    if event[0] != "token":
                        self._jobs.pop(jid, None)
                    job.send(event)
            elif msg[0] == "reply":
                with self._state:
                    self._replies[msg[1]] = [msg[2]]
                    self._state.notify_all()

    def _fail_all(self, why: str) -> None:
        with self._state:
            first, self.dead = self.dead is None, self.dead or why
            self._state.notify_all()
            jobs, self._jobs = self._jobs, {}
        if jobs or (first and not self.closing):
            log.error("%s: failing its %d waiting requests", self.dead, len(jobs))
        for job in jobs.values():
            job.send(("error", why))

    def _send(self, msg: tuple) -> None:
        """Queue ``msg`` for the child; never blocks (the child stops reading while it holds the weights)."""
        self._outq.put(msg)

    def _send_loop(self) -> None:
        while (msg := self._outq.get()) is not None:
            try:
                self._down.send(msg)
            except (BrokenPipeError, OSError) as exc:
                self._fail_all(f"the model worker process is gone: {exc}")

    def _call(self, op: str, *args, timeout_s: float | None = CALL_TIMEOUT_S):
        """The child's answer to ``op`` (None ``timeout_s``: as long as it lives); RuntimeError if it is gone or
        does not answer in time, :class:`CallFailed` if the call raised there."""
        rid = next(self._ids)
        with self._state:
            if self.dead:
                raise RuntimeError(self.dead)
        self._send((op, rid, *args))
        with self._state:
            if not self._state.wait_for(lambda: rid in self._replies or self.dead, timeout_s):
                raise RuntimeError(f"the model worker process did not answer {op!r} in {timeout_s} s")
            if rid not in self._replies:
                raise RuntimeError(self.dead)
            value = self._replies.pop(rid)[0]
        if isinstance(value, CallFailed):
            raise value
        return value

    # ------------------------------------------------------------------ ModelWorker's interface
    def submit(self, job: Job) -> None:
        jid = next(self._ids)
        with self._state:  # (a job is failed here or by _fail_all, never by neither)
            if self.dead:
                job.send(("error", self.dead))
                return
            self._jobs[jid] = job
        self._send(("job", jid, job.reqs, job.temperature, job.top_p, job.stop_ids, job.seed, job.stream,
                    job.stop_strings, job.skip_special))

    @contextlib.contextmanager
    def weights_update(self):
        """No batch decodes in the child while the caller changes the shared weights in place; then the
        child's prefix cache is dropped and ``version`` goes up by one. A caller that replaced tensors instead
        (``p.data = ...``, ``model.to(dtype)``) leaves the child reading the old ones: it is stopped before it
        decodes again (:attr:`replaced`; the server starts a new one over the new tensors)."""
        with self._update:
            with contextlib.suppress(RuntimeError):  # a dead child decodes nothing: the update goes ahead
                self._call("hold", timeout_s=None)  # as long as the running batch takes (as the thread waits)
            try:
                yield
            finally:
                if _storages(self.model) != self._storages:
                    self.replaced = True
                    self._fail_all("the served model's weights were replaced by new tensors, not written in "
                                   "place: its worker process read the old ones and was stopped")
                    self.process.kill()
                try:
                    self.version = self._call("release")
                except RuntimeError:  # (a dead or stopped child)
                    self.version += 1

    @property
    def stats(self) -> dict:
        """The child's batching counters as of the last job that finished (the last ones known once it is gone)."""
        return self._stats

    def cache_stats(self) -> dict:
        """The child's prefix-cache counters (asked for; empty once it is gone)."""
        try:
            return self._call("cache_stats", timeout_s=30.0)
        except RuntimeError:
            return {}

    @property
    def gone(self) -> bool:
        """The child has exited (or was closed): known from its sentinel, whoever reaped it."""
        return self.closing or self.dead is not None or bool(mp_wait([self.process.sentinel], timeout=0))

    @property
    def prefix_cache(self) -> "ProcessWorker":
        return self

    def longest_cached(self, ids: list[int]):
        """:meth:`LocalPolicy.longest_cached` of the child's policy (copies of the keys/values), None if gone."""
        with self._board_lock:  # the board holds one hit at a time
            try:
                hit = self._call("longest", list(ids))
            except RuntimeError:
                hit = None
            if hit is None:
                return None
            n, shape, fresh = hit
            if fresh is not None:
                self._board = fresh
            kv = self._board[:math.prod(shape)].view(shape).clone()
        return n, [(layer[0], layer[1]) for layer in kv]

    def close(self) -> None:
        """Stop the child (its running batch is failed), the reader and the sender; release the pipes."""
        if self.closing:
            return
        self.closing = True
        _LIVE.discard(self)
        if self.dead is None and self.process.is_alive():
            with contextlib.suppress(RuntimeError):
                self._call("close", timeout_s=15.0)
        self.process.join(timeout=10)
        if not mp_wait([self.process.sentinel], timeout=0):  # (not is_alive(): another thread may have reaped it)
            self.process.kill()
            self.process.join(timeout=10)
        self._outq.put(None)
        self._sender.join(timeout=10)
        self._reader.join(timeout=10)
        self._down.close(), self._up.close()
        with contextlib.suppress(ValueError):  # (still running: its handle stays)
            self.process.close()


_LIVE: "weakref.WeakSet[ProcessWorker]" = weakref.WeakSet()  # started, not closed


@atexit.register
def _quiet_at_exit() -> None:  # an interpreter that exits with a worker open ends its child: no error to report
    for w in list(_LIVE):
        w.closing = True


def _storages(model) -> list[int]:
    """Where the model's weights live: changed by a swap, not by an in-place write (buffers are left out: a
    forward may rebuild its own caches, as a dynamic rotary embedding does, and the child's forward does too)."""
    return [p.untyped_storage().data_ptr() for p in model.parameters()]


def _decoder(tokenizer):
    """``decode(ids, skip_special)``: the text a worker checks stop strings against."""
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def decodes_in(worker, fallback: str | None) -> str:
    """Where a server's model decodes, for a console line: a worker process, or a thread (and why no process)."""
    if isinstance(worker, ProcessWorker):
        return "a worker process"
    return "a thread of this process" + (f" (the worker process did not start: {fallback})" if fallback else "")


def child_threads() -> int:
    """Intra-op threads of a worker process: this process's less one (at least one), so the serving threads keep
    a core (a child given as many as the trainer decoded 4-40x slower on a loaded 2-core machine)."""
    return max(1, torch.get_num_threads() - 1)


def start_worker(policy: LocalPolicy, tokenizer, *, process: bool, max_batch_size: int, batch_window_s: float,
                 version: int = 0) -> tuple[ModelWorker | ProcessWorker, str | None]:
    """The server's worker over ``policy``'s model, starting at policy ``version``: a :class:`ProcessWorker` when
    ``process`` and it starts, else a :class:`~mosaic.agent.server.worker.ModelWorker` thread; and why a process
    asked for did not start."""
    fallback = None
    if process:
        try:
            return ProcessWorker(policy.model, tokenizer, policy.config, device=str(policy.device),
                                 max_batch_size=max_batch_size, batch_window_s=batch_window_s, version=version), None
        except WorkerStartError as exc:
            log.warning("%s; the model decodes in a thread of this process instead", exc)
            fallback = str(exc)
    worker = ModelWorker(policy, max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                         decode=_decoder(tokenizer))
    worker.version = version
    return worker, fallback
