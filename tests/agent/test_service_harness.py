"""The service family through the real harness: JSON-argument tools, a backend per trajectory, the env's
reward and outcome in the trajectory (issue 29)."""

import json

import pytest
from _tiny import tiny_tokenizer

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import Harness, HarnessConfig
from mosaic.agent.service_expert import ServiceExpertPolicy, transcript_of
from mosaic.agent.tools import parse_action
from mosaic.envs.service import SERVICE_RULES, ServiceConfig, ServiceEnv, generate_episodes

PROMPT = "You are a customer-service agent with tools on the customer's account.\nTools:\n{tools}\n" + SERVICE_RULES


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(tiny_tokenizer())


@pytest.fixture(scope="module")
def episodes():
    return generate_episodes(ServiceConfig(seed=11, n_users=16, visits=3))


def run(chat, episodes, revalidate, group=1, **cfg):
    policy = ServiceExpertPolicy(chat.tokenizer, episodes, revalidate=revalidate)
    config = HarnessConfig(**{"mode": "single", "context_budget": 16384, "max_new_tokens": 256, "max_turns": 40,
                              "max_total_turns": 40, "system_prompt": PROMPT, **cfg})
    env = ServiceEnv()
    return Harness(policy, chat, env, config).run(episodes, group_size=group), env


def test_the_experts_through_the_harness(chat, episodes):
    trajs, env = run(chat, episodes, True, group=2)
    assert all(t.success and t.reward == 1.0 for t in trajs), [t.meta.get("env") for t in trajs if not t.success]
    assert all(t.meta["env"]["stale_actions"] == 0 and t.meta["tool_errors"] == 0 for t in trajs)
    assert all(t.meta["num_invalid"] == 0 and t.meta["tool_calls"]["get_account"] == 3 for t in trajs)
    assert env.rollouts == {}  # every rollout freed
    trusting, _env = run(chat, episodes, False)
    traps = [e.trap for e in episodes]
    assert [not t.success for t in trusting] == traps and any(traps) and not all(traps)
    first = trajs[0].sessions[0]
    assert "create_order(item, address, card)" in chat.decode(first.prompt_ids)  # the env's tool docs
    # `mosaic rollout`'s summary: the revalidating expert acts on nothing stale, the trusting one does
    from mosaic.agent.cli import summarize, summary_table

    good, bad = summarize(trajs), summarize(trusting)
    assert good["stale_actions"] == 0 and good["actions"] > 0 and good["visits_correct"] == good["state_match"] == 1
    assert bad["stale_actions"] > 0 and bad["state_match"] < 1 and "stale actions / actions" in summary_table(trusting)


@pytest.mark.parametrize("mode", ["fork", "compaction+fork"])
def test_fork_mode_experts_audit_the_account_through_a_subagent(chat, episodes, mode):
    """Forks on the service family (issue 29 item 6): at each visit's start the revalidating expert delegates an
    audit; its sub-agent does the two lookups on the trajectory's own backend and answers with them (order
    addresses that are the account's left out); the parent plans from that answer. The trusting expert
    audits once (the first visit) and fails exactly the trap episodes, as without forks."""
    fork = dict(mode=mode, max_sessions=8, max_total_turns=60, max_new_tokens=512)  # (the test tokenizer is wordy)
    trajs, env = run(chat, episodes, True, **fork)
    assert all(t.success for t in trajs), [t.meta.get("env") for t in trajs if not t.success]
    for t in trajs:
        subs = [s for s in t.sessions if s.kind == "subagent"]
        assert len(subs) == t.meta["env"]["visits"] == t.meta["tool_calls"]["delegate"]
        assert t.meta["tool_calls"]["get_account"] == len(subs) and t.meta["num_invalid"] == 0
        # every lookup was the sub-agents': the main session's own turns call no lookup
        main = chat.decode(t.sessions[0].completion_ids)
        assert '"get_account"' not in main and '"delegate"' in main
    answer = chat.decode(trajs[0].sessions[1].completion_ids)
    assert "Orders:\n" in answer and "<answer>Account of " in answer
    assert env.rollouts == {}
    trusting, _env = run(chat, episodes, False, **fork)
    assert [not t.success for t in trusting] == [e.trap for e in episodes]
    assert all(t.meta["tool_calls"]["delegate"] == 1 for t in trusting)


def test_a_failed_audit_falls_back_to_the_parents_own_lookups(chat, episodes, monkeypatch):
    from mosaic.envs.service.expert import ServiceExpert

    monkeypatch.setattr(ServiceExpert, "audit", staticmethod(lambda transcript: "<answer>unknown</answer>"))
    trajs, _env = run(chat, episodes[:4], True, mode="fork", max_sessions=8, max_total_turns=60)
    assert all(t.success for t in trajs)
    assert all(t.meta["tool_calls"]["delegate"] == t.meta["env"]["visits"] == t.meta["tool_calls"]["get_account"]
               for t in trajs)  # one audit per visit, then its own lookups


def test_audit_answers_round_trip_and_refuse_what_is_not_one():
    from mosaic.envs.service.expert import audit_text, parse_audit
    from mosaic.envs.service.text import format_account, format_orders

    acc = {"name": "Ana Lo", "address": "1 Main St, Riva", "card": "1234", "plan": "basic", "plan_status": "active",
           "channel": "sms"}
    orders = {"o1": {"item": "red kettle", "status": "shipped", "address": "1 Main St, Riva"},
              "o2": {"item": "blue rug", "status": "pending", "address": "9 Old Rd, Pel"},
              "o3": {"item": "tent", "status": "placed", "address": "9 Old Rd, Pel"}}
    text = audit_text(format_account(acc), format_orders(orders))
    assert "o1 | red kettle | shipped\n" in text and text.count("ship to 9 Old Rd, Pel") == 1  # only the other address
    assert text.endswith("o3 | tent | placed | ship to ditto")
    assert parse_audit(text) == (format_account(acc), format_orders(orders))
    assert parse_audit(audit_text(format_account(acc), format_orders({}))) == (format_account(acc), "No orders.")
    for bad in ("unknown", "Error (subagent_failed): the helper stopped", text.replace("card: ending", "card:"),
                text.replace("| shipped", "shipped"), text.replace("\nOrders:\n", "\n"),
                text.replace("o1 | red kettle | shipped", "o1 | red kettle | shipped | ship to ditto"),
                text[:-10], text + " | shi"):
        assert parse_audit(bad) is None


def test_subagents_act_on_the_trajectorys_own_backend(chat, episodes):
    """A change a sub-agent makes is what its parent reads next: one backend per trajectory, shared by its
    sessions."""
    from mosaic.agent.policy import GenResult
    from mosaic.envs.service.expert import tool_call_text

    class Scripted:
        def __init__(self):
            self.seen = []

        def generate(self, requests):
            out = []
            for r in requests:
                t = transcript_of(chat.decode(list(r.prompt_ids)))
                if r.meta.get("kind") == "subagent":
                    text = tool_call_text("update_card", {"card": "4321"}) if len(t) == 1 else "<answer>done</answer>"
                elif len(t) == 1:
                    text = tool_call_text("delegate", {"question": "record the new card"})
                elif len(t) == 3:
                    text = tool_call_text("get_account", {})
                else:
                    self.seen.append(t[-1][1])
                    text = "<answer>x</answer>"
                ids = list(chat.tokenizer(text, add_special_tokens=False)["input_ids"]) + [chat.im_end_id]
                out.append(GenResult(ids, [0.0] * len(ids), "stop"))
            return out

        def release(self, key):
            pass

    pol = Scripted()
    config = HarnessConfig(mode="fork", context_budget=16384, max_new_tokens=256, max_turns=10, max_total_turns=20,
                           system_prompt=PROMPT)
    trajs = Harness(pol, chat, ServiceEnv(), config).run(episodes[:2], group_size=2)
    assert len(pol.seen) == 4 and all("card: ending 4321" in s for s in pol.seen), pol.seen
    assert all(t.meta["tool_calls"]["update_card"] == 1 for t in trajs)


def test_a_trajectory_cut_short_is_scored_and_freed(chat, episodes):
    trajs, env = run(chat, episodes[:3], True, max_turns=3)
    assert all(t.end_reason == "turn_cap" and not t.success and t.meta["env"]["visits_reached"] == 1
               for t in trajs)
    assert env.rollouts == {}


def test_bad_json_arguments_are_counted_not_fatal(chat, episodes):
    tools = ("search", "get_order", "end_visit")
    ok = parse_action('<tool_call>{"name": "get_order", "arguments": {"order_id": "o1"}}</tool_call>', tools,
                      json_tools=tools[1:])
    assert ok.kind == "call" and ok.meta["arguments"] == {"order_id": "o1"}
    bad = parse_action('<tool_call>{"name": "get_order", "arguments": ["o1"]}</tool_call>', tools,
                       json_tools=tools[1:])
    assert bad.kind == "invalid" and bad.error == "bad_arguments"
    long = parse_action(json.dumps({"name": "get_order", "arguments": {"order_id": "o" * 600}}).join(
        ["<tool_call>", "</tool_call>"]), tools, json_tools=tools[1:])
    assert long.error == "argument_too_long"
    odd = parse_action('<tool_call>{"name": "get_order", "arguments": {"order_id": "\\udfff"}}</tool_call>', tools,
                       json_tools=tools[1:])
    assert odd.sanitized and odd.meta["arguments"] == {"order_id": "\ufffd"}


def test_transcript_unwraps_tool_responses():
    text = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nVisit 1 of 2, day 3. Hi<|im_end|>\n"
            "<|im_start|>assistant\nX<|im_end|>\n<|im_start|>tool\n<tool_response>\nR\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    assert transcript_of(text) == [("user", "Visit 1 of 2, day 3. Hi"), ("assistant", "X"), ("tool", "R")]


def test_the_family_plugs_into_the_trainers_split_and_env(tmp_path):
    """Issue 29 item 6: ``data.family=service`` gives the trainer, evaluation and rollouts the service split
    and its environment (the rules appended to the system prompt once); a compaction restates the current
    visit, not the first."""
    from mosaic.agent.episode import make_env
    from mosaic.config.loader import load_config
    from mosaic.envs.service.splits import ServiceSplit
    from mosaic.train.setup import load_split

    cfg = load_config("cpu-service", overrides=[f"data.cache_dir={tmp_path}", "data.n_eval_tasks=8"])
    split = load_split(cfg, "validation")
    assert isinstance(split, ServiceSplit) and len(split.tasks) == 8 and split.name == "validation"
    env = make_env(split)
    assert isinstance(env, ServiceEnv)
    chat = ChatFormat(tiny_tokenizer())
    policy = ServiceExpertPolicy(chat.tokenizer, split.tasks)
    hc = HarnessConfig(mode="compaction", context_budget=2400, max_new_tokens=256, max_turns=40, max_sessions=12,
                       max_total_turns=80)
    trajs = Harness(policy, chat, env, hc).run(split.tasks, 1, seed=0, progress=False)
    text = chat.decode(trajs[0].sessions[0].prompt_ids)
    assert text.count(SERVICE_RULES.splitlines()[0]) == 1
    resumed = [chat.decode(t.sessions[s.id + 1].prompt_ids) for t in trajs for s in t.sessions
               if s.kind == "compaction" and s.id + 1 < len(t.sessions)]
    assert resumed and any("Visit 2 of" in r for r in resumed), resumed[:1]


@pytest.mark.parametrize("budget", [2400, 2800])
def test_the_expert_carries_its_visit_through_a_compaction(tmp_path, budget):
    """The expert's compaction summary carries the visit's plan and how much of it is done (or, before the
    plan is made, the calls done as tool calls), which it reads back after the compaction: it neither redoes
    an action (forbidden) nor skips one. With a placeholder summary, 3 of these 8 episodes failed at a budget
    of 2,800."""
    from mosaic.agent.episode import make_env
    from mosaic.config.loader import load_config
    from mosaic.train.setup import load_split

    cfg = load_config("cpu-service", overrides=[f"data.cache_dir={tmp_path}", "data.n_eval_tasks=8"])
    split = load_split(cfg, "validation")
    chat = ChatFormat(tiny_tokenizer())
    hc = HarnessConfig(mode="compaction", context_budget=budget, max_new_tokens=256, max_turns=40, max_sessions=12,
                       max_total_turns=80)
    trajs = Harness(ServiceExpertPolicy(chat.tokenizer, split.tasks), chat, make_env(split), hc).run(
        split.tasks, 1, seed=0, progress=False)
    assert sum(t.meta["compactions"] for t in trajs) >= 5
    assert all(t.success and t.meta["env"]["forbidden"] == 0 for t in trajs), [t.meta["env"] for t in trajs]
    summaries = [chat.decode(s.completion_ids) for t in trajs for s in t.sessions if s.kind == "compaction"]
    assert any(x.startswith("Visit ") and " plan: {" in x and " done: " in x for x in summaries), summaries


@pytest.fixture(scope="module")
def base_tok():
    import torch

    from mosaic.train import setup

    return setup.load_policy(setup.base_model_dir("tiny"), device=torch.device("cpu"), dtype=torch.float32)[1]


@pytest.mark.parametrize("k", [3, 4, 8])
def test_the_expert_solves_service_episodes_in_context_reset_mode(tmp_path, base_tok, k):
    """Issue 30 item 4: ``harness.mode=reset`` on the service family. Every session starts from the *current*
    visit and the notes; the expert notes the visit's plan and its progress and goes on from them, never
    redoing an action; >= 99 % of 64 validation episodes at the cpu-service preset's reset budget."""
    from mosaic.agent.episode import make_env
    from mosaic.config.loader import load_config
    from mosaic.train.setup import load_split

    cfg = load_config("cpu-service", overrides=[f"data.cache_dir={tmp_path}", "data.n_eval_tasks=64", "harness.mode=reset",
                                                f"harness.reset_k={k}", "harness.max_sessions=30", "harness.max_total_turns=120"])
    split = load_split(cfg, "validation")
    chat = ChatFormat(base_tok)
    trajs = Harness(ServiceExpertPolicy(base_tok, split.tasks), chat, make_env(split), cfg.harness).run(
        split.tasks, 1, seed=0, progress=False)
    assert sum(t.success for t in trajs) >= 0.99 * len(trajs), [t.meta["env"] for t in trajs if not t.success][:2]
    assert all(t.meta["env"]["forbidden"] == 0 and t.meta["env"]["stale_actions"] == 0 for t in trajs)
    assert all(s.kind == "reset" for t in trajs for s in t.sessions)
    assert sum(t.meta["resets"] for t in trajs) > len(trajs)  # several sessions per episode
    later = [chat.decode(s.prompt_ids) for t in trajs for s in t.sessions if s.meta.get("question")]
    assert later and all("Visit 2 of 2" in x for x in later)  # a session after end_visit restates visit 2
    assert any(" plan: {" in n for t in trajs for n in t.meta["notes"])


def test_reset_mode_plans_and_counts_round_trip_and_a_cut_plan_is_ignored(episodes):
    from mosaic.envs.service import ServiceExpert
    from mosaic.envs.service.expert import carried_plan, done_count, done_text, plan_text

    plan = [("cancel_order", {"order_id": "o2"}), ("create_order", {"item": "a b", "address": "1 X Road, Y", "card": "1234"})]
    text = "Visit 2 of 3, day 5. Hi\n\nNotes:\n- " + plan_text(0, plan[:1]) + "\n- " + plan_text(1, plan, "shipped")
    assert carried_plan(text, 1) == (plan, "shipped") and carried_plan(text, 0) == (plan[:1], "")
    assert carried_plan(text, 2) is None
    cut = plan_text(1, plan)[:-12]
    assert carried_plan(cut, 1) is None  # a summary cut at its token cap: re-planned from lookups instead
    assert carried_plan(plan_text(1, [("get_account", {})]), 1) is None  # only mutating calls are planned
    assert done_count(f"{done_text(1, 1)} {done_text(1, 2)} {done_text(0, 5)}", 1) == 2
    # hostile notes: deep nesting, huge numbers, non-finite constants, non-dict JSON are ignored, never raised
    for note in ("Visit 2 plan: " + "[" * 5000, "Visit " + "9" * 5000 + " plan: {}", "Visit 2 plan: null",
                 'Visit 2 plan: {"calls": [["cancel_order", {"order_id": NaN}]], "answer": ""}',
                 'Visit 2 plan: {"calls": "x", "answer": ""}', 'Visit 2 plan: {"calls": [], "answer": 3}'):
        assert carried_plan(note, 1) is None, note[:60]
    assert done_count("Visit 2 done: " + "9" * 5000, 1) == 0
    with pytest.raises(ValueError, match="trusting expert is not defined in context-reset mode"):
        ServiceExpert(revalidate=False).act_reset(episodes[0], [("user", episodes[0].question)], 4)
