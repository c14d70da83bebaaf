"""Text from a model, a tool or a task is made safe where it enters the harness (issue 11).

A lone surrogate (``"\\udfff"`` as a JSON escape in a tool call, or in a tool's result) used to raise
``TypeError`` while tokenising and lose the whole batch. Now it becomes U+FFFD and the trajectory
counts it in ``meta["sanitized_text"]``. The hypothesis fuzz runs arbitrary unicode (surrogates,
control characters, NUL, long strings) as model outputs, tool arguments, tool results and task text
through the real harness.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import Harness, HarnessConfig
from mosaic.agent.policy import GenResult
from mosaic.agent.tokenizer import train_tokenizer
from mosaic.envs.rewards import extract_answer
from mosaic.trace import read_jsonl, write_jsonl
from mosaic.trace.graph import validate
from _doubles import FakeEnv, FakeTask, TextPolicy

SURROGATE = re.compile("[\ud800-\udfff]")
CORPUS = ['<tool_call>{"name": "search", "arguments": {"query": "Ruo Ces works"}}</tool_call>',
          '<tool_call>{"name": "delegate", "arguments": {"question": "who is"}}</tool_call>',
          "Error (bad_json): the tool call is not valid JSON.", "[1] Doc 1: about word word",
          "<answer>Ama Rell</answer>"] * 30
_CHAT = None


def chat_format() -> ChatFormat:
    global _CHAT
    if _CHAT is None:
        _CHAT = ChatFormat(train_tokenizer(CORPUS, vocab_size=600))
    return _CHAT


def utf8_clean(obj) -> bool:
    """True when ``obj`` serialises to JSON that encodes as UTF-8 (no lone surrogate anywhere)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_stored(trajs, path) -> None:
    """Every trajectory validates, is clean JSON, and round-trips through JSONL storage."""
    for t in trajs:
        validate(t)
        assert utf8_clean(t.to_dict()), t.id
    path.unlink(missing_ok=True)  # (write_jsonl appends)
    write_jsonl(path, trajs)
    back = read_jsonl(path)
    assert [b.to_dict() for b in back] == [t.to_dict() for t in trajs]


def scripted(turns):
    """A policy whose main session says ``turns[i]`` on its i-th turn, then answers; a subagent
    answers at once; a compaction summarises."""
    def say(req):
        if req.meta["kind"] == "subagent":
            return "<answer>helper</answer>"
        if req.meta["kind"] == "compaction":
            return "summary"
        i = req.meta["turn"]
        return turns[i] if i < len(turns) else "<answer>Ama Rell</answer>"
    return TextPolicy(chat_format().tokenizer, say)


CFG = HarnessConfig(mode="fork", context_budget=4000, max_new_tokens=400, max_turns=8, max_total_turns=12,
                    max_sessions=6)


@pytest.mark.parametrize("tool, key", [("delegate", "question"), ("search", "query")])
def test_lone_surrogate_in_a_tool_call_is_replaced_and_counted(tool, key, tmp_path):
    # issue 11: `{"question": "who \udfff is"}` raised TypeError in chat.py while tokenising; so did
    # `search`, whose environment echoes the query into the tool response.
    call = '<tool_call>{"name": "%s", "arguments": {"%s": "who \\udfff is"}}</tool_call>' % (tool, key)
    env = FakeEnv()
    [t] = Harness(scripted([call]), chat_format(), env, CFG).run([FakeTask("t0", "Q?", "Ama Rell")])
    assert t.end_reason == "answer" and t.success
    assert t.meta["sanitized_text"] == 1
    assert t.meta["tool_calls"] == {tool: 1} and t.meta["num_invalid"] == 0
    if tool == "search":
        assert env.queries == ["who \ufffd is"]
    else:
        assert t.count_kinds()["subagent"] == 1
        sub = next(s for s in t.sessions if s.kind == "subagent")
        assert "who \ufffd is" in chat_format().decode(sub.prompt_ids)
    check_stored([t], tmp_path / "t.jsonl")


def test_tool_result_and_task_text_are_made_safe(tmp_path):
    class BadEnv:
        def __init__(self):
            self.n = 0

        def search(self, query, k):
            self.n += 1
            return [None, "hit \udc80 here \x00 and \ud83d"][self.n % 2]  # not text, then lone surrogates

    call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    task = FakeTask("t0", "Who is \udfff?", "Ama \ud800Rell")
    [t] = Harness(scripted([call, call]), chat_format(), BadEnv(), CFG).run([task])
    assert t.end_reason == "answer"
    assert t.meta["tool_calls"] == {"search": 2} and t.meta["tool_errors"] == 1  # None is a tool error
    assert t.meta["sanitized_text"] == 3  # the question, the ground truth, the second result
    assert t.ground_truth == "Ama \ufffdRell"
    text = chat_format().decode(t.sessions[0].tokens())
    assert "Who is \ufffd?" in text and "hit \ufffd here \x00 and \ufffd" in text
    assert "Error (tool_error): search failed: TypeError: the environment returned NoneType" in text
    check_stored([t], tmp_path / "t.jsonl")


def test_policy_error_text_is_made_safe(tmp_path):
    class ErrorPolicy:
        def generate(self, requests):
            return [GenResult([], [], "error", error="server said \udfff") for _ in requests]

        def release(self, key):
            pass

    [t] = Harness(ErrorPolicy(), chat_format(), FakeEnv(), CFG).run([FakeTask("t0", "Q?", "A")])
    assert t.end_reason == "policy_error" and t.meta["error"] == "server said \ufffd"
    assert t.meta["sanitized_text"] == 1
    check_stored([t], tmp_path / "t.jsonl")


def test_safe_text_keeps_valid_text():
    from mosaic.agent.tools import parse_action, safe_text

    for s in ["", "plain", "nul \x00 ctl \x07\x1b", "astral \U0001f600", "\ufffd"]:
        assert safe_text(s) == (s, False)
    assert safe_text("a\ud800b\udfff") == ("a\ufffdb\ufffd", True)
    # a JSON surrogate *pair* is one astral character, not a replacement
    act = parse_action('<tool_call>{"name": "search", "arguments": {"query": "\\ud83d\\ude00"}}</tool_call>',
                       ("search",))
    assert act.argument == "\U0001f600" and not act.sanitized


# ---------------------------------------------------------------------------------------------- fuzz

CHARS = st.one_of(
    st.characters(codec=None, categories=None),  # any code point, surrogates and controls included
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"]),  # surrogates, often
    st.sampled_from(["\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\u2028", "\\", '"']),
)
SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"]), min_size=1,
                     max_size=3)
PIECES = st.one_of(st.text(CHARS, max_size=12), SURROGATES,
                   st.sampled_from(["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<answer>",
                                    "</answer>", "<tool_response>"]))
TEXT = st.one_of(st.lists(PIECES, max_size=5).map("".join),
                 st.builds(lambda c, n: c * n, CHARS, st.integers(200, 1000)))  # long strings
MAX_ARG = 64


@st.composite
def turn_specs(draw):
    """One main-session turn: a tool call whose argument is arbitrary unicode (JSON-escaped, as a
    model writes it), or arbitrary text emitted as raw UTF-8 bytes (lone surrogates as the bytes
    ``surrogatepass`` gives: the model can emit any byte)."""
    kind = draw(st.sampled_from(["call", "call", "raw"]))
    text = draw(TEXT)
    tool = draw(st.sampled_from(["search", "delegate"]))
    return kind, tool, text, draw(st.booleans())


class FuzzEnv:
    """Returns arbitrary unicode (echoing the query, or drawn text); counts the results that hold
    lone surrogates (each must be counted by the harness) and records the queries it receives."""

    def __init__(self, results):
        self.results = list(results)
        self.queries: list[str] = []
        self.dirty = 0

    def search(self, query, k):
        self.queries.append(query)
        out = f"[1] {query}" if not self.results else self.results.pop(0)
        self.dirty += bool(SURROGATE.search(out))
        return out


class ByteTextPolicy:
    """Main turns follow a script of :func:`turn_specs`; subagents and compactions answer plainly.
    Counts the calls whose argument holds a lone surrogate and that the parser must accept."""

    def __init__(self, chat, script):
        self.chat, self.script = chat, list(script)
        # the byte-level alphabet (GPT-2's byte -> character map): one token id per byte
        shown = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
        extra = iter(range(256, 512))
        char = {b: chr(b) if b in shown else chr(next(extra)) for b in range(256)}
        self.byte_ids = [chat.tokenizer.convert_tokens_to_ids(char[b]) for b in range(256)]
        assert len(set(self.byte_ids)) == 256
        self.expected_sanitized = 0
        self.turns = 0

    def _ids(self, text):
        return list(self.chat.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _one(self, req):
        if req.meta["kind"] != "main" or not self.script:
            text = "summary" if req.meta["kind"] == "compaction" else "<answer>Ama Rell</answer>"
            return self._ids(text)
        kind, tool, text, ascii_only = self.script.pop(0)
        self.turns += 1
        if kind == "raw":  # arbitrary bytes, e.g. b"\xed\xbf\xbf" for "\udfff"
            return [self.byte_ids[b] for b in text.encode("utf-8", "surrogatepass")]
        key = {"search": "query", "delegate": "question"}[tool]
        escaped = ascii_only or SURROGATE.search(text) is not None  # a raw surrogate has no token ids
        body = json.dumps({"name": tool, "arguments": {key: text}}, ensure_ascii=escaped)
        value = text.strip()
        # the message is a call of the tool (not an answer, not cut by a "</tool_call>" in the argument:
        # the rules of mosaic.agent.tools) whose argument is accepted and holds a lone surrogate
        message = f"<tool_call>{body}</tool_call>"
        is_call = extract_answer(message)[1] not in ("ok", "empty") and "</tool_call>" not in body
        if is_call and value and len(value) <= MAX_ARG and SURROGATE.search(value):
            self.expected_sanitized += 1
        return self._ids(message)

    def generate(self, requests):
        out = []
        for req in requests:
            ids = self._one(req) + [self.chat.im_end_id]
            assert len(ids) <= req.max_new_tokens, "the fuzz turn must not be cut (its count would be off)"
            out.append(GenResult(ids, [-0.5] * len(ids), "stop"))
        return out

    def release(self, key):
        pass


FUZZ_CFG = HarnessConfig(mode="compaction+fork", context_budget=400_000, max_new_tokens=40_000,
                         summary_max_new_tokens=64, max_turns=8, max_total_turns=12, max_sessions=8,
                         subagent_max_turns=2, max_depth=1, max_arg_chars=MAX_ARG)


def test_fuzz_arbitrary_unicode_never_crashes_and_every_bad_turn_is_counted(tmp_path):
    chat = chat_format()
    stats = {"examples": 0, "turns": 0, "sanitized": 0, "sanitized_args": 0, "sanitized_results": 0,
             "sanitized_tasks": 0, "invalid": 0, "trajectories": 0}

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(script=st.lists(turn_specs(), min_size=1, max_size=6),
           results=st.lists(TEXT, max_size=4),
           question=TEXT)
    def one(script, results, question):
        policy = ByteTextPolicy(chat, script)
        env = FuzzEnv(results)
        task = FakeTask("t0", question, "Ama Rell")
        trajs = Harness(policy, chat, env, FUZZ_CFG).run([task])  # any exception fails the test
        [t] = trajs
        check_stored(trajs, tmp_path / "fuzz.jsonl")
        # every text that held a lone surrogate was counted where it entered, and nothing else was
        task_dirty = int(SURROGATE.search(question) is not None)
        assert t.meta["sanitized_text"] == policy.expected_sanitized + env.dirty + task_dirty
        assert not any(SURROGATE.search(q) for q in env.queries)  # the tool only ever sees safe text
        # every main/subagent turn is an invalid action, a tool call or an answer
        answers = (t.end_reason == "answer") + t.meta["subagent_answers"]
        assert t.meta["turns"] == t.meta["num_invalid"] + sum(t.meta["tool_calls"].values()) + answers
        stats["examples"] += 1
        stats["trajectories"] += 1
        stats["turns"] += policy.turns
        stats["sanitized"] += t.meta["sanitized_text"]
        stats["sanitized_args"] += policy.expected_sanitized
        stats["sanitized_results"] += env.dirty
        stats["sanitized_tasks"] += task_dirty
        stats["invalid"] += t.meta["num_invalid"]

    one()
    print(f"\nfuzz: {stats}")
    assert stats["examples"] == 200
    # the fuzz reached every entry point with lone surrogates
    assert stats["sanitized_args"] > 0 and stats["sanitized_results"] > 0 and stats["sanitized_tasks"] > 0
