"""The multi-session agent loop as a verl agent loop: our harness, verl's rollout servers.

``mosaic_agent`` (registered with ``verl.experimental.agent_loop.register``) runs one trajectory of
:class:`mosaic.agent.harness.Harness` — compaction, forks, caps, tool calls — for one dataset row,
sampling every turn through verl's async server manager (token ids in, token ids out: the harness
owns the contexts; the server never re-tokenises them). It returns **one ``AgentLoopOutput`` per
session**, the final main session last (verl's v1 trainer reads the last output's reward and keys
the outputs ``{uid}_{session_id}_{index}``), each with the session's exact ``prompt_ids``,
``response_ids`` (= the session's completion: sampled and inserted tokens), ``response_mask``
(= our ``loss_mask``), sampling log-probs, and the graph metadata as ``extra_fields``
(:data:`mosaic.integrations.verl.rows.COLUMNS`, plus the session id, parent and edge).

**Session gains: scored on the rollout servers** (docs/algorithm.md §4.4), not in the actor's log-prob pass.
Each state + answer probe is one request with ``max_tokens=1`` and ``prompt_logprobs=0``; vLLM
returns the prompt tokens' log-probs (verl's server puts them in ``extra_fields["prompt_logprobs"]``,
the path its distillation teacher uses). Why here: the states are prefixes of contexts the server
has just served, so its prefix cache turns each probe into a few dozen new tokens; the probes run
while other trajectories still roll out, instead of adding padded rows (every state of every
session) to the actor's synchronous log-prob pass; and the trainer receives gains as plain row
fields, so the actor workers stay unmodified. The price: the probe uses the rollout engine's
numerics (bf16 vLLM kernels), which differ slightly from the actor's — the same policy the samples
came from, which is what docs/algorithm.md §4.4 asks for ("score with the rollout policy"). Seconds spent on
probes and on sampling are returned per trajectory (``mosaic_probe_seconds``,
``mosaic_rollout_seconds``) so their share of a step can be measured.

Configuration: a top-level ``mosaic`` block in verl's config (Hydra ``+mosaic.harness.mode=compaction``):
``mosaic.harness.*`` are :class:`~mosaic.config.harness.HarnessConfig` fields; ``mosaic.gains``
(default true) turns probe scoring off for the estimators that do not read gains (broadcast);
``mosaic.downstream`` (default false) also scores each session's downstream credit (docs/algorithm.md §4.10:
the final state and one ablation per session whose output it holds), which ``mosaic-dag`` reads.
``algo.gain_reference=group`` has no verl form: one agent-loop run sees one trajectory, not its group.
Each row needs ``extra_info.tools_kwargs.split_config`` (written by ``mosaic data export``) to rebuild
its world and search index (the split is built once per process and cached), or, for a service-family row
(``mosaic data export data.family=service``), ``tools_kwargs.service_config``: the episode is regenerated
from it and played on a fresh account backend; its stale actions and visits land in the final row's
``reward_extra_info`` (``env_stale_actions``, ``env_actions``, ``env_visits_correct``, ...).
Reset mode's second role (``harness.partner``) may be played by the policy being trained (``self``) or by the
scripted expert (``expert``, deep search only: its sessions stay in the outputs with response mask 0, so only
the trained role's tokens train); ``frozen`` is refused here (verl serves one set of weights).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from mosaic.agent.chat import ChatFormat
from mosaic.config.harness import HarnessConfig
from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.agent.policy import GenRequest, GenResult
from mosaic.envs.export import row_to_task, split_config_from_json
from mosaic.envs.splits import Split, load_split
from mosaic.integrations.verl import AGENT_NAME
from mosaic.trace.graph import Trajectory
from mosaic.train.downstream import downstream_from_logprobs
from mosaic.train.setup import partner_for

__all__ = ["MosaicAgentLoop", "ServerPolicy", "score_session_gains", "session_outputs"]

LogprobFn = Callable[[list[int]], Awaitable[list[float]]]
"""``ids -> (len(ids),)`` log-prob of each token given the ones before it (entry 0 unused)."""


class ServerPolicy:
    """A :class:`~mosaic.agent.policy.Policy` over verl's async server manager.

    The harness is synchronous and runs in a worker thread; each ``generate`` call submits one
    coroutine per request to the agent loop's event loop and waits for all of them, so the
    requests of a step run concurrently on the servers. ``request_id`` is stable per session
    (sticky routing: a session's turns hit the same server and its prefix cache).
    """

    def __init__(self, server_manager, loop: asyncio.AbstractEventLoop, sampling_params: dict[str, Any], *,
                 traj_key: str, end_ids: Sequence[int]):  # fmt: skip
        self.server_manager = server_manager
        self.loop = loop
        self.sampling_params = dict(sampling_params)
        self.traj_key = traj_key
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.seconds = 0.0
        self.weight_steps: list[int] = []  # the servers' weight versions (global steps) seen, for verl's staleness metrics

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # waiting here would deadlock the loop the requests need
            raise RuntimeError("ServerPolicy.generate must run off the event loop's thread (asyncio.to_thread)")
        t0 = time.perf_counter()
        futures = [asyncio.run_coroutine_threadsafe(self._one(r), self.loop) for r in requests]
        out = [f.result() for f in futures]
        self.seconds += time.perf_counter() - t0
        return out

    async def _one(self, req: GenRequest) -> GenResult:
        params = {**self.sampling_params, "max_tokens": int(req.max_new_tokens)}
        try:
            res = await self.server_manager.generate(request_id=f"{self.traj_key}/{req.session_key}",
                                                     prompt_ids=list(req.prompt_ids), sampling_params=params)
        except Exception as exc:  # noqa: BLE001 - a failed call is an errored record (docs/algorithm.md §2)
            return GenResult([], [], "error", error=f"rollout server: {type(exc).__name__}: {exc}")
        if res.stop_reason == "aborted":
            return GenResult([], [], "error", error="rollout server aborted the request")
        for key in ("min_global_steps", "max_global_steps"):
            if res.extra_fields.get(key) is not None:
                self.weight_steps.append(int(res.extra_fields[key]))
        ids = [int(t) for t in res.token_ids][: req.max_new_tokens]
        lps = [float(x) for x in res.log_probs][: len(ids)] if res.log_probs is not None else [0.0] * len(ids)
        finish = "stop" if ids and ids[-1] in self.end_ids else "length"
        return GenResult(ids, lps, finish)

    def release(self, session_key: str) -> None:  # the servers' prefix caches manage themselves
        return None


def _state_tokens(traj: Trajectory, key: tuple) -> list[int]:
    if key[0] == "state":
        return list(traj.states[key[1]])
    return traj.sessions[key[1]].tokens()[: key[2]]


async def score_session_gains(traj: Trajectory, probe: tuple[list[int], tuple[int, int]],
                              logprob_fn: LogprobFn) -> list[float]:  # fmt: skip
    """(S,) gains ``L(after) - L(before)`` of ``traj``'s sessions (NaN for the final one), docs/algorithm.md §4.4.

    ``probe``: ``(suffix_ids, (start, end))`` from :meth:`ChatFormat.answer_probe`; ``L(c)`` is the mean
    log-prob of ``suffix_ids[start:end]`` after ``c + suffix_ids[:start]``. Each distinct state is
    scored once (consecutive sessions share states); all states are requested concurrently.
    """
    suffix, (a, b) = probe
    keys: dict[tuple, None] = {}
    for s in traj.sessions:
        if not s.is_final:
            if s.state_before is None or s.state_after is None:
                raise ValueError(f"trajectory {traj.id!r} session {s.id}: a non-final session needs both states")
            keys[traj.state_key(s.state_before)] = None
            keys[traj.state_key(s.state_after)] = None

    async def loglik(key: tuple) -> float:
        ctx = _state_tokens(traj, key)
        ids = ctx + list(suffix)
        lp = await logprob_fn(ids)
        if len(lp) != len(ids):
            raise ValueError(f"logprob_fn returned {len(lp)} values for {len(ids)} tokens")
        span = lp[len(ctx) + a : len(ctx) + b]
        return float(sum(span) / len(span))

    order = list(keys)
    values = dict(zip(order, await asyncio.gather(*(loglik(k) for k in order)), strict=True))
    return [math.nan if s.is_final else values[traj.state_key(s.state_after)] - values[traj.state_key(s.state_before)]
            for s in traj.sessions]  # fmt: skip


def server_logprob_fn(server_manager) -> LogprobFn:
    """Prompt log-probs from verl's rollout server (vLLM ``prompt_logprobs=0``; one forward, one sampled token)."""

    async def fn(ids: list[int]) -> list[float]:
        res = await server_manager.generate(request_id=uuid.uuid4().hex, prompt_ids=list(ids), sampling_params={
            "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False})  # fmt: skip
        rows = res.extra_fields.get("prompt_logprobs")
        if rows is None:
            raise RuntimeError("the rollout server returned no prompt_logprobs (needs verl's vLLM server; "
                               "set mosaic.gains=false for estimators without gains)")  # fmt: skip
        # verl drops token 0's (None) entry and pads one dummy at the end: rows[j-1] is token j's.
        return [0.0] + [float(r[0]) for r in rows[: len(ids) - 1]]

    return fn


def session_outputs(traj: Trajectory, gains: Sequence[float] | None, *, with_logprobs: bool,
                    metrics: AgentLoopMetrics, extra: dict[str, Any] | None = None,
                    downstream: Sequence[float] | None = None) -> list[AgentLoopOutput]:  # fmt: skip
    """One ``AgentLoopOutput`` per session of ``traj`` (final main session last), tokens copied exactly;
    ``downstream`` (S,): the sessions' downstream credit (``mosaic_downstream``, NaN when not scored)."""
    order = [s for s in traj.sessions if not s.is_final] + [s for s in traj.sessions if s.is_final]
    n = len(traj.sessions)
    outs = []
    for s in order:
        fields = {
            "mosaic_traj": traj.id, "mosaic_kind": s.kind, "mosaic_final": bool(s.is_final), "mosaic_sessions": n,
            "mosaic_gain": float("nan") if gains is None else float(gains[s.id]), "mosaic_session_id": s.id,
            "mosaic_downstream": float("nan") if downstream is None else float(downstream[s.id]),
            "mosaic_parent": -1 if s.parent is None else int(s.parent), "mosaic_edge": s.edge or "",
            **(extra or {}),
        }  # fmt: skip
        if s.is_final:
            fields["reward_extra_info"] = {"acc": float(traj.reward), "mosaic_sessions": float(n),
                                           "answered": float(traj.answer is not None)}  # fmt: skip
            env = traj.meta.get("env")
            if isinstance(env, dict):  # the service family's outcome: stale actions and visits, per trajectory
                fields["reward_extra_info"].update(
                    {f"env_{k}": float(env[k]) for k in ("stale_actions", "actions", "visits_correct", "visits",
                                                          "state_match", "answer_correct", "tool_errors")
                     if isinstance(env.get(k), (int, float))})
        outs.append(AgentLoopOutput(
            prompt_ids=list(s.prompt_ids), response_ids=list(s.completion_ids),
            response_mask=[int(bool(m)) for m in s.loss_mask],
            response_logprobs=[float(x) for x in s.logprobs] if with_logprobs else None,
            reward_score=float(traj.reward) if s.is_final else None, num_turns=2 * s.num_turns + 1,
            metrics=metrics, extra_fields=fields,
        ))  # fmt: skip
    return outs


@register(AGENT_NAME)
class MosaicAgentLoop(AgentLoopBase):
    """verl agent loop running the Mosaic harness; see the module docstring."""

    _splits: dict[str, Split] = {}
    _chats: dict[int, ChatFormat] = {}
    _lock = threading.Lock()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        block = self.config.get("mosaic") or {}
        self.harness_config = HarnessConfig(**dict(block.get("harness") or {}))
        if self.harness_config.partner == "frozen":  # verl's servers hold the trained weights only
            raise ValueError("harness.partner='frozen' is not supported in verl: its rollout servers hold the weights "
                             "being trained, and a frozen partner needs a second copy served beside them; use "
                             "harness.partner=self or expert here (mosaic train and the TRL path play a frozen one)")
        self.score_gains = bool(block.get("gains", True))
        self.score_downstream = bool(block.get("downstream", False))
        if self.score_downstream and not self.score_gains:
            raise ValueError("mosaic.downstream=true needs mosaic.gains=true (the credit is shared by immediate gain)")
        with self._lock:
            if id(self.tokenizer) not in self._chats:
                self._chats[id(self.tokenizer)] = ChatFormat(self.tokenizer)
        self.chat = self._chats[id(self.tokenizer)]

    def _split(self, config_json: str) -> Split:
        with self._lock:
            if config_json not in self._splits:
                cfg = split_config_from_json(config_json)
                self._splits[config_json] = load_split(cfg.split, cfg)
            return self._splits[config_json]

    def _task_env(self, row: dict, tools_kwargs: dict):
        """The row's task and a fresh environment for it: a service episode (regenerated from the row's
        ``service_config``) and its account backend, or a deep-search question and its split's index."""
        from mosaic.envs.service.export import DATA_SOURCE as SERVICE_SOURCE

        if row.get("data_source") == SERVICE_SOURCE or row["extra_info"].get("family") == "service" \
                or tools_kwargs.get("service_config"):
            from mosaic.envs.service import ServiceEnv
            from mosaic.envs.service.export import row_episode

            episode, _ = row_episode({**row, "extra_info": {**row["extra_info"], "tools_kwargs": tools_kwargs}})
            return episode, ServiceEnv([episode])  # one backend per rollout: no state shared across threads
        return row_to_task(row), DeepSearchEnv(self._split(tools_kwargs.get("split_config", "")))

    def _partner(self, task, env):
        """Reset mode's scripted partner over this rollout's task (``harness.partner=expert``), else None."""
        if self.harness_config.partner != "expert":
            return None
        if not isinstance(env, DeepSearchEnv):
            raise ValueError("harness.partner='expert': the scripted partner plays deep search only, not this "
                             "service-family row; use harness.partner=self")
        return partner_for("expert", self.tokenizer, [task])

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[AgentLoopOutput]:
        extra_info = kwargs["extra_info"]
        tools_kwargs = kwargs.get("tools_kwargs") or extra_info.get("tools_kwargs") or {}
        row = {"reward_model": kwargs["reward_model"], "extra_info": extra_info, "data_source": kwargs.get("data_source")}
        task, env = await asyncio.to_thread(self._task_env, row, tools_kwargs)
        traj_key = f"{kwargs.get('uid', uuid.uuid4().hex)}_{kwargs.get('session_id', 0)}"
        loop = asyncio.get_running_loop()
        policy = ServerPolicy(self.server_manager, loop, sampling_params, traj_key=traj_key,
                              end_ids=[self.chat.im_end_id, *([self.tokenizer.eos_token_id]
                                                              if self.tokenizer.eos_token_id is not None else [])])  # fmt: skip
        harness = Harness(policy, self.chat, env, self.harness_config, partner=self._partner(task, env))
        (traj,) = await asyncio.to_thread(harness.run, [task], 1)
        traj.id = traj_key  # verl's own trajectory key, so our rows and its keys agree
        t0 = time.perf_counter()
        gains = None
        if self.score_gains:
            gains = await score_session_gains(traj, self.chat.answer_probe(traj.ground_truth),
                                              server_logprob_fn(self.server_manager))  # fmt: skip
        downstream = None
        if self.score_downstream:
            downstream = await downstream_from_logprobs(
                traj, self.chat.answer_probe(traj.ground_truth), server_logprob_fn(self.server_manager),
                [0.0 if math.isnan(g) else g for g in gains], empty_result_ids=self.chat.tool_delta(""),
                header_ids=self.chat.generation_header_ids)  # fmt: skip
        probe_s = time.perf_counter() - t0
        metrics = AgentLoopMetrics(generate_sequences=policy.seconds, tool_calls=0.0)
        extra = {"mosaic_probe_seconds": probe_s, "mosaic_rollout_seconds": policy.seconds}
        if policy.weight_steps:  # verl's v1 trainer reads the weight versions a trajectory was sampled with
            extra.update(min_global_steps=min(policy.weight_steps), max_global_steps=max(policy.weight_steps))
        return session_outputs(traj, gains, with_logprobs=bool(self.rollout_config.get("calculate_log_probs", False)),
                               metrics=metrics, downstream=downstream, extra=extra)  # fmt: skip
