"""The ``mosaic_agent`` loop driven by a scripted server manager with verl's real types (runs in .venv-verl).

The scripted server answers from the decoded prompt (search twice, compact when asked, answer after
a compaction) and returns ``verl.workers.rollout.replica.TokenOutput``s; prompt log-probs for the
gain probes are a deterministic function of the prefix. The same script run as a plain harness
policy gives the reference trajectory: the loop's outputs must carry its sessions token for token.
"""

from __future__ import annotations

import asyncio
import json
import math

import hydra
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig
from mosaic.agent.models.corpus import build_project_tokenizer
from mosaic.agent.policy import GenResult
from mosaic.envs.export import task_to_row
from mosaic.envs.splits import load_split, split_config
from mosaic.integrations.verl.agent_loop import MosaicAgentLoop

HARNESS = {"mode": "compaction", "context_budget": 260, "max_new_tokens": 40, "summary_max_new_tokens": 40,
           "max_sessions": 4}  # fmt: skip


def fake_logprob(prefix_sum: int, token: int) -> float:
    return -((prefix_sum * 31 + token * 7) % 997) / 400.0


class ScriptedServer:
    """Stands in for verl's ``LLMServerClient``: ``await generate(request_id, prompt_ids=, sampling_params=)``."""

    def __init__(self, tokenizer, answer: str):
        self.tok = tokenizer
        self.answer = answer
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[tuple[str, list[int], dict]] = []
        self.turns = 0

    def reply(self, prompt_ids: list[int]) -> str:
        text = self.tok.decode(prompt_ids)
        last_user = text.rsplit("<|im_start|>user", 1)[-1]
        if "context is full" in last_user:
            return "Found the first entity. Next: search its second relation."
        if "notes so far" in text.rsplit("<|im_start|>system", 1)[-1]:
            return f"<answer>{self.answer}</answer>"
        n_calls = text.rsplit("<|im_start|>system", 1)[-1].count("<tool_call>")
        return '<tool_call>{"name": "search", "arguments": {"query": "q%d"}}</tool_call>' % n_calls

    def sample(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        ids = list(self.tok(self.reply(prompt_ids), add_special_tokens=False)["input_ids"]) + [self.im_end]
        return ids[:max_tokens]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        self.requests.append((request_id, list(prompt_ids), dict(sampling_params)))
        await asyncio.sleep(0)
        if "prompt_logprobs" in sampling_params:
            lps = [[fake_logprob(sum(prompt_ids[:j]), prompt_ids[j])] for j in range(1, len(prompt_ids))]
            return TokenOutput(token_ids=[0], log_probs=[0.0], stop_reason="completed",
                               extra_fields={"prompt_logprobs": lps + [[0.0]]})  # fmt: skip
        ids = self.sample(prompt_ids, int(sampling_params["max_tokens"]))
        self.turns += 1  # the weight version moves on mid-trajectory: verl's staleness span 4..5
        steps = {"min_global_steps": 4 + (self.turns > 2), "max_global_steps": 4 + (self.turns > 2)}
        return TokenOutput(token_ids=ids, log_probs=[-0.25] * len(ids), stop_reason="completed", extra_fields=steps)


class ScriptPolicy:
    """The same script as a synchronous harness policy (the reference run)."""

    def __init__(self, server: ScriptedServer):
        self.server = server

    def generate(self, requests):
        out = []
        for r in requests:
            ids = self.server.sample(r.prompt_ids, r.max_new_tokens)
            out.append(GenResult(ids, [-0.25] * len(ids), "stop" if ids[-1] == self.server.im_end else "length"))
        return out

    def release(self, key):
        pass


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return load_split("validation", split_config("validation", "cpu"), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(split):
    return build_project_tokenizer([split])


def _loop(tokenizer, server, *, gains=True, logprobs=True, downstream=False, harness=None) -> MosaicAgentLoop:
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"calculate_log_probs": logprobs, "prompt_length": 4096,
                                          "response_length": 4096}},
        "data": {}, "mosaic": {"harness": harness or HARNESS, "gains": gains, "downstream": downstream},
    })  # fmt: skip
    return hydra.utils.instantiate(_agent_loop_registry["mosaic_agent"], trainer_config=DictConfigWrap(config),
                                   server_manager=server, tokenizer=tokenizer, processor=None, hf_model_type=None,
                                   dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data),
                                   tools=ToolListWrap([]))  # fmt: skip


def _kwargs(split, task) -> dict:
    row = task_to_row(task, 0, split.config)
    return {"raw_prompt": row["prompt"], "extra_info": row["extra_info"], "reward_model": row["reward_model"],
            "tools_kwargs": row["extra_info"]["tools_kwargs"], "agent_name": "mosaic_agent", "uid": "u1",
            "session_id": 3, "data_source": row["data_source"]}  # fmt: skip


def test_one_output_per_session_with_the_harness_tokens_and_graph(split, tokenizer):
    task = split.tasks[0]
    server = ScriptedServer(tokenizer, task.answer)
    outs = asyncio.run(_loop(tokenizer, server).run({"temperature": 1.0}, **_kwargs(split, task)))

    ref = Harness(ScriptPolicy(ScriptedServer(tokenizer, task.answer)), ChatFormat(tokenizer), DeepSearchEnv(split),
                  HarnessConfig(**HARNESS)).run([task], 1)[0]  # fmt: skip
    kinds = [s.kind for s in ref.sessions]
    assert "compaction" in kinds and ref.reward == 1.0  # the script compacted once, then answered
    assert all(isinstance(o, AgentLoopOutput) for o in outs) and len(outs) == len(ref.sessions)
    assert outs[-1].extra_fields["mosaic_final"] and not any(o.extra_fields["mosaic_final"] for o in outs[:-1])
    by_id = {o.extra_fields["mosaic_session_id"]: o for o in outs}
    for s in ref.sessions:
        o = by_id[s.id]
        assert o.prompt_ids == s.prompt_ids and o.response_ids == s.completion_ids
        assert o.response_mask == [int(m) for m in s.loss_mask]
        assert o.response_logprobs == pytest.approx(s.logprobs)
        f = o.extra_fields
        assert (f["mosaic_kind"], f["mosaic_final"], f["mosaic_sessions"]) == (s.kind, s.is_final, len(ref.sessions))
        assert f["mosaic_parent"] == (-1 if s.parent is None else s.parent) and f["mosaic_edge"] == (s.edge or "")
        assert f["mosaic_traj"] == "u1_3"  # verl's own trajectory key {uid}_{session_id}
    assert outs[-1].reward_score == 1.0 and outs[-1].extra_fields["reward_extra_info"]["acc"] == 1.0
    assert all(o.reward_score is None for o in outs[:-1])  # verl copies the final reward to the others
    # the weight versions the trajectory was sampled with, which verl's v1 trainer reads on every row
    assert all((o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) == (4, 5) for o in outs)

    # every turn went through the server manager, sticky per session
    turns = [r for r in server.requests if "prompt_logprobs" not in r[2]]
    assert len(turns) == sum(s.num_turns for s in ref.sessions)
    assert all(r[0].startswith("u1_3/") for r in turns)


def test_gains_are_scored_on_the_server_once_per_distinct_state(split, tokenizer):
    task = split.tasks[1]
    server = ScriptedServer(tokenizer, task.answer)
    outs = asyncio.run(_loop(tokenizer, server).run({"temperature": 1.0}, **_kwargs(split, task)))
    probes = [r for r in server.requests if "prompt_logprobs" in r[2]]
    live = [o for o in outs if not o.extra_fields["mosaic_final"]]
    assert live and all(math.isfinite(o.extra_fields["mosaic_gain"]) for o in live)
    assert math.isnan(outs[-1].extra_fields["mosaic_gain"])
    # a chain of k compactions (2k non-final sessions) has 2k + 1 distinct states (docs/algorithm.md §4.4)
    n_comp = sum(o.extra_fields["mosaic_kind"] == "compaction" for o in outs)
    assert len(probes) == 2 * n_comp + 1
    assert all(r[2]["max_tokens"] == 1 and r[2]["prompt_logprobs"] == 0 for r in probes)

    # one gain by hand: L(after) - L(before) from the probe's answer span
    chat = ChatFormat(tokenizer)
    suffix, (a, b) = chat.answer_probe(task.answer)
    first = min(live, key=lambda o: o.extra_fields["mosaic_session_id"])
    before = first.prompt_ids[: len(first.prompt_ids) - len(chat.generation_header_ids)]
    after = first.prompt_ids + first.response_ids

    def L(ctx):
        ids = ctx + suffix
        return float(np.mean([fake_logprob(sum(ids[:j]), ids[j]) for j in range(len(ctx) + a, len(ctx) + b)]))

    assert first.extra_fields["mosaic_gain"] == pytest.approx(L(after) - L(before), abs=1e-9)


def test_downstream_credit_is_scored_on_the_server_for_mosaic_dag(split, tokenizer):
    """``mosaic.downstream=true`` (issue 32): two more server requests per trajectory with a compaction (the
    final state, and the final state with the last summary replaced by the bare task); the rows carry
    ``mosaic_downstream``, which the mosaic-dag estimator reads."""
    from mosaic.integrations.verl.rows import advantage_batch_from_rows

    task = split.tasks[1]
    plain_server, server = ScriptedServer(tokenizer, task.answer), ScriptedServer(tokenizer, task.answer)
    plain = asyncio.run(_loop(tokenizer, plain_server).run({"temperature": 1.0}, **_kwargs(split, task)))
    outs = asyncio.run(_loop(tokenizer, server, downstream=True).run({"temperature": 1.0}, **_kwargs(split, task)))
    n_probe = [sum("prompt_logprobs" in r[2] for r in sv.requests) for sv in (plain_server, server)]
    assert sum(o.extra_fields["mosaic_kind"] == "compaction" for o in outs) >= 1
    assert n_probe[1] == n_probe[0] + 2
    live = [o for o in outs if not o.extra_fields["mosaic_final"]]
    assert all(math.isfinite(o.extra_fields["mosaic_downstream"]) for o in live)
    assert all(math.isnan(o.extra_fields["mosaic_downstream"]) for o in plain)
    cols = {k: [o.extra_fields[k] for o in outs] for k in ("mosaic_traj", "mosaic_kind", "mosaic_final",
                                                            "mosaic_sessions", "mosaic_gain", "mosaic_downstream")}
    batch = advantage_batch_from_rows(np.array([o.reward_score or 0.0 for o in outs]), ["u1"] * len(outs), cols)
    assert batch.downstream is not None and float(batch.downstream.abs().sum()) > 0


def test_broadcast_twin_skips_probes_and_logprobs_when_off(split, tokenizer):
    task = split.tasks[0]
    server = ScriptedServer(tokenizer, task.answer)
    outs = asyncio.run(_loop(tokenizer, server, gains=False, logprobs=False).run({}, **_kwargs(split, task)))
    assert not [r for r in server.requests if "prompt_logprobs" in r[2]]
    assert all(math.isnan(o.extra_fields["mosaic_gain"]) and o.response_logprobs is None for o in outs)


def test_exported_parquet_loads_with_verls_dataset_and_chat_template(split, tokenizer, tmp_path):
    from mosaic.envs.export import export_parquet

    path = export_parquet(split.tasks[:4], tmp_path / "val.parquet", split_config=split.config)
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 4096, "filter_overlong_prompts": False,
                            "return_raw_chat": True, "truncation": "error"})  # fmt: skip
    ds = RLHFDataset(data_files=str(path), tokenizer=tokenizer, config=cfg)
    assert len(ds) == 4
    item = ds[2]
    assert item["agent_name"] == "mosaic_agent"
    assert json.loads(item["tools_kwargs"]["split_config"])["split"] == "validation"
    assert item["raw_prompt"][1]["content"] == split.tasks[2].question
    ids = tokenizer.apply_chat_template(list(item["raw_prompt"]), add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert split.tasks[2].question in tokenizer.decode(ids)


class ServiceExpertServer(ScriptedServer):
    """The revalidating service expert behind verl's server interface: a compaction request (the harness's
    compaction prompt is the last user message) gets the expert's progress summary."""

    def __init__(self, tokenizer, episode):
        from mosaic.agent.service_expert import ServiceExpertPolicy

        super().__init__(tokenizer, episode.answer)
        self.expert = ServiceExpertPolicy(tokenizer, [episode])
        self.episode = episode

    def sample(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        from mosaic.agent.policy import GenRequest

        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        kind = "compaction" if last_user.startswith(HarnessConfig().compaction_prompt[:40]) else "main"
        req = GenRequest("s", list(prompt_ids), max_tokens, meta={"task_id": self.episode.id, "kind": kind})
        return self.expert.generate([req])[0].token_ids


def test_a_service_row_plays_its_episode_on_a_fresh_backend_with_the_harness_tokens(tmp_path, tokenizer):
    """A row of ``mosaic data export data.family=service`` through the loop: the episode regenerated from the
    row's config, played on its own account backend; the outputs carry the reference harness run's sessions
    token for token, the success reward and the family's outcome (stale actions, visits) on the final row."""
    from mosaic.agent.service_expert import ServiceExpertPolicy
    from mosaic.envs.export import export_parquet, read_rows
    from mosaic.envs.service import ServiceEnv
    from mosaic.envs.service.splits import load_service_split, service_config

    cfg = service_config("validation", "cpu")
    episodes = load_service_split("validation", cfg)[:3]
    rows = read_rows(export_parquet(episodes, tmp_path / "svc.parquet", split_config=cfg))
    harness = {"mode": "compaction", "context_budget": 1792, "max_new_tokens": 256, "summary_max_new_tokens": 128,
               "max_turns": 40, "max_sessions": 8, "max_total_turns": 60}
    for row, episode in zip(rows, episodes):
        server = ServiceExpertServer(tokenizer, episode)
        loop = _loop(tokenizer, server)
        loop.harness_config = HarnessConfig(**harness)
        kwargs = {"raw_prompt": row["prompt"], "extra_info": row["extra_info"], "reward_model": row["reward_model"],
                  "tools_kwargs": row["extra_info"]["tools_kwargs"], "agent_name": "mosaic_agent", "uid": "u",
                  "session_id": 0, "data_source": row["data_source"]}  # fmt: skip
        outs = asyncio.run(loop.run({"temperature": 1.0}, **kwargs))
        ref = Harness(ServiceExpertPolicy(tokenizer, [episode]), ChatFormat(tokenizer), ServiceEnv([episode]),
                      HarnessConfig(**harness)).run([episode], 1)[0]  # fmt: skip
        assert ref.reward == 1.0 and outs[-1].reward_score == 1.0
        assert [(o.prompt_ids, o.response_ids) for o in outs] == [
            (s.prompt_ids, s.completion_ids) for s in [*[s for s in ref.sessions if not s.is_final],
                                                         *[s for s in ref.sessions if s.is_final]]]
        info = outs[-1].extra_fields["reward_extra_info"]
        assert info["env_stale_actions"] == 0.0 and info["env_visits_correct"] == info["env_visits"] == len(episode.visits)
        assert info["env_actions"] >= len(episode.visits) and info["env_state_match"] == 1.0


def test_a_service_row_whose_config_does_not_generate_it_is_refused(tmp_path, tokenizer):
    from mosaic.envs.export import export_parquet, read_rows
    from mosaic.envs.service.splits import load_service_split, service_config

    cfg = service_config("validation", "cpu")
    row = read_rows(export_parquet(load_service_split("validation", cfg)[:1], tmp_path / "s.parquet", split_config=cfg))[0]
    row["reward_model"]["ground_truth"] = "something else"
    kwargs = {"extra_info": row["extra_info"], "reward_model": row["reward_model"], "uid": "u", "session_id": 0,
              "tools_kwargs": row["extra_info"]["tools_kwargs"]}
    with pytest.raises(ValueError, match="regenerates with another first visit or answer"):
        asyncio.run(_loop(tokenizer, ScriptedServer(tokenizer, "x")).run({}, **kwargs))
    # a service row whose config went missing says so (it is not taken for a deep-search row)
    empty = {**kwargs, "data_source": "mosaic/service", "tools_kwargs": {},
             "extra_info": {**row["extra_info"], "tools_kwargs": {}}}
    with pytest.raises(ValueError, match="service_config is empty"):
        asyncio.run(_loop(tokenizer, ScriptedServer(tokenizer, "x")).run({}, **empty))


class ResetServer(ScriptedServer):
    """Reset mode: the first session searches once and hands off a note with the answer; a session that
    starts from non-empty notes answers."""

    def reply(self, prompt_ids: list[int]) -> str:
        text = self.tok.decode(prompt_ids)
        first_user = text.split("<|im_start|>user", 1)[-1]
        if "(empty)" not in first_user.split("<|im_end|>")[0]:
            return f"<answer>{self.answer}</answer>"
        if "<tool_call>" in text.split("<|im_start|>user", 1)[-1]:
            return '<tool_call>{"name": "handoff", "arguments": {"note": "answer: %s"}}</tool_call>' % self.answer
        return '<tool_call>{"name": "search", "arguments": {"query": "q0"}}</tool_call>'


def test_context_reset_sessions_through_the_loop_and_the_estimator(split, tokenizer):
    """Issue 30 item 3: ``+mosaic.harness.mode=reset`` in verl: one output per reset session (kind ``reset``,
    chained by ``continues``), the harness's tokens exactly, the reset states' gains scored on the server
    (the shared state probed once), and Mosaic's advantages computed from the rows by the estimator hook."""
    from mosaic.integrations.verl.rows import advantage_batch_from_rows

    harness = {"mode": "reset", "context_budget": 260, "reset_context_budget": 600, "max_new_tokens": 40,
               "reset_k": 4, "max_sessions": 4}
    task = split.tasks[2]
    server = ResetServer(tokenizer, task.answer)
    loop = _loop(tokenizer, server)
    loop.harness_config = HarnessConfig(**harness)
    outs = asyncio.run(loop.run({"temperature": 1.0}, **_kwargs(split, task)))
    ref = Harness(ScriptPolicy(ResetServer(tokenizer, task.answer)), ChatFormat(tokenizer), DeepSearchEnv(split),
                  HarnessConfig(**harness)).run([task], 1)[0]  # fmt: skip
    assert [s.kind for s in ref.sessions] == ["reset", "reset"] and ref.reward == 1.0
    assert [(o.prompt_ids, o.response_ids) for o in outs] == [(s.prompt_ids, s.completion_ids) for s in ref.sessions]
    assert [o.extra_fields["mosaic_kind"] for o in outs] == ["reset", "reset"]
    assert [o.extra_fields["mosaic_edge"] for o in outs] == ["", "continues"]
    assert math.isfinite(outs[0].extra_fields["mosaic_gain"]) and math.isnan(outs[1].extra_fields["mosaic_gain"])
    assert sum("prompt_logprobs" in r[2] for r in server.requests) == 2  # before (its prompt), after (the next prompt)
    cols = {k: [o.extra_fields[k] for o in outs] for k in ("mosaic_traj", "mosaic_kind", "mosaic_final",
                                                            "mosaic_sessions", "mosaic_gain")}
    batch = advantage_batch_from_rows(np.array([o.reward_score or 0.0 for o in outs]), ["u1"] * len(outs), cols)
    from mosaic.core.estimators import get_estimator
    from mosaic.train.batch import advantage_batch

    ours = advantage_batch([ref], None)
    assert batch.kinds.tolist() == ours.kinds.tolist() == [3, 3]  # KIND_CODES["reset"]
    assert batch.session_counts.tolist() == ours.session_counts.tolist() and batch.is_final.tolist() == [False, True]
    advantages, _ = get_estimator("mosaic")(batch)
    assert torch.isfinite(advantages).all() and advantages.shape == (2,)


ROLES = ["searcher: search and note what you find", "solver: use the notes, answer"]


def test_a_scripted_partner_plays_the_second_role_and_only_ours_trains(split, tokenizer):
    """Reset mode's ``harness.partner=expert`` in verl: the expert plays the second role's sessions (none of
    its requests reach verl's server), they stay in the outputs (the graph and its reward) with response mask
    0, and the tokens are the built-in harness's with the same partner."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy

    harness = {"mode": "reset", "context_budget": 260, "reset_context_budget": 600, "max_new_tokens": 40,
               "reset_k": 4, "max_sessions": 4, "reset_roles": ROLES, "partner": "expert"}
    task = split.tasks[2]
    server = ResetServer(tokenizer, task.answer)
    outs = asyncio.run(_loop(tokenizer, server, harness=harness).run({"temperature": 1.0}, **_kwargs(split, task)))
    ref = Harness(ScriptPolicy(ResetServer(tokenizer, task.answer)), ChatFormat(tokenizer), DeepSearchEnv(split),
                  HarnessConfig(**harness), partner=ExpertPolicy(tokenizer, [task], ExpertNoise.off())).run([task], 1)[0]
    partner = [bool(s.meta.get("partner")) for s in ref.sessions]
    assert partner[:2] == [False, True] and ref.reward == 1.0
    assert [(o.prompt_ids, o.response_ids) for o in outs] == [(s.prompt_ids, s.completion_ids) for s in ref.sessions]
    for o, theirs in zip(outs, partner):
        assert any(o.response_mask) != theirs  # the partner's tokens are in the rows, never trained
    sampled = [r for r in server.requests if "prompt_logprobs" not in r[2]]
    assert len(sampled) == sum(s.num_turns for s, p in zip(ref.sessions, partner) if not p)
    assert outs[-1].reward_score == 1.0 and all(o.extra_fields["mosaic_kind"] == "reset" for o in outs)


def test_a_frozen_partner_is_refused_in_verl_with_the_reason(tokenizer):
    harness = {"mode": "reset", "reset_roles": ROLES, "partner": "frozen"}
    with pytest.raises(Exception, match="frozen.*not supported in verl"):  # (hydra may wrap it)
        _loop(tokenizer, ResetServer(tokenizer, "x"), harness=harness)
