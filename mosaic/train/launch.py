"""Running a user's agent harness for one rollout: a Python callable or a shell command.

A harness gets a :class:`HarnessTask` (a command gets the same fields in its environment), talks to
the served policy through its rollout's base URL, and ends by returning (or printing, last) its
answer. :func:`launch_all` runs a step's rollouts at most ``concurrency`` at once, each with its own
deadline; how each one ended is an :class:`Outcome` (answer and reward, or ``crashed`` / ``timeout``
with a detail). Nothing here knows the proxy or the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mosaic.config.harness import HarnessConfig

__all__ = ["HarnessTask", "Outcome", "answer_of", "launch_all"]


@dataclass
class HarnessTask:
    """What a harness gets for one rollout (a Python harness gets this object; a command gets the same
    fields in its environment, named in :meth:`env`).

    Attributes:
        rollout_id: this rollout's id; every model call must go to ``base_url`` (which carries it).
        base_url: OpenAI-compatible base URL for this rollout (``.../rollouts/{id}/v1``).
        model: the model name to request.
        question / task_id / group_id / sample: the task, its GRPO group and this sample's index.
        deadline: wall-clock time (``time.time()``) by which the harness must have returned.
        tools_url: ``POST {"name": "search", "arguments": {"query": ...}}`` → ``{"content": ...}`` (the service
            family: its account tools, e.g. ``{"name": "get_account", "arguments": {}}``).
        reward_url: ``POST {"reward": r, "answer": ...}`` (when the harness scores itself).
        harness: the trainer's harness settings (prompts, budgets, mode) for harnesses that mirror them.
    """

    rollout_id: str
    base_url: str
    model: str
    question: str
    task_id: str
    group_id: str
    sample: int
    deadline: float
    tools_url: str
    reward_url: str
    harness: HarnessConfig
    tools: Callable[[str, dict], str] | None = field(default=None, repr=False)
    """The environment's tools in-process (what ``tools_url`` does over HTTP); use :meth:`call_tool`."""

    def call_tool(self, name: str, arguments: dict) -> str:
        """Run one of the environment's tools in-process (what ``tools_url`` does over HTTP)."""
        if self.tools is None:
            raise RuntimeError("no tools attached to this task")
        return self.tools(name, arguments)

    def search(self, query: str) -> str:
        return self.call_tool("search", {"query": query})

    def env(self) -> dict[str, str]:
        """The environment a command harness runs with."""
        return {
            "MOSAIC_ROLLOUT_ID": self.rollout_id, "MOSAIC_BASE_URL": self.base_url, "MOSAIC_MODEL": self.model,
            "MOSAIC_QUESTION": self.question, "MOSAIC_TASK_ID": self.task_id, "MOSAIC_GROUP_ID": self.group_id,
            "MOSAIC_SAMPLE": str(self.sample), "MOSAIC_DEADLINE": f"{self.deadline:.3f}",
            "MOSAIC_TOOLS_URL": self.tools_url, "MOSAIC_REWARD_URL": self.reward_url,
            "OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": "mosaic-local",
        }


@dataclass
class Outcome:
    """How one launched rollout ended, before its records are read."""

    answer: str | None = None
    reward: float | None = None  # returned by a Python harness as {"reward": r}
    failure: str | None = None  # crashed | timeout
    detail: str = ""


def answer_of(value: Any) -> tuple[str | None, float | None]:
    """A Python harness's return value: None, the answer text, or ``{"answer": ..., "reward": ...}``."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, None
    if isinstance(value, dict):
        a, r = value.get("answer"), value.get("reward")
        if a is not None and not isinstance(a, str):
            raise TypeError(f"harness returned answer {a!r}: must be a string")
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1):
            raise TypeError(f"harness returned reward {r!r}: must be a number in [0, 1]")
        return a, None if r is None else float(r)
    raise TypeError(f"harness returned {type(value).__name__}: expected None, a string or a dict")


async def _in_thread(fn: Callable, ht: HarnessTask, timeout: float) -> Any:
    """``fn(ht)`` in a thread of its own: one that hangs is abandoned at the deadline, not joined."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(set_it) -> None:
        try:
            loop.call_soon_threadsafe(lambda: fut.done() or set_it())
        except RuntimeError:  # the step is over (this rollout passed its deadline): nobody listens
            pass

    def work():
        try:
            v = fn(ht)
            settle(lambda: fut.set_result(v))
        except BaseException as exc:  # noqa: BLE001 - the rollout's failure, reported by the caller
            settle(lambda e=exc: fut.set_exception(e))

    threading.Thread(target=work, name=f"harness-{ht.rollout_id}", daemon=True).start()
    return await asyncio.wait_for(fut, timeout)


async def run_callable(fn: Callable, ht: HarnessTask, deadline_s: float) -> Outcome:
    """Run a Python harness (sync or async) until ``ht.deadline``."""
    timeout = max(0.0, ht.deadline - time.time())
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(ht), timeout)
        else:
            value = await _in_thread(fn, ht, timeout)
        answer, reward = answer_of(value)
        return Outcome(answer=answer, reward=reward)
    except asyncio.TimeoutError:
        return Outcome(failure="timeout", detail=f"no return within {deadline_s:g} s")
    except Exception as exc:  # noqa: BLE001
        return Outcome(failure="crashed", detail=f"{type(exc).__name__}: {exc}"[:500])


async def run_command(command: str, ht: HarnessTask, deadline_s: float) -> Outcome:
    """Run a shell-command harness (its own process group, killed whole at the deadline); its answer is
    the last non-empty line it prints."""
    env = {**os.environ, **ht.env()}
    proc = await asyncio.create_subprocess_shell(command, env=env, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), max(0.0, ht.deadline - time.time()))
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return Outcome(failure="timeout", detail=f"killed at the {deadline_s:g} s deadline")
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        return Outcome(failure="crashed", detail=f"exit {proc.returncode}: {' | '.join(tail)}"[:500])
    lines = [ln.strip() for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
    return Outcome(answer=lines[-1][:1000] if lines else None)


async def launch_all(hts: list[HarnessTask], *, fn: Callable | None, command: str, concurrency: int,
                     deadline_s: float) -> list[Outcome]:
    """Run every rollout (``fn`` when the harness is a callable, else ``command``), at most ``concurrency``
    at once; each one's deadline starts when it starts. Outcomes in the order of ``hts``."""
    sem = asyncio.Semaphore(concurrency)

    async def one(ht: HarnessTask) -> Outcome:
        async with sem:
            ht.deadline = time.time() + deadline_s
            if fn is not None:
                return await run_callable(fn, ht, deadline_s)
            return await run_command(command, ht, deadline_s)

    return list(await asyncio.gather(*(one(ht) for ht in hts)))
