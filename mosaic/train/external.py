"""Rollouts from any agent harness, through the recording proxy (``rollout.source=harness``).

Per RL step the trainer

1. serves the current policy over the OpenAI-compatible API (``mosaic serve``'s app in this process, token
   ids and sampling log-probs returned) behind the recording proxy, both on 127.0.0.1; the model decodes in
   a worker process over the trainer's shared weights (``rollout.worker_process``,
   :mod:`mosaic.agent.server.procworker`; one that died is replaced at the next step), else in a thread;
2. launches the user's harness once per task × sample, each with its own rollout base URL
   (``/rollouts/{id}/v1``), the task, a tool endpoint for the deep-search tools and a deadline,
   at most ``rollout.concurrency`` at once (:mod:`mosaic.train.launch`). The harness is a Python
   callable (``rollout.harness=module:function``, sync or async, given a
   :class:`~mosaic.train.launch.HarnessTask`; loaded by :mod:`mosaic.train.usercode`) or a shell
   command (anything else), given the same in its environment (``MOSAIC_*``, ``OPENAI_BASE_URL``);
3. takes the reward the harness posted (``rollout.reward=harness``) or scores the answer it
   returned (a callable's return value, a command's last stdout line, or a posted ``answer``)
   with the deep-search reward (``deepsearch``, the default) or ``module:function(task, answer)``;
   on the service family (``data.family=service``) the tool endpoint serves the account tools of a backend
   opened per rollout, and the default reward is the family's (the backend's final state and the answer;
   its stale actions and visits land in ``traj.meta["env"]``);
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
the same records file (through the proxy's :meth:`~mosaic.capture.proxy.RecordingProxy.record`), so
``mosaic proxy export RUN_DIR/records`` rebuilds exactly the graphs it trained on, and
``rollout.source=records`` can replay them later (:mod:`mosaic.train.replay`).

Sampling is the trainer's: the proxy sets ``temperature`` and ``top_p`` of every request to the
``rollout`` section's (the PPO ratio divides the logits by that temperature).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from mosaic.agent.episode import make_env
from mosaic.agent.tools import TOOL_ARGS
from mosaic.capture.reconstruct import reconstruct_rollout
from mosaic.capture.records import RECORDS_FILE, CallRecord, RecordError, RewardRecord, parse_record
from mosaic.capture.sessions import DEFAULT_COMPACTION_PATTERNS, ReconstructionRules
from mosaic.config.harness import HarnessConfig
from mosaic.envs.rewards import score_answer
from mosaic.trace import Trajectory
from mosaic.trace.graph import TraceError
from mosaic.train.launch import HarnessTask, Outcome, launch_all
from mosaic.train.usercode import is_callable_spec, load_callable

__all__ = ["ExternalRollouts", "DROP_REASONS", "DROPS_FILE", "reconstruction_rules", "unscorable"]

DROP_REASONS = ("crashed", "timeout", "no_reward", "double_reward", "no_calls", "foreign_id", "stale_policy",
                "unbuildable", "bad_record")
"""Why a rollout is left out of a step (``rollout/dropped/<reason>``)."""


DROPS_FILE = "drops.jsonl"
"""Every dropped rollout of a run, one JSON line each (step, rollout id, task, reason, detail), in the
folder above the records (the run dir; not among the records, whose every ``*.jsonl`` is read)."""

_TRAINER = "mosaic-trainer"  # meta["by"] of the reward records the trainer writes


def reconstruction_rules(hcfg: HarnessConfig, tokenizer=None) -> ReconstructionRules:
    """The capture rules plus the harness section's compaction instruction (rule 4), and its success threshold;
    with the served model's ``tokenizer``, the prefix renderer that puts a compaction's history tail (the
    last tool responses) in its parent's row (:func:`mosaic.agent.server.textops.prefix_renderer`)."""
    from mosaic.agent.server.textops import prefix_renderer

    return ReconstructionRules(
        compaction_patterns=DEFAULT_COMPACTION_PATTERNS + (re.escape(hcfg.compaction_prompt[:60]),),
        success_threshold=hcfg.success_threshold,
        render_prefix=prefix_renderer(tokenizer) if tokenizer is not None else None)


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


class ExternalRollouts:
    """The served policy, the recording proxy and the harness launcher of one training run.

    ``model`` is served as it is (the same object the trainer updates in place); call :meth:`collect`
    for each step's rollouts, run the update inside :meth:`hold`, and :meth:`close` at the end.
    """

    live_scorer = None  # (a RolloutSource: session states are scored after the rollout, not during it)

    @property
    def scoring_policy(self):
        """The served policy's prefix cache (in the worker process, if one serves): it still holds the rollouts'
        contexts when the trainer scores their states (before the update), so those states are probed off it
        (:func:`~mosaic.train.served_scoring.known_from_cache`)."""
        return self.server.worker.prefix_cache

    def __init__(self, cfg, model, tokenizer, split, records_dir: str | os.PathLike, *, model_name: str = "mosaic-policy"):
        from mosaic.agent.server.app import create_app
        from mosaic.agent.server.procworker import decodes_in
        from mosaic.capture.proxy import ProxyConfig, create_proxy_app
        from mosaic.serving import ServerThread

        self.cfg = cfg
        self.rc = cfg.rollout
        self.hcfg: HarnessConfig = cfg.harness
        self.env = make_env(split)
        self.service = hasattr(self.env, "finish")  # the service family: a backend per rollout, its own reward
        self.model_name = model_name
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
        self.rules = reconstruction_rules(self.hcfg, tokenizer)
        app = create_app(model, tokenizer, model_name=model_name, device=str(next(model.parameters()).device),
                         max_batch_size=self.rc.batch_size, default_max_tokens=self.hcfg.max_new_tokens,
                         worker_process=self.rc.worker_process)
        self.server = app.state.server
        print("[mosaic] harness rollouts: the served model decodes in "
              f"{decodes_in(self.server.worker, self.server.worker_fallback)}", file=sys.stderr, flush=True)
        self.server_thread = ServerThread(app).start()
        pcfg = ProxyConfig(upstream=self.server_thread.url, out_dir=str(self.records_dir), port=0,
                           timeout_s=max(30.0, self.rc.deadline_s + 30.0))
        proxy_app = create_proxy_app(pcfg, tokenizer=tokenizer, accept_rollout=self._accept,
                                     force_params={"temperature": self.rc.temperature, "top_p": self.rc.top_p},
                                     upstream_app=app)  # whole calls reach the served app without a socket
        self.proxy = proxy_app.state.proxy  # the RecordingProxy: records and quiet waits go through its methods
        self._add_tool_route(proxy_app)
        self.proxy_thread = ServerThread(proxy_app).start()
        self.url = self.proxy_thread.url
        self.last_drop_examples: dict[str, str] = {}

    # ------------------------------------------------------------------ server side
    def _accept(self, rollout_id: str, what: str) -> bool:
        ok = rollout_id in self.live
        if not ok:
            self.foreign[what] += 1
        return ok

    def _tool(self, rollout_id: str, name: str, arguments: Any) -> str:
        if self.service:  # the account tools of this rollout's backend (a ToolError is a ValueError: a 400)
            if not isinstance(name, str):
                raise ValueError(f"no tool named {name!r}; this environment has: {', '.join(self.env.tool_names)}")
            return self.env.call(rollout_id, name, arguments)
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
    def _revive(self, step: int) -> bool:
        """Replace a worker process that died since the last step (True), saying so on the console."""
        if not self.server.revive_worker():
            return False
        fb = self.server.worker_fallback
        print(f"[mosaic] step {step + 1}: the served model's worker process had died; "
              + ("a new one serves" if fb is None else f"a new one did not start ({fb}): a thread serves"),
              file=sys.stderr, flush=True)
        return True

    def _task(self, task, step: int, k: int) -> HarnessTask:
        rid = f"s{step}-{self.run_nonce}-{task.id}-{k}"
        base = f"{self.url}/rollouts/{rid}"
        return HarnessTask(rollout_id=rid, base_url=base + "/v1", model=self.model_name, question=task.question,
                           task_id=task.id, group_id=task.id, sample=k, deadline=0.0, tools_url=base + "/tools",
                           reward_url=base + "/reward", harness=self.hcfg,
                           tools=lambda name, args, rid=rid: self._tool(rid, name, args))

    def _read_new(self, offset: int) -> tuple[list[CallRecord], list[RewardRecord], int, int]:
        """Records appended since ``offset`` → calls, rewards, the new offset and the number of bad lines.
        A record with a bad field (checked as every reader does) puts its rollout in ``self.bad_records``."""
        self.bad_records: dict[str, str] = {}
        if not self.records_path.exists():
            return [], [], offset, 0
        with open(self.records_path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line still being written stays for the next read
        calls, rewards, bad = [], [], 0
        for n, line in enumerate(data[:end].splitlines()):
            if not line.strip():
                continue
            d = None
            try:
                d = json.loads(line)
                rec = parse_record(d, f"{self.records_path} (line {n + 1} after byte {offset})")
            except (ValueError, RecordError, RecursionError) as exc:
                bad += 1
                rid = d.get("rollout_id") if isinstance(d, dict) else None
                if isinstance(rid, str):
                    self.bad_records.setdefault(rid, str(exc)[:500])
                continue
            (calls if isinstance(rec, CallRecord) else rewards).append(rec)
        return calls, rewards, offset + end, bad

    def _reward(self, task, out: Outcome, posted: list[RewardRecord], rollout_id: str = "") -> tuple[float | None, str | None]:
        """(reward, answer) of a rollout that ended, or (None, reason) when it has none."""
        answer = out.answer
        if answer is None and posted and posted[-1].answer is not None:
            answer = posted[-1].answer
        if self.service and self.rc.reward == "deepsearch":  # (the default: the family's own reward)
            text = None if answer is None else answer if "<answer>" in answer else f"<answer>{answer}</answer>"
            outcome = self.env.finish(rollout_id, text).to_dict()
            self.outcomes[rollout_id] = outcome
            return float(outcome["reward"]), outcome.get("answer") or answer
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

    def _judge(self, task, ht: HarnessTask, out: Outcome, mine: list[CallRecord], posted: list[RewardRecord],
               version: int, step: int) -> tuple[Trajectory | None, str | None, str]:
        """One ended rollout → its trajectory, or why it is dropped (reason, detail)."""
        reason, detail = out.failure, out.detail
        if reason is None and ht.rollout_id in self.bad_records:  # a call or reward would be missing
            reason, detail = "bad_record", self.bad_records[ht.rollout_id]
        if reason is None and len(posted) > 1:
            reason, detail = "double_reward", f"{len(posted)} rewards posted"
        if reason is None and not any(c.ok for c in mine):
            reason = "foreign_id" if sum(self.foreign.values()) else "no_calls"
            detail = f"{len(mine)} call(s), none answered" if mine else "no model call on its rollout URL"
        if reason is None and any(c.ok and c.policy_version != version for c in mine):
            reason = "stale_policy"
            detail = f"answered by {sorted({c.policy_version for c in mine} - {version})}, step uses {version}"
        if reason is not None:
            return None, reason, detail
        try:
            reward, answer = self._reward(task, out, posted, ht.rollout_id)
        except Exception as exc:  # noqa: BLE001 - a reward function that fails drops its rollout
            return None, "no_reward", f"rollout.reward failed: {type(exc).__name__}: {exc}"[:500]
        if reward is None:
            return None, "no_reward", "the harness posted no reward"
        rec = RewardRecord(rollout_id=ht.rollout_id, reward=reward, ground_truth=task.answer, answer=answer,
                           task_id=task.id, group_id=task.id, t=time.time(),
                           meta={"by": _TRAINER, "step": step, "policy_version": version})
        try:
            traj = reconstruct_rollout(mine, rec, self.rules, rollout_id=ht.rollout_id)
        except (TraceError, ValueError, KeyError, IndexError) as exc:
            return None, "unbuildable", f"{type(exc).__name__}: {exc}"[:500]
        why = "no usable call" if traj is None else unscorable(traj)
        if why is not None:
            return None, "unbuildable", why
        if ht.rollout_id in self.outcomes:  # (in the reward record too: a replay of the records restores it)
            traj.meta["env"] = rec.meta["env"] = self.outcomes.pop(ht.rollout_id)
        self.proxy.record(rec)
        traj.meta["harness"] = {"policy_version": version, "sample": ht.sample}
        return traj, None, ""

    def _report_drops(self, drops: list[dict], step: int, launched: int, kept: int) -> Counter:
        """Why each rollout was dropped: RUN_DIR/drops.jsonl, and one example per reason on the console."""
        dropped = Counter(d["reason"] for d in drops)
        self.last_drop_examples = {}
        for d in drops:
            self.last_drop_examples.setdefault(d["reason"], f"{d['rollout_id']}: {d['detail']}")
        if drops:
            with open(self.drops_path, "a") as f:
                f.writelines(json.dumps(d) + "\n" for d in drops)
            head = "every rollout" if not kept else f"{len(drops)} of {launched} rollouts"
            print(f"[mosaic] step {step + 1}: {head} dropped ({', '.join(f'{r} {n}' for r, n in dropped.items())}; "
                  f"{self.drops_path})" + "".join(f"\n  {r}: {e}" for r, e in self.last_drop_examples.items())
                  + ("\n  nothing to train on in this step" if not kept else ""), file=sys.stderr, flush=True)
        return dropped

    def collect(self, tasks: Sequence, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Run the harness on every task × ``train.group_size`` samples; the step's trajectories and metrics."""
        G = self.cfg.train.group_size
        pairs = [(t, self._task(t, step, k)) for t in tasks for k in range(G)]
        offset = self.records_path.stat().st_size if self.records_path.exists() else 0
        self.foreign.clear()
        version = self.policy_version
        step_ids = {ht.rollout_id for _, ht in pairs}
        self.live = step_ids
        self.outcomes: dict[str, dict] = {}
        if self.service:  # a fresh account backend per rollout, before its harness starts
            for task, ht in pairs:
                self.env.open(ht.rollout_id, task)
        revived = self._revive(step)
        served0 = dict(self.server.worker.stats)
        t0 = time.perf_counter()
        try:
            outcomes = asyncio.run(launch_all([ht for _, ht in pairs], fn=self.harness_fn, command=self.harness_spec,
                                              concurrency=self.rc.concurrency, deadline_s=self.rc.deadline_s))
        finally:
            self.live = set()  # late calls of a timed-out harness are refused from here on
        self.proxy.wait_quiet(timeout=10.0)  # a streamed call's record lands after its last byte
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
        for (task, ht), out in zip(pairs, outcomes):
            traj, reason, detail = self._judge(task, ht, out, by_calls.get(ht.rollout_id, []),
                                               posted.get(ht.rollout_id, []), version, step)
            if traj is None:
                drops.append({"step": step + 1, "rollout_id": ht.rollout_id, "task_id": task.id, "reason": reason,
                              "detail": detail})
            else:
                trajs.append(traj)
        if self.service:  # the backends of dropped rollouts (and of rewards the harness posted) are freed
            for rid in step_ids & set(self.env.rollouts):
                self.env.finish(rid, None)
        dropped = self._report_drops(drops, step, len(pairs), len(trajs))
        m: dict[str, float] = {f"rollout/dropped/{r}": float(dropped.get(r, 0)) for r in DROP_REASONS}
        m.update({"rollout/dropped": float(sum(dropped.values())), "rollout/launched": float(len(pairs)),
                  "rollout/kept": float(len(trajs)), "rollout/foreign_requests": float(sum(self.foreign.values())),
                  "rollout/bad_record_lines": float(bad),
                  "rollout/calls": float(sum(len(by_calls.get(ht.rollout_id, [])) for _, ht in pairs)),
                  "timing_s/harness": wall, "rollout/worker_restarts": float(revived)})
        served = {k: self.server.worker.stats[k] - served0.get(k, 0) for k in ("batches", "sequences")}
        # the served policy's decode batches this step: how many sequences each batch held on average
        m.update({"rollout/served_batches": float(served["batches"]),
                  "rollout/served_batch_mean": served["sequences"] / max(1, served["batches"])})
        return trajs, m
