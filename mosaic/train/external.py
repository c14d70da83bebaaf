"""Rollouts from any agent harness, through the recording proxy (``rollout.source=harness``).

Per RL step the trainer

1. serves the current policy in-process over the OpenAI-compatible API (``mosaic serve``'s app,
   token ids and sampling log-probs returned) behind the recording proxy, both on 127.0.0.1;
2. launches the user's harness once per task × sample, each with its own rollout base URL
   (``/rollouts/{id}/v1``), the task, a tool endpoint for the deep-search tools and a deadline,
   at most ``rollout.concurrency`` at once. The harness is a Python callable
   (``rollout.harness=module:function``, sync or async, given a :class:`HarnessTask`) or a shell
   command (anything else), given the same in its environment (``MOSAIC_*``, ``OPENAI_BASE_URL``);
3. takes the reward the harness posted (``rollout.reward=harness``) or scores the answer it
   returned (a callable's return value, a command's last stdout line, or a posted ``answer``)
   with the deep-search reward (``deepsearch``, the default) or ``module:function(task, answer)``;
4. when every rollout has ended or passed its deadline, rebuilds each rollout's session graph from
   the proxy's records (:func:`mosaic.capture.reconstruct.reconstruct_rollout`) and drops — and
   counts, as ``rollout/dropped/<reason>`` — rollouts that crashed, timed out, posted no reward
   or posted twice, made no call, were answered by other weights, or could not be rebuilt.
   Nothing is trained on a partial graph.

The trainer then scores gains, computes advantages and updates the policy exactly as for its own
harness. The update runs inside :meth:`ModelServer.weights_update`: no request is decoded while the
weights change (a late request waits) and the policy version the server stamps on every response
(recorded as ``CallRecord.policy_version``) goes up by one, so every call a step trains on is
checked to have been answered by that step's weights.

The trainer writes each kept rollout's reward record (with the ground truth, task and group) into
the same records file, so ``mosaic proxy export RUN_DIR/records`` rebuilds exactly the graphs it
trained on, and ``rollout.source=records`` can replay them later.

Sampling is the trainer's: the proxy sets ``temperature`` and ``top_p`` of every request to the
``rollout`` section's (the PPO ratio divides the logits by that temperature).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from mosaic.agent.config import HarnessConfig
from mosaic.agent.harness import DeepSearchEnv
from mosaic.capture.records import RECORDS_FILE, CallRecord, RecordError, RewardRecord
from mosaic.capture.reconstruct import reconstruct_rollout
from mosaic.capture.sessions import DEFAULT_COMPACTION_PATTERNS, ReconstructionRules
from mosaic.envs.rewards import score_answer
from mosaic.trace import Trajectory
from mosaic.trace.graph import TraceError
from mosaic.train.sections import CALLABLE_SPEC

__all__ = ["HarnessTask", "ExternalRollouts", "DROP_REASONS", "DROPS_FILE", "load_callable", "is_callable_spec",
           "check_callables"]

DROP_REASONS = ("crashed", "timeout", "no_reward", "double_reward", "no_calls", "foreign_id", "stale_policy",
                "unbuildable")
"""Why a rollout is left out of a step (``rollout/dropped/<reason>``)."""


DROPS_FILE = "drops.jsonl"
"""Every dropped rollout of a run, one JSON line each (step, rollout id, task, reason, detail), in the
folder above the records (the run dir; not among the records, whose every ``*.jsonl`` is read)."""

_TRAINER = "mosaic-trainer"  # meta["by"] of the reward records the trainer writes


def is_callable_spec(spec: str) -> bool:
    """``module:function`` or ``path/to/file.py:function`` (a Python callable) rather than a shell command."""
    return bool(CALLABLE_SPEC.match(spec.strip()))


_FILE_MODULES: dict[tuple[Path, int], object] = {}  # (path, mtime_ns) -> module: a file's top-level code runs once


def _load_file(path: Path):
    """Import a ``.py`` file as module ``mosaic_harness_<stem>``; the same unchanged file is imported once per
    process (the config check and the trainer both load the harness). Its folder is appended to
    ``sys.path`` — last, so installed packages win over files beside it (a harness named ``openai.py`` can
    still ``import openai``) while its own helper modules can be imported."""
    key = (path, path.stat().st_mtime_ns)
    if key not in _FILE_MODULES:
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        name = f"mosaic_harness_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # registered while it runs, as an import would (dataclasses look it up)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def load_callable(spec: str, what: str) -> Callable:
    """Import ``module:function``; a clear ValueError naming ``what`` when it cannot be."""
    mod, _, name = spec.strip().rpartition(":")
    try:
        if mod.endswith(".py"):  # a file: imported under its own name, its folder last on sys.path
            path = Path(mod).resolve()
            if not path.is_file():
                raise ImportError(f"no file {mod}")
            module = _load_file(path)
        else:
            module = importlib.import_module(mod)
        fn = getattr(module, name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever importing the user's module raises (an exit
        # at import time included), said in one line naming the key
        raise ValueError(f"{what}: cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r} is not callable")
    return fn


def check_callables(rc) -> None:
    """Load ``rollout.harness`` and ``rollout.reward`` when they name Python callables: a
    :class:`ConfigError` naming the key if one cannot be (before the warm start and its evaluation)."""
    from mosaic.train.config import ConfigError

    for spec, what in ((rc.harness, "rollout.harness"), (rc.reward, "rollout.reward")):
        if spec and is_callable_spec(spec):
            try:
                load_callable(spec, what)
            except ValueError as exc:
                raise ConfigError(f"config key '{what}': {str(exc).removeprefix(what + ': ')}") from None


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
        tools_url: ``POST {"name": "search", "arguments": {"query": ...}}`` → ``{"content": ...}``.
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
    _tools: Callable[[str, dict], str] | None = field(default=None, repr=False)

    def call_tool(self, name: str, arguments: dict) -> str:
        """Run a deep-search tool in-process (what ``tools_url`` does over HTTP)."""
        if self._tools is None:
            raise RuntimeError("no tools attached to this task")
        return self._tools(name, arguments)

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
class _Outcome:
    """How one launched rollout ended, before its records are read."""

    answer: str | None = None
    reward: float | None = None  # returned by a Python harness as {"reward": r}
    failure: str | None = None  # crashed | timeout
    detail: str = ""


def reconstruction_rules(hcfg: HarnessConfig) -> ReconstructionRules:
    """The capture rules plus the harness section's compaction instruction (rule 4), and its success threshold."""
    return ReconstructionRules(
        compaction_patterns=DEFAULT_COMPACTION_PATTERNS + (re.escape(hcfg.compaction_prompt[:60]),),
        success_threshold=hcfg.success_threshold)


def unscorable(traj: Trajectory) -> str | None:
    """Why the gain scorer could not score ``traj`` (a non-final session without both states, e.g. a
    compaction whose successor was never found, or no ground truth); None when it can."""
    if not traj.ground_truth:
        return "no ground truth"
    for s in traj.sessions:
        if not s.is_final and (s.state_before is None or s.state_after is None):
            return f"session {s.id} ({s.kind}) has no {'state_before' if s.state_before is None else 'state_after'}" \
                   f"{' (no successor found)' if s.kind == 'compaction' else ''}"
    return None


def _answer_of(value: Any) -> tuple[str | None, float | None]:
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


class ExternalRollouts:
    """The served policy, the recording proxy and the harness launcher of one training run.

    ``model`` is served as it is (the same object the trainer updates in place); call :meth:`collect`
    for each step's rollouts, run the update inside :meth:`hold`, and :meth:`close` at the end.
    """

    def __init__(self, cfg, model, tokenizer, split, records_dir: str | os.PathLike, *, model_name: str = "mosaic-policy"):
        from mosaic.agent.server.app import create_app
        from mosaic.capture.proxy import ProxyConfig, create_proxy_app
        from mosaic.serving import ServerThread

        self.cfg = cfg
        self.rc = cfg.rollout
        self.hcfg: HarnessConfig = cfg.harness
        self.split = split
        self.env = DeepSearchEnv(split)
        self.model_name = model_name
        self.tasks_by_rollout: dict[str, Any] = {}
        self.live: set[str] = set()  # rollout ids of the step in progress (tools and calls accepted)
        self.foreign = Counter()  # calls / tool calls / rewards with a rollout id the trainer did not give
        self.records_dir = Path(records_dir)
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.records_path = self.records_dir / RECORDS_FILE
        self.drops_path = self.records_dir.parent / DROPS_FILE
        self.run_nonce = secrets.token_hex(3)  # a restarted trainer never reuses a killed attempt's ids
        self.harness_spec = self.rc.harness.strip()
        self.harness_fn = load_callable(self.harness_spec, "rollout.harness") if is_callable_spec(self.harness_spec) else None
        self.reward_fn = None
        if self.rc.reward not in ("deepsearch", "harness"):
            self.reward_fn = load_callable(self.rc.reward, "rollout.reward")
        self.rules = reconstruction_rules(self.hcfg)
        app = create_app(model, tokenizer, model_name=model_name, device=str(next(model.parameters()).device),
                         max_batch_size=self.rc.batch_size, default_max_tokens=self.hcfg.max_new_tokens)
        self.server = app.state.server
        self.server_thread = ServerThread(app).start()
        pcfg = ProxyConfig(upstream=self.server_thread.url, out_dir=str(self.records_dir), port=0,
                           timeout_s=max(30.0, self.rc.deadline_s + 30.0))
        self.proxy_app = create_proxy_app(pcfg, tokenizer=tokenizer, accept_rollout=self._accept,
                                          force_params={"temperature": self.rc.temperature, "top_p": self.rc.top_p})
        self._add_tool_route(self.proxy_app)
        self.proxy_thread = ServerThread(self.proxy_app).start()
        self.url = self.proxy_thread.url

    # ------------------------------------------------------------------ server side
    def _accept(self, rollout_id: str, what: str) -> bool:
        ok = rollout_id in self.live
        if not ok:
            self.foreign[what] += 1
        return ok

    def _tool(self, rollout_id: str, name: str, arguments: Any) -> str:
        from mosaic.agent.tools import TOOL_ARGS

        if name != "search":
            raise ValueError(f"no tool named {name!r}; this environment has: search")
        key = TOOL_ARGS[name]
        if not isinstance(arguments, dict) or not isinstance(arguments.get(key), str) or not arguments[key].strip():
            raise ValueError(f'{name} takes one non-empty string argument: {{"{key}": "..."}}')
        return self.env.search(arguments[key].strip()[: self.hcfg.max_arg_chars], self.hcfg.search_k)

    def _add_tool_route(self, app) -> None:
        from starlette.responses import JSONResponse

        async def tools(request):  # a plain Starlette route: no parameter parsing by annotation
            rollout_id = request.path_params["rollout_id"]
            if not self._accept(rollout_id, "tools"):
                return JSONResponse({"error": {"message": f"unknown rollout id {rollout_id!r}"}}, status_code=404)
            try:
                body = json.loads(await request.body())
                content = await asyncio.to_thread(self._tool, rollout_id, body.get("name"), body.get("arguments"))
            except (ValueError, AttributeError, RecursionError) as exc:
                return JSONResponse({"error": {"message": str(exc)[:500]}}, status_code=400)
            return JSONResponse({"content": content})

        app.router.add_route("/rollouts/{rollout_id}/tools", tools, methods=["POST"])

    @property
    def policy_version(self) -> int:
        return self.server.policy_version

    def hold(self):
        """Context manager for the update: no request decodes meanwhile; the policy version goes up on exit."""
        return self.server.weights_update()

    def close(self) -> None:
        self.proxy_thread.stop()
        self.server_thread.stop()

    # ------------------------------------------------------------------ one step
    def _task(self, task, step: int, k: int) -> HarnessTask:
        rid = f"s{step}-{self.run_nonce}-{task.id}-{k}"
        base = f"{self.url}/rollouts/{rid}"
        return HarnessTask(rollout_id=rid, base_url=base + "/v1", model=self.model_name, question=task.question,
                           task_id=task.id, group_id=task.id, sample=k, deadline=0.0, tools_url=base + "/tools",
                           reward_url=base + "/reward", harness=self.hcfg,
                           _tools=lambda name, args, rid=rid: self._tool(rid, name, args))

    async def _run_callable(self, ht: HarnessTask) -> _Outcome:
        timeout = max(0.0, ht.deadline - time.time())
        try:
            if inspect.iscoroutinefunction(self.harness_fn):
                value = await asyncio.wait_for(self.harness_fn(ht), timeout)
            else:  # a thread of its own: one that hangs is abandoned at the deadline, not joined
                loop = asyncio.get_running_loop()
                fut = loop.create_future()

                def settle(fn) -> None:
                    try:
                        loop.call_soon_threadsafe(lambda: fut.done() or fn())
                    except RuntimeError:  # the step is over (this rollout passed its deadline): nobody listens
                        pass

                def work():
                    try:
                        v = self.harness_fn(ht)
                        settle(lambda: fut.set_result(v))
                    except BaseException as exc:  # noqa: BLE001 - the rollout's failure, reported below
                        settle(lambda e=exc: fut.set_exception(e))

                threading.Thread(target=work, name=f"harness-{ht.rollout_id}", daemon=True).start()
                value = await asyncio.wait_for(fut, timeout)
            answer, reward = _answer_of(value)
            return _Outcome(answer=answer, reward=reward)
        except asyncio.TimeoutError:
            return _Outcome(failure="timeout", detail=f"no return within {self.rc.deadline_s:g} s")
        except Exception as exc:  # noqa: BLE001
            return _Outcome(failure="crashed", detail=f"{type(exc).__name__}: {exc}"[:500])

    async def _run_command(self, ht: HarnessTask) -> _Outcome:
        env = {**os.environ, **ht.env()}
        proc = await asyncio.create_subprocess_shell(self.harness_spec, env=env, stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), max(0.0, ht.deadline - time.time()))
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return _Outcome(failure="timeout", detail=f"killed at the {self.rc.deadline_s:g} s deadline")
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
            return _Outcome(failure="crashed", detail=f"exit {proc.returncode}: {' | '.join(tail)}"[:500])
        lines = [ln.strip() for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
        return _Outcome(answer=lines[-1][:1000] if lines else None)

    async def _launch_all(self, hts: list[HarnessTask]) -> list[_Outcome]:
        sem = asyncio.Semaphore(self.rc.concurrency)

        async def one(ht: HarnessTask) -> _Outcome:
            async with sem:
                ht.deadline = time.time() + self.rc.deadline_s
                if self.harness_fn is not None:
                    return await self._run_callable(ht)
                return await self._run_command(ht)

        return list(await asyncio.gather(*(one(ht) for ht in hts)))

    def _read_new(self, offset: int) -> tuple[list[CallRecord], list[RewardRecord], int, int]:
        """Records appended since ``offset`` → calls, rewards, the new offset and the number of bad lines."""
        if not self.records_path.exists():
            return [], [], offset, 0
        with open(self.records_path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line still being written stays for the next read
        calls, rewards, bad = [], [], 0
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if d.get("type") == "reward":
                    rewards.append(RewardRecord.from_dict(d))
                else:
                    calls.append(CallRecord.from_dict(d))
            except (ValueError, RecordError, TypeError, AttributeError):
                bad += 1
        return calls, rewards, offset + end, bad

    def _wait_quiet(self, timeout: float = 10.0) -> None:
        """Until the proxy has written every answered call (a streamed call's record lands after its last byte)."""
        self.proxy_app.state.proxy.wait_quiet(timeout)

    def _reward(self, task, ht: HarnessTask, out: _Outcome, posted: list[RewardRecord]) -> tuple[float | None, str | None]:
        """(reward, answer) of a rollout that ended, or (None, reason) when it has none."""
        answer = out.answer
        if answer is None and posted and posted[-1].answer is not None:
            answer = posted[-1].answer
        if self.rc.reward == "harness":
            if posted:
                return float(posted[-1].reward), answer
            if out.reward is not None:
                return out.reward, answer
            return None, None
        if self.reward_fn is not None:
            r = self.reward_fn(task, answer)
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
                raise ValueError(f"rollout.reward returned {r!r}: must be a number in [0, 1]")
            return float(r), answer
        if answer is None:
            return 0.0, None
        text = answer if "<answer>" in answer else f"<answer>{answer}</answer>"
        s = score_answer(text, task.answer, self.hcfg.reward_metric)
        return s.reward, s.answer if s.answer is not None else answer

    def collect(self, tasks: Sequence, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Run the harness on every task × ``train.group_size`` samples; the step's trajectories and metrics."""
        G = self.cfg.train.group_size
        hts = [self._task(t, step, k) for t in tasks for k in range(G)]
        by_rid = {ht.rollout_id: (t, ht) for t, ht in zip([t for t in tasks for _ in range(G)], hts)}
        offset = self.records_path.stat().st_size if self.records_path.exists() else 0
        self.foreign.clear()
        version = self.policy_version
        self.live = set(by_rid)
        t0 = time.perf_counter()
        try:
            outcomes = asyncio.run(self._launch_all(hts))
        finally:
            self.live = set()  # late calls of a timed-out harness are refused from here on
        self._wait_quiet()
        calls, rewards, _, bad = self._read_new(offset)
        wall = time.perf_counter() - t0
        by_calls: dict[str, list[CallRecord]] = {}
        for c in calls:
            by_calls.setdefault(c.rollout_id, []).append(c)
        posted: dict[str, list[RewardRecord]] = {}
        for r in rewards:
            if r.meta.get("by") != _TRAINER:
                posted.setdefault(r.rollout_id, []).append(r)

        drops: list[dict] = []
        trajs: list[Trajectory] = []
        for ht, out in zip(hts, outcomes):
            task, _ = by_rid[ht.rollout_id]
            mine = by_calls.get(ht.rollout_id, [])
            reason, detail = out.failure, out.detail
            if reason is None and len(posted.get(ht.rollout_id, [])) > 1:
                reason, detail = "double_reward", f"{len(posted[ht.rollout_id])} rewards posted"
            if reason is None and not any(c.ok for c in mine):
                reason = "foreign_id" if sum(self.foreign.values()) else "no_calls"
                detail = f"{len(mine)} call(s), none answered" if mine else "no model call on its rollout URL"
            if reason is None and any(c.ok and c.policy_version != version for c in mine):
                reason = "stale_policy"
                detail = f"answered by {sorted({c.policy_version for c in mine} - {version})}, step uses {version}"
            reward = answer = None
            if reason is None:
                try:
                    reward, answer = self._reward(task, ht, out, posted.get(ht.rollout_id, []))
                except Exception as exc:  # noqa: BLE001 - a reward function that fails drops its rollout
                    reason, detail = "no_reward", f"rollout.reward failed: {type(exc).__name__}: {exc}"[:500]
                else:
                    if reward is None:
                        reason, detail = "no_reward", "the harness posted no reward"
            traj = None
            if reason is None:
                rec = RewardRecord(rollout_id=ht.rollout_id, reward=reward, ground_truth=task.answer, answer=answer,
                                   task_id=task.id, group_id=task.id, t=time.time(),
                                   meta={"by": _TRAINER, "step": step, "policy_version": version})
                try:
                    traj = reconstruct_rollout(mine, rec, self.rules, rollout_id=ht.rollout_id)
                except (TraceError, ValueError, KeyError, IndexError) as exc:
                    reason, detail = "unbuildable", f"{type(exc).__name__}: {exc}"[:500]
                else:
                    why = "no usable call" if traj is None else unscorable(traj)
                    if why is not None:
                        reason, detail = "unbuildable", why
                    else:
                        self.proxy_app.state.proxy.record(rec)
            if reason is not None:
                drops.append({"step": step + 1, "rollout_id": ht.rollout_id, "task_id": task.id, "reason": reason,
                              "detail": detail})
                continue
            traj.meta["harness"] = {"policy_version": version, "sample": ht.sample}
            trajs.append(traj)

        dropped = Counter(d["reason"] for d in drops)
        examples: dict[str, str] = {}
        for d in drops:
            examples.setdefault(d["reason"], f"{d['rollout_id']}: {d['detail']}")
        m: dict[str, float] = {f"rollout/dropped/{r}": float(dropped.get(r, 0)) for r in DROP_REASONS}
        m["rollout/dropped"] = float(sum(dropped.values()))
        m["rollout/launched"] = float(len(hts))
        m["rollout/kept"] = float(len(trajs))
        m["rollout/foreign_requests"] = float(sum(self.foreign.values()))
        m["rollout/bad_record_lines"] = float(bad)
        m["rollout/calls"] = float(sum(len(by_calls.get(ht.rollout_id, [])) for ht in hts))
        m["timing_s/harness"] = wall
        self.last_drop_examples = examples
        if drops:  # why, rollout by rollout (RUN_DIR/drops.jsonl), and one example per reason on the console
            with open(self.drops_path, "a") as f:
                f.writelines(json.dumps(d) + "\n" for d in drops)
            head = "every rollout" if not trajs else f"{len(drops)} of {len(hts)} rollouts"
            print(f"[mosaic] step {step + 1}: {head} dropped ({', '.join(f'{r} {n}' for r, n in dropped.items())}; "
                  f"{self.drops_path})" + "".join(f"\n  {r}: {e}" for r, e in examples.items())
                  + ("\n  nothing to train on in this step" if not trajs else ""), file=sys.stderr, flush=True)
        return trajs, m


class RecordsReplay:
    """Rollouts captured earlier (``rollout.source=records``): proxy records with rewards, replayed off-policy.

    Every rewarded rollout of ``rollout.records`` is rebuilt once (the same rules as the live source);
    rollouts that cannot be rebuilt, lack a reward, or lack sampling log-probs on a sampled token are
    dropped and counted. Groups (``group_id``) are visited in a seeded order, ``train.batch_tasks`` per
    step, epoch after epoch. The PPO ratio is taken against the **recorded** sampling log-probs, so it is
    the importance ratio of the current policy to the one that sampled (clipped as usual; the
    ``actor/ratio_*`` metrics show how far off-policy the data is).
    """

    def __init__(self, cfg):
        import random
        import warnings

        from mosaic.capture.records import load_records

        self.cfg = cfg
        hcfg: HarnessConfig = cfg.harness
        self.rules = reconstruction_rules(hcfg)
        path = Path(cfg.rollout.records)
        if not path.exists():
            raise FileNotFoundError(f"rollout.records: {path} does not exist")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # counted below instead
            try:
                calls, rewards = load_records(path, lenient=True)
            except RecordError as exc:
                raise ValueError(f"rollout.records: {exc}") from None
        by: dict[str, list[CallRecord]] = {}
        for c in calls:
            by.setdefault(c.rollout_id, []).append(c)
        self.dropped: Counter = Counter()
        groups: dict[str, list[Trajectory]] = {}
        for rid, cs in by.items():
            rw = rewards.get(rid)
            if rw is None:
                self.dropped["no_reward"] += 1
                continue
            try:
                t = reconstruct_rollout(cs, rw, self.rules, rollout_id=rid)
            except (TraceError, ValueError, KeyError, IndexError):
                t = None
            if t is None or unscorable(t) is not None:
                self.dropped["unbuildable"] += 1
                continue
            if any(c.ok and len(c.logprobs) != len(c.completion_ids) for c in cs):  # no importance ratio
                self.dropped["no_logprobs"] += 1
                continue
            groups.setdefault(t.group_id, []).append(t)
        if not groups:
            raise ValueError(f"rollout.records: no usable rollout in {path} "
                             f"(dropped: {dict(self.dropped) or 'no call records'})")
        self.group_ids = sorted(groups)
        self.groups = groups
        self._order_cache: dict[int, list[str]] = {}
        self._random = random

    @property
    def n_groups(self) -> int:
        return len(self.group_ids)

    def _order(self, epoch: int) -> list[str]:
        if epoch not in self._order_cache:
            order = list(self.group_ids)
            self._random.Random(f"{self.cfg.train.seed}/replay/{epoch}").shuffle(order)
            self._order_cache = {epoch: order}
        return self._order_cache[epoch]

    def collect(self, tasks: Sequence, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The groups of step ``step`` (``tasks`` is ignored: the records are the tasks)."""
        B, n = self.cfg.train.batch_tasks, self.n_groups
        picked: list[str] = []
        for k in range(step * B, (step + 1) * B):
            epoch, pos = divmod(k, n)
            g = self._order(epoch)[pos]
            if g not in picked:
                picked.append(g)
        trajs = [t for g in picked for t in self.groups[g]]
        m = {f"rollout/dropped/{r}": float(v) for r, v in self.dropped.items()}
        m.update({"rollout/replayed": float(len(trajs)), "train/tasks": float(len(picked))})
        return trajs, m

    def hold(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
