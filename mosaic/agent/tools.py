"""Parsing an assistant message into one action, and the tools' specs.

Tool calls are Hermes/Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
A complete ``<answer>…</answer>`` pair is the answer action (it wins over a tool
call in the same message; extraction is :func:`mosaic.envs.rewards.extract_answer`,
the same rule the reward uses). Everything else that is not exactly one well-formed
call of an available tool is an *invalid action* with a type (counted in the
trajectory's metrics) and a message the model reads as the tool response.
Parsing never raises.

Text safety (issue 11): decoded model output is always valid Unicode, but a JSON
escape such as ``"\\udfff"`` in a tool call decodes to a lone surrogate, which no
tokenizer, UTF-8 file or Parquet column accepts. :func:`safe_text` is the one
rule for text entering the agent loop from outside (a tool call's argument here;
a tool's result and a task's text in the harness): each lone surrogate becomes
U+FFFD and the caller counts the text as sanitised (``Action.sanitized``; the
trajectory's ``meta["sanitized_text"]``). :func:`safe_json` applies it to every string of a JSON
value: the recording proxy's requests, responses and reward POSTs, and records read back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from mosaic.config.harness import TOOL_DOCS  # noqa: F401  (re-exported: the tools' specs)
from mosaic.envs.rewards import extract_answer

TOOL_ARGS: dict[str, str] = {"search": "query", "delegate": "question", "note_write": "text", "handoff": "note"}
"""Each tool takes exactly one string argument, named here."""


INVALID_TYPES = (
    "no_action", "unclosed_tool_call", "malformed_tool_call", "bad_json", "bad_call",
    "unknown_tool", "bad_arguments", "argument_too_long", "malformed_answer", "delegate_depth",
)

_CALL_HINT = ('Call a tool with <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call> '
              "or answer with <answer>NAME</answer>.")


_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(text: str) -> tuple[str, bool]:
    """``(text, changed)``: ``text`` with every lone surrogate (U+D800..U+DFFF) replaced by U+FFFD,
    so it encodes as UTF-8 (tokenizers, JSONL, Parquet); ``changed`` says whether any was replaced.
    Everything else (NUL, control characters, any valid code point) is kept as it is."""
    if _SURROGATE.search(text) is None:
        return text, False
    return _SURROGATE.sub("\ufffd", text), True


def safe_json(obj: Any) -> tuple[Any, int]:
    """``(obj, n)``: a JSON value with :func:`safe_text` applied to every string in it (dict keys
    included); ``n`` counts the strings changed. Unchanged parts are returned as they are (no copy)."""
    if isinstance(obj, str):
        text, changed = safe_text(obj)
        return text, int(changed)
    if isinstance(obj, list):
        if all(type(v) in (int, float, bool) for v in obj):  # token ids, log-probs: nothing to do
            return obj, 0
        out, n = [], 0
        for v in obj:
            v2, k = safe_json(v)
            out.append(v2)
            n += k
        return (out, n) if n else (obj, 0)
    if isinstance(obj, dict):
        out_d, n = {}, 0
        for key, v in obj.items():
            key2, k1 = safe_json(key) if isinstance(key, str) else (key, 0)
            v2, k2 = safe_json(v)
            out_d[key2] = v2
            n += k1 + k2
        return (out_d, n) if n else (obj, 0)
    return obj, 0


@dataclass(frozen=True)
class Action:
    """What one assistant message asks for.

    ``kind``: ``answer`` (``answer`` holds the extracted text, possibly None when empty),
    ``call`` (``name`` + ``argument``), or ``invalid`` (``error`` type + ``message``).
    ``sanitized``: the call's argument held lone surrogates, replaced by :func:`safe_text`.
    """

    kind: Literal["answer", "call", "invalid"]
    name: str = ""
    argument: str = ""
    answer: str | None = None
    error: str = ""
    message: str = ""
    extra_calls: int = 0
    sanitized: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


def _invalid(error: str, message: str) -> Action:
    return Action("invalid", error=error, message=f"Error ({error}): {message}")


def parse_action(text: str, tools: tuple[str, ...], *, max_arg_chars: int = 512,
                 json_tools: tuple[str, ...] = ()) -> Action:
    """Parse one assistant message (its text without the end-of-turn token).

    ``json_tools``: tools of a multi-tool environment (:mod:`mosaic.envs.service`) whose arguments are a
    JSON object the environment checks itself; the call's ``meta["arguments"]`` holds it (lone
    surrogates replaced) and ``argument`` its JSON text, whose length ``max_arg_chars`` caps."""
    answer, status = extract_answer(text)
    if status in ("ok", "empty"):
        return Action("answer", answer=answer)
    start = text.find("<tool_call>")
    if start < 0:
        if "</tool_call>" in text:
            return _invalid("malformed_tool_call", f"found </tool_call> without <tool_call>. {_CALL_HINT}")
        if status == "malformed":
            return _invalid("malformed_answer", "the answer needs both tags: <answer>NAME</answer>.")
        return _invalid("no_action", f"your message had neither a tool call nor an answer. {_CALL_HINT}")
    body_start = start + len("<tool_call>")
    end = text.find("</tool_call>", body_start)
    if end < 0:
        return _invalid("unclosed_tool_call", f"<tool_call> was not closed with </tool_call>. {_CALL_HINT}")
    extra = text.count("<tool_call>", end)
    body = text[body_start:end].strip()
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return _invalid("bad_json", "the tool call is not valid JSON. It must look like "
                                    '{"name": "search", "arguments": {"query": "..."}}.')
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return _invalid("bad_call", 'the tool call must be a JSON object with a string "name" and an '
                                    '"arguments" object.')
    name = call["name"]
    if name not in tools:
        shown = name if len(name) <= 40 else name[:40] + "..."
        return _invalid("unknown_tool", f"no tool named {shown!r}; available: {', '.join(tools)}.")
    args = call.get("arguments", {})
    if name in json_tools:
        return _json_call(name, args, extra, max_arg_chars)
    key = TOOL_ARGS[name]
    if not isinstance(args, dict) or set(args) != {key} or not isinstance(args[key], str) or not args[key].strip():
        return _invalid("bad_arguments", f'{name} takes one non-empty string argument: '
                                         f'{{"{key}": "..."}}.')
    value = args[key].strip()
    if len(value) > max_arg_chars:
        return _invalid("argument_too_long", f"the {key} has {len(value)} characters; the limit is "
                                             f"{max_arg_chars}.")
    value, sanitized = safe_text(value)
    return Action("call", name=name, argument=value, extra_calls=extra, sanitized=sanitized)


def _json_call(name: str, args, extra: int, max_arg_chars: int) -> Action:
    if not isinstance(args, dict):
        return _invalid("bad_arguments", f'{name} takes a JSON object of arguments: {{"name": "{name}", '
                                         f'"arguments": {{...}}}}.')
    text = json.dumps(args, ensure_ascii=False)
    if len(text) > max_arg_chars:
        return _invalid("argument_too_long", f"the arguments have {len(text)} characters; the limit is "
                                             f"{max_arg_chars}.")
    text, sanitized = safe_text(text)
    return Action("call", name=name, argument=text, extra_calls=extra, sanitized=sanitized,
                  meta={"arguments": json.loads(text) if sanitized else args})


def error_texts() -> list[str]:
    """Sample error responses of every invalid-action type (for the tokenizer corpus)."""
    samples = ["", "<answer>x", "<tool_call>{", "</tool_call>", "<tool_call>{x}</tool_call>",
               "<tool_call>[1]</tool_call>", '<tool_call>{"name": "browse"}</tool_call>',
               '<tool_call>{"name": "search", "arguments": {"query": 1}}</tool_call>',
               '<tool_call>{"name": "search", "arguments": {"query": "' + "a" * 600 + '"}}</tool_call>']
    return [parse_action(t, ("search", "delegate")).message for t in samples]


def format_call(name: str, argument: str) -> str:
    """The canonical text of a tool call (what the scripted expert writes)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": {TOOL_ARGS[name]: argument}}) + "</tool_call>"
