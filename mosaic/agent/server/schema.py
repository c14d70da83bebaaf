"""Wire format of the OpenAI-compatible server: request models, errors and response pieces."""

from __future__ import annotations

import json
from typing import Any, Callable, Literal, Union

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator


class BaseCompletionRequest(BaseModel):
    """The fields both endpoints share. Types are strict: ``"stream": "yes"`` or ``"max_tokens": "5"``
    is a 400 naming the field, never read as something else."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what a torch generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    # Accepted at their neutral values (clients send them by default); anything else is refused, not ignored.
    presence_penalty: float = Field(default=0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("is not supported by mosaic serve (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("is not supported by mosaic serve (only empty or null)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 16 or not all(stops)):
            raise ValueError("at most 16 non-empty stop strings")
        return stops or None


class CompletionRequest(BaseCompletionRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message: ``content`` a string, null (an assistant turn with only tool calls) or text parts."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(BaseCompletionRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools_in_prompt: bool = True
    """Extension: ``false`` when the messages already describe the tools (a harness whose system prompt
    documents them in the model's own format): the ``tools`` are not rendered into the prompt, but
    replies are still parsed for tool calls."""

    @property
    def uses_tools(self) -> bool:
        """Whether replies are parsed for tool calls (tools given and ``tool_choice`` not "none")."""
        return bool(self.tools) and self.tool_choice != "none"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def json_response(payload: dict) -> Response:
    """``payload`` (plain JSON types) as an ``application/json`` response, as FastAPI's JSONResponse would write
    it (UTF-8, NaN and infinities refused) without its generic per-value encoder (~2.4 ms per 100-token answer
    with log-probs)."""
    return Response(json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(),
                    media_type="application/json")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": status}})


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(prompt_lens: list[int], completion_lens: list[int]) -> dict[str, int]:
    p, c = sum(prompt_lens), sum(completion_lens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_logprobs(token_str: Callable[[int], str], ids: list[int], lps: list[float], top: int) -> dict:
    tokens = [token_str(t) for t in ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [{s: lp} for s, lp in zip(tokens, lps)] if top > 0 else None}


def chat_logprob(token_str: Callable[[int], str], t: int, lp: float) -> dict:
    s = token_str(t)
    return {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
