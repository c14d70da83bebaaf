"""Test doubles for the agent loop: a fake environment, recording / scripted / fuzz policies.

Imported by the tests in this folder as ``_doubles`` (pytest puts the folder on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mosaic.agent.policy import GenRequest, GenResult


class FakeEnv:
    """A deterministic search tool: one line per hit that echoes the query."""

    def __init__(self, words_per_hit: int = 6):
        self.words = words_per_hit
        self.queries: list[str] = []

    def search(self, query: str, k: int) -> str:
        self.queries.append(query)
        return "\n".join(f"[{i}] Doc {i}: about {query[:40]} " + "word " * self.words for i in range(1, k + 1))


@dataclass
class FakeTask:
    id: str
    question: str
    answer: str
    hops: int = 1
    gold_chain: list = field(default_factory=list)


class RecordingPolicy:
    """Wraps a policy and keeps a copy of every request and result, in call order."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[GenRequest, GenResult]] = []
        self.batches: list[int] = []
        self.released: list[str] = []

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        copies = [dataclasses.replace(r, prompt_ids=list(r.prompt_ids), meta=dict(r.meta)) for r in requests]
        results = self.inner.generate(requests)
        self.calls += list(zip(copies, results))
        self.batches.append(len(requests))
        return results

    def release(self, session_key: str) -> None:
        self.released.append(session_key)
        self.inner.release(session_key)

    def trajectory_meta(self, traj_id: str) -> dict:
        hook = getattr(self.inner, "trajectory_meta", None)
        return hook(traj_id) if callable(hook) else {}


class TextPolicy:
    """Answers each request with ``fn(request) -> text`` (tokenised, ended with ``<|im_end|>``),
    truncated to ``max_new_tokens`` (finish ``length``) like a model would be."""

    def __init__(self, tokenizer, fn: Callable[[GenRequest], str], *, end: bool = True):
        self.tok = tokenizer
        self.fn = fn
        self.end = end
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        out = []
        for r in requests:
            ids = list(self.tok(self.fn(r), add_special_tokens=False)["input_ids"])
            if self.end:
                ids.append(self.im_end_id)
            finish = "stop" if self.end else "length"
            if len(ids) > r.max_new_tokens:
                ids, finish = ids[: r.max_new_tokens], "length"
            out.append(GenResult(ids, [-0.5] * len(ids), finish))
        return out

    def release(self, session_key: str) -> None:
        pass


FUZZ_KINDS = (
    "random_bytes", "random_tokens", "truncated_json", "broken_json", "unknown_tool", "wrong_types",
    "huge_argument", "nested_tags", "unclosed_tags", "empty", "stray_close", "deep_json", "valid_call",
)


class FuzzPolicy:
    """Emits malformed assistant turns (and a few valid calls so subagents happen).

    ``counts`` tallies the kinds emitted. Never emits a complete ``<answer>…</answer>`` pair on
    purpose (random tokens may, rarely, and then the trajectory ends normally).
    """

    def __init__(self, tokenizer, seed: int = 0, *, valid_rate: float = 0.05):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.valid_rate = valid_rate
        self.vocab = len(tokenizer)
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.counts: dict[str, int] = {}

    def _text(self, kind: str) -> str:
        r = self.rng
        call = json.dumps({"name": "search", "arguments": {"query": "Ruo Ces works"}})
        if kind == "random_bytes":
            return bytes(r.randrange(256) for _ in range(r.randrange(1, 80))).decode("utf-8", "replace")
        if kind == "truncated_json":
            return "<tool_call>" + call[: r.randrange(len(call))] + "</tool_call>"
        if kind == "broken_json":
            return "<tool_call>" + r.choice(["{name: search}", "{'name': 'search'}", "[1, 2", "{\"name\": }",
                                             "null", "42", "\"search\"", "{}{}"]) + "</tool_call>"
        if kind == "unknown_tool":
            name = r.choice(["browse", "Search", "", "answer", "x" * 200, "delegate_all"])
            return "<tool_call>" + json.dumps({"name": name, "arguments": {"query": "a"}}) + "</tool_call>"
        if kind == "wrong_types":
            args = r.choice([{"query": 5}, {"query": None}, {"query": ["a"]}, {"q": "a"}, {}, "a b",
                             {"query": "a", "k": 3}, {"query": "   "}, {"question": "a"}])
            name = r.choice(["search", "delegate"])
            return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
        if kind == "huge_argument":
            query = r.choice(["ab " * 300, " word" * 16, "Ruo Ces " * 12])  # over any turn cap / over max_arg_chars
            return "<tool_call>" + json.dumps({"name": "search", "arguments": {"query": query}}) + "</tool_call>"
        if kind == "nested_tags":
            return r.choice(["<tool_call><tool_call>" + call + "</tool_call></tool_call>",
                             "<tool_call>" + call + "<tool_call></tool_call>",
                             "<tool_response>fake</tool_response>", "<answer><tool_call></answer>x"])[: 400]
        if kind == "unclosed_tags":
            return r.choice(["<tool_call>" + call, "<answer>Ruo Ces", "<tool_call>", "<answer>"])
        if kind == "empty":
            return r.choice(["", " ", "\n\n"])
        if kind == "stray_close":
            return r.choice(["</tool_call>", "</answer> done", "text </tool_call> " + call])
        if kind == "deep_json":
            return "<tool_call>" + "[" * r.choice([50, 3000]) + "</tool_call>"
        if kind == "valid_call":
            name = r.choice(["search", "delegate"])
            key = "query" if name == "search" else "question"
            return "<tool_call>" + json.dumps({"name": name, "arguments": {key: "Ruo Ces works"}}) + "</tool_call>"
        raise ValueError(kind)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        out = []
        for req in requests:
            if self.rng.random() < self.valid_rate:
                kind = "valid_call"
            else:
                kind = self.rng.choice(FUZZ_KINDS[:-1])
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if kind == "random_tokens":
                ids = [self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(0, req.max_new_tokens + 1))]
            else:
                ids = list(self.tok(self._text(kind), add_special_tokens=False)["input_ids"])
                if self.rng.random() < 0.8:
                    ids.append(self.im_end_id)
            ids = ids[: req.max_new_tokens]
            finish = "stop" if ids and ids[-1] == self.im_end_id else "length"
            out.append(GenResult(ids, [-1.0] * len(ids), finish))
        return out

    def release(self, session_key: str) -> None:
        pass
