"""Text around generation for ``mosaic serve``: chat messages as the template needs them (content
parts, tool calls in the history, tool schemas), Hermes tool calls parsed out of a reply into
OpenAI ``tool_calls``, and ``stop`` strings.

Tool calls follow the Hermes / Qwen convention the project's models are trained on
(:mod:`mosaic.agent.tools`): the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
the server returns them in OpenAI's format (``message.tool_calls``, ``finish_reason: "tool_calls"``),
and renders OpenAI-format history back into that text. A chat template that handles ``tools`` /
``tool_calls`` itself gets them as they are; for one that does not (the project's plain ChatML),
the tool schemas go into a system message and tool results are wrapped in ``<tool_response>``,
as :class:`mosaic.agent.chat.ChatFormat` does.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Sequence

from mosaic.agent.server.schema import ApiError, ChatCompletionRequest

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN_TAG = "<tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


def content_string(content: Any, where: str) -> str:
    """A message's content as text: a string, null (""), or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for k, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{k}]: only text parts are supported "
                                f"(got type {part.get('type')!r})", "messages")
        out.append(part["text"])
    return "".join(out)


def _hermes(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    return OPEN_TAG + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def template_messages(messages: list[dict], tools: list[dict] | None, template: str) -> tuple[list[dict], bool]:
    """OpenAI chat messages → what the chat template renders; returns them and whether the template
    takes ``tools=`` itself."""
    native = "tools" in template and "tool_calls" in template
    out: list[dict] = []
    for i, m in enumerate(messages):
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = content_string(m.get("content"), f"messages[{i}]")
        calls = m.get("tool_calls") or []
        if not native:
            msg.pop("tool_calls", None)
            if calls:
                sep = "\n" if msg["content"] and not msg["content"].endswith("\n") else ""
                msg["content"] += sep + "\n".join(_hermes(c["function"]["name"], c["function"]["arguments"])
                                                  for c in calls)
            if m.get("role") == "tool":
                msg["content"] = f"<tool_response>\n{msg['content']}\n</tool_response>"
        out.append(msg)
    if tools and not native:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=schemas)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, native


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A reply's Hermes tool calls in OpenAI format, and the text around them (None when empty).
    A block whose JSON is not ``{"name": str, "arguments": ...}`` stays in the text."""
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except (ValueError, RecursionError):
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        args = obj.get("arguments", {})
        kept.append(text[pos: m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers`` (a streamed
    delta holds them back until the next token says)."""
    best = 0
    for mk in markers:
        for k in range(min(len(mk) - 1, len(text)), 0, -1):
            if text.endswith(mk[:k]):
                best = max(best, k)
                break
    return best


def cut_at_stop(ids: list[int], decode: Callable[[list[int]], str], stops: Sequence[str]) -> tuple[list[int], str, bool]:
    """Truncate a completion at the first ``stop`` string: the shortest token prefix whose text
    contains one (found by bisection), and that text cut before the stop string (vLLM's default:
    the stop string is not in the text; its tokens are the last ids). ``(ids, text, stopped)``."""
    text = decode(ids)
    if not stops or not any(s in text for s in stops):
        return ids, text, False
    lo, hi = 1, len(ids)  # decode(ids[:hi]) holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = decode(ids[:hi])
    cut = min(text.find(s) for s in stops if s in text)
    return ids[:hi], text[:cut], True


def render_chat(tokenizer, body: ChatCompletionRequest) -> str:
    """The prompt text of a chat request, as the server renders it (the chat template; tools in the prompt
    unless ``tools_in_prompt`` is false). ApiError 400 when the tokenizer has no template or it fails."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
    tools = ([t.model_dump(exclude_none=True) for t in body.tools]
             if body.uses_tools and body.tools_in_prompt else None)  # fmt: skip
    messages, native = template_messages([m.model_dump(exclude_none=True) for m in body.messages], tools,
                                         str(template))
    try:
        return tokenizer.apply_chat_template(messages, tools=tools if native else None,
                                             add_generation_prompt=body.add_generation_prompt, tokenize=False)
    except Exception as exc:
        raise ApiError(400, f"chat template failed: {exc}", "messages") from exc


def prefix_renderer(tokenizer):
    """``render_prefix(call, n)`` for :class:`~mosaic.capture.sessions.ReconstructionRules`: the ids the server gives the first
    ``n`` chat messages of a recorded call (no generation prompt; the call's tools and tool options)."""
    def render(call, n: int) -> list[int]:
        opts = {k: v for k, v in call.request_params.items() if k in ("tool_choice", "tools_in_prompt")}
        body = ChatCompletionRequest.model_validate({"model": call.model or "model", "messages": call.messages[:n],
                                                     "tools": call.tools or None, "add_generation_prompt": False,
                                                     **opts})  # fmt: skip
        return tokenizer(render_chat(tokenizer, body), add_special_tokens=False)["input_ids"]

    return render
