"""The OpenAI wire format as the recording proxy needs it: request checks (schema, JSON depth),
errors, upstream fields checked as the records reader will, context-overflow messages, streamed
responses folded into one record, and re-tokenisation for upstreams that return no ids."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from mosaic.capture.records import CallRecord

MAX_JSON_DEPTH = 64
# What vLLM, SGLang, llama.cpp and OpenAI say when a prompt does not fit the model's context.
OVERFLOW = re.compile(r"(?i)maximum context length|context length|context window|max_model_len|"
                       r"prompt is too long|too many tokens|exceeds? the (model'?s? )?(maximum|context)")


def check_upstream_fields(rec: CallRecord) -> None:
    """Token ids and log-probs as the records reader will demand them; an upstream that sent other
    things leaves the record without them and with an error saying so."""
    ids_ok = all(isinstance(x, list) and all(type(t) is int and 0 <= t < 2**31 for t in x)
                 for x in (rec.prompt_ids, rec.completion_ids))
    lps_ok = isinstance(rec.logprobs, list) and all(
        type(v) in (int, float) and math.isfinite(v) and v <= 1e-3 for v in rec.logprobs)
    if not ids_ok:
        rec.prompt_ids, rec.completion_ids = [], []
        rec.error = rec.error or "upstream returned malformed token ids"
    if not lps_ok:
        rec.logprobs = []
    if not isinstance(rec.text, str):
        rec.text = ""
    if not (isinstance(rec.tool_calls, list) and all(isinstance(t, dict) for t in rec.tool_calls)):
        rec.tool_calls = []
    if rec.finish_reason is not None and not isinstance(rec.finish_reason, str):
        rec.finish_reason = str(rec.finish_reason)


def json_depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests lists / objects deeper than ``limit`` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def validate_request(endpoint: str, body: Any) -> None:
    if not isinstance(body, dict):
        raise ApiError(422, f"request body must be a JSON object, got {type(body).__name__}")
    if body.get("n", 1) not in (1, None):
        raise ApiError(422, "field 'n': the recording proxy records one choice per call; use n=1")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(422, "field 'stream' must be a boolean")
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(422, "field 'messages' must be a non-empty list of message objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(422, f"field 'messages[{i}]' must be an object with a string 'role'")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ApiError(422, "field 'tools' must be a list of tool objects")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ApiError(422, "field 'prompt': the recording proxy takes one string prompt per call")
        elif not isinstance(prompt, str):
            raise ApiError(422, "field 'prompt' must be a string")


MAX_TOKENS_LIMIT = 2**31 - 1
"""Largest ``max_tokens`` forwarded (what an int32 holds; vLLM and SGLang take no more)."""


def check_max_tokens(body: dict) -> None:
    """``max_tokens`` / ``max_completion_tokens``, when set, must be an integer in [1, 2**31 - 1]:
    a negative or huge value is refused here (400), not forwarded to fail upstream."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if type(v) is not int or not 1 <= v <= MAX_TOKENS_LIMIT:
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise ApiError(400, f"field {key!r}: {shown} must be an integer in [1, {MAX_TOKENS_LIMIT}]")


_SAMPLING_RANGES = {"temperature": (0.0, None), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
                    "presence_penalty": (None, None), "frequency_penalty": (None, None),
                    "repetition_penalty": (0.0, None)}


def check_sampling(body: dict) -> None:
    """Sampling numbers, when set, must be finite and in range (``temperature`` >= 0, ``top_p`` and
    ``min_p`` in [0, 1], ...): a NaN or infinity (Python's JSON reads ``NaN``) is refused here (400),
    not forwarded upstream and written into the records as a bare ``NaN`` no strict reader parses."""
    for key, (lo, hi) in _SAMPLING_RANGES.items():
        v = body.get(key)
        if v is None:
            continue
        ok = type(v) in (int, float) and math.isfinite(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
        if not ok:
            span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise ApiError(400, f"field {key!r}: {shown} must be a finite number in {span}")


def check_finite(body, where: str = "") -> None:
    """No NaN or infinity anywhere in a request (Python's JSON reads ``NaN``, ``Infinity``, and ``1e400`` as
    infinity): a 400 naming the field, so no bare ``NaN`` reaches the records or the upstream."""
    if isinstance(body, float) and not math.isfinite(body):
        raise ApiError(400, f"field {where or '(body)'!r}: {body!r} is not a finite number (not valid JSON)")
    if isinstance(body, dict):
        for k, v in body.items():
            check_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            check_finite(v, f"{where}[{i}]")


def choice_token_ids(ch: dict[str, Any]) -> list[int] | None:
    """A choice's (or stream delta's) generated ids: vLLM's ``token_ids``, or ``output_ids``."""
    for key in ("token_ids", "output_ids"):
        if isinstance(ch.get(key), list):
            return ch[key]
    return None


def logprob_list(endpoint: str, lp: Any) -> list[float]:
    if not isinstance(lp, dict):
        return []
    if endpoint == "chat":
        return [float(c.get("logprob", 0.0)) for c in lp.get("content") or []]
    return [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]


class StreamAccumulator:
    r"""Collects one streamed response (server-sent events) into the fields of a call record.

    Lines end in ``\n``, ``\r\n`` or ``\r`` (all valid SSE); an event is its ``data:`` lines joined
    by newlines, dispatched at a blank line (or at the end of the stream). A payload that is not
    JSON, or not a chunk, is counted in ``bad`` and skipped: parsing never breaks the relay.
    """

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.buf = b""
        self.data: list[bytes] = []
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_ids: list[int] | None = None
        self.finish: str | None = None
        self.policy_version: int | None = None
        self.done = False
        self.bad = 0

    def feed(self, data: bytes) -> None:
        buf = self.buf + data
        start = 0
        n = len(buf)
        while True:
            cr, lf = buf.find(b"\r", start), buf.find(b"\n", start)
            if cr < 0 and lf < 0:
                break
            if lf >= 0 and (cr < 0 or lf < cr):
                end, nxt = lf, lf + 1
            elif cr == n - 1:
                break  # a \r at the end: wait, a \n may follow in the next chunk
            else:
                end, nxt = cr, cr + 2 if buf[cr + 1: cr + 2] == b"\n" else cr + 1
            self._line(buf[start:end])
            start = nxt
        self.buf = buf[start:]

    def close(self) -> None:
        """The stream ended: a last line or event without its terminator still counts."""
        if self.buf:
            self._line(self.buf.rstrip(b"\r"))
            self.buf = b""
        self._line(b"")

    def _line(self, line: bytes) -> None:
        if not line:
            if self.data:
                payload, self.data = b"\n".join(self.data), []
                try:
                    self._event(payload.strip())
                except Exception:  # noqa: BLE001 - a malformed chunk is counted, never fatal
                    self.bad += 1
            return
        if line.startswith(b"data:"):
            value = line[5:]
            self.data.append(value[1:] if value.startswith(b" ") else value)

    def _event(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            self.bad += 1
            return
        if not isinstance(obj, dict):
            self.bad += 1
            return
        if self.prompt_ids is None and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_ids = obj["prompt_token_ids"]
        self.policy_version = policy_version(obj, self.policy_version)
        for ch in obj.get("choices") or []:
            if ch.get("index", 0) != 0:
                continue
            if self.prompt_ids is None and isinstance(ch.get("prompt_token_ids"), list):
                self.prompt_ids = ch["prompt_token_ids"]
            ids = choice_token_ids(ch)
            if ids is not None:
                self.ids.extend(ids)
            self.logprobs.extend(logprob_list(self.endpoint, ch.get("logprobs")))
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
            if self.endpoint == "chat":
                delta = ch.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
                for tc in delta.get("tool_calls") or []:
                    slot = self.tool_calls.setdefault(int(tc.get("index", 0)), {
                        "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    if tc.get("id"):
                        slot["id"] = tc["id"]
                    fn = tc.get("function") or {}
                    if fn.get("name"):
                        slot["function"]["name"] += fn["name"]
                    if fn.get("arguments"):
                        slot["function"]["arguments"] += fn["arguments"]
            elif isinstance(ch.get("text"), str):
                self.text.append(ch["text"])


def policy_version(obj: dict, default: int | None = None) -> int | None:
    """The ``policy_version`` a response (or chunk) carries (``mosaic serve`` stamps it), else ``default``."""
    v = obj.get("policy_version")
    return v if type(v) is int and 0 <= v < 2**62 else default


def retokenize(rec: CallRecord, tok: Any) -> None:
    """Fill a record's token ids with the model's tokenizer (for upstreams that return none).

    Chat: the prompt is the chat template with the generation prompt; the
    completion is what the template adds for the reply, up to its end-of-turn
    token. Sets ``retokenized``; without a tokenizer sets ``error`` instead.
    """
    if tok is None:
        rec.error = "no token ids: the upstream returned none and the proxy has no tokenizer"
        return
    if rec.endpoint == "chat":
        msgs = [{**m, "content": m.get("content") or ""} for m in rec.messages]
        prompt = list(tok.apply_chat_template(msgs, tools=rec.tools or None, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
        reply = {"role": "assistant", "content": rec.text}
        full = list(tok.apply_chat_template(msgs + [reply], tools=rec.tools or None, tokenize=True,
                                            return_dict=False))
        if full[: len(prompt)] == prompt:
            comp = full[len(prompt):]
            # Drop what the template adds after the end-of-turn token (e.g. a newline).
            eos = tok.eos_token_id
            if eos is not None and eos in comp:
                comp = comp[: comp.index(eos) + 1]
        else:
            comp = tok.encode(rec.text, add_special_tokens=False)
    else:
        prompt = tok.encode(rec.prompt or "", add_special_tokens=False)
        comp = tok.encode(rec.text, add_special_tokens=False)
    rec.prompt_ids, rec.completion_ids, rec.retokenized = prompt, comp, True
    rec.error = None
