"""A scripted, deterministic OpenAI-compatible server: try ``mosaic proxy`` without a model, and
the upstream of the project's own tests and benchmarks (``mosaic proxy scripted-upstream``).

It behaves like vLLM where the proxy cares: it renders the chat into a prompt
with a ChatML-style template, tokenizes it with a small real tokenizer (the
project's byte-level BPE trained here on a fixed corpus, see :func:`build_tokenizer`),
and returns ``prompt_token_ids`` and per-choice ``token_ids`` when asked
(``return_token_ids``) plus sampling log-probs (``logprobs``), streamed or not.
Instead of a model it decides its reply from the request (:func:`decide`):

- a request whose last message asks for a summary gets a summary listing the
  ``FACT-…`` markers it can see;
- a main agent with a ``task`` tool first forks two subagents in one turn
  (parallel tool calls), then lists files until it sees a summary, then
  answers;
- a subagent (its first user message starts with ``SUBTASK``) lists files once
  and returns a ``FACT-…`` result;
- anything else gets a deterministic echo;
- model ``fail-NNN`` gets HTTP status NNN (for fault tests).

Prompt rendering is per segment and the tokenizer isolates newlines, so a
conversation re-rendered with the assistant's reply appended starts with the
exact ids of the previous prompt + completion — the property a real server
with a stable chat template has, and the one session reconstruction relies on.

The server itself is :mod:`mosaic.capture.scripted_server`; serve it in-process with
:class:`mosaic.serving.ServerThread`; save its tokenizer with
:func:`mosaic.agent.tokenizer.save_tokenizer` (what ``mosaic proxy --tokenizer DIR`` loads).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from mosaic.agent.tokenizer import train_tokenizer
from mosaic.capture.records import content_text

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """The quick brown fox jumps over the lazy dog. Find the fact about the river and the city.
You are a helpful research agent. Use the tools to look up facts, then answer the question.
SUBTASK: research the topic and report the FACT marker you find. RESULT ANSWER SUMMARY
Here is a summary of the conversation to date. Messages to summarize: user assistant tool system
{"name": "task", "arguments": {"description": "research", "subagent_type": "general-purpose"}}
<tool_call> </tool_call> ls read_file write_file path / files: none 0123456789 alpha beta gamma delta
"""


def build_tokenizer(vocab_size: int = 800):
    """The scripted model's tokenizer: the project BPE (:func:`mosaic.agent.tokenizer.train_tokenizer`)
    on a fixed corpus, newlines isolated (rendering segment by segment gives the ids of the whole),
    no tag tokens, and this module's ChatML template with a ``tools`` header."""
    return train_tokenizer([_CORPUS] * 4, vocab_size, min_frequency=0, tag_tokens=(),
                           chat_template=CHAT_TEMPLATE, isolate_newlines=True)


# --------------------------------------------------------------------------- rendering


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    out = []
    for tc in tool_calls or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_obj = args
        out.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args_obj},
                                             ensure_ascii=False) + "</tool_call>")
    return "".join(out)


def message_body(m: dict[str, Any]) -> str:
    return content_text(m.get("content")) + render_tool_calls(m.get("tool_calls") or [])


class Renderer:
    """Turns chats into token ids, segment by segment (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(self._cache) < 4096:
                self._cache[text] = ids
        return list(ids)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        ids: list[int] = []
        if tools:
            names = ",".join((t.get("function") or {}).get("name", "") for t in tools)
            ids += [self.im_start] + self.encode("tools\n") + self.encode(names) + [self.im_end] + self.encode("\n")
        for m in messages:
            ids += [self.im_start] + self.encode(f"{m.get('role', 'user')}\n") + self.encode(message_body(m))
            ids += [self.im_end] + self.encode("\n")
        ids += [self.im_start] + self.encode("assistant\n")
        return ids

    def completion(self, body: str, *, stop: bool = True) -> list[int]:
        return self.encode(body) + ([self.im_end] if stop else [])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


# --------------------------------------------------------------------------- the script


SUMMARY_RE = re.compile(r"(?i)(messages to summari[sz]e|summari[sz]e the conversation|write a summary)")
FACT_RE = re.compile(r"FACT-[0-9a-f]{6}")


def fact_for(text: str) -> str:
    return "FACT-" + hashlib.sha1(text.encode()).hexdigest()[:6]


def _tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [(t.get("function") or {}).get("name", "") for t in tools or []]


def _call(name: str, args: dict[str, Any], key: str) -> dict[str, Any]:
    cid = "call_" + hashlib.sha1(f"{key}:{name}:{json.dumps(args, sort_keys=True)}".encode()).hexdigest()[:12]
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def decide(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[str, list[dict[str, Any]]]:
    """The scripted policy: (text, tool_calls) for a chat request (see the module docstring)."""
    names = _tool_names(tools)
    last = messages[-1] if messages else {}
    last_text = content_text(last.get("content"))
    all_text = "\n".join(message_body(m) for m in messages)
    key = hashlib.sha1(all_text.encode()).hexdigest()[:8]
    if last.get("role") == "user" and SUMMARY_RE.search(last_text):
        facts = sorted(set(FACT_RE.findall(last_text)))
        return f"SUMMARY {key}: the subagents found {' '.join(facts) or 'nothing'}; keep listing files, then answer.", []
    users = [content_text(m.get("content")) for m in messages if m.get("role") == "user"]
    first_user = users[0] if users else ""
    n_tool = sum(1 for m in messages if m.get("role") == "tool")
    if first_user.startswith("SUBTASK"):
        if n_tool == 0 and "ls" in names:
            return "", [_call("ls", {"path": "/"}, key)]
        return f"RESULT {fact_for(first_user)} for: {first_user[:40]}", []
    if "task" in names:
        summarised = any("summary" in u.lower() and "SUMMARY" in u for u in users)
        task_called = any(
            (tc.get("function") or {}).get("name") == "task"
            for m in messages if m.get("role") == "assistant" for tc in (m.get("tool_calls") or [])
        )
        if not summarised and not task_called:
            topic = hashlib.sha1(first_user.encode()).hexdigest()[:4]
            return "", [
                _call("task", {"description": f"SUBTASK alpha-{topic}: find the first fact.",
                               "subagent_type": "general-purpose"}, key + "a"),
                _call("task", {"description": f"SUBTASK beta-{topic}: find the second fact.",
                               "subagent_type": "general-purpose"}, key + "b"),
            ]
        # Count tool results after the last summary (or from the start).
        start = 0
        for i, m in enumerate(messages):
            if m.get("role") == "user" and "SUMMARY" in content_text(m.get("content")):
                start = i
        listed = sum(1 for m in messages[start:] if m.get("role") == "tool")
        if ("ls" in names) and ((not summarised and listed < 12) or (summarised and listed < 1)):
            return "", [_call("ls", {"path": "/"}, key + str(listed))]
        facts = sorted(set(FACT_RE.findall(all_text)))
        return f"ANSWER: {' '.join(facts) or 'unknown'}", []
    return f"Echo {key}: {last_text[:60]}", []
