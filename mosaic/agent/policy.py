"""The one protocol every policy implements (local model, OpenAI-compatible server, scripted expert).

The harness owns the token sequences: it sends each active session's *full*
context as token ids and receives the sampled continuation as token ids with
their sampling log-probs. It never decodes and re-encodes a context
(token-in, token-out). A policy may keep per-session state between calls
(a KV cache keyed by ``session_key``); the harness guarantees that a
session's next ``prompt_ids`` extends its previous ``prompt_ids + token_ids``
and calls :meth:`Policy.release` when a session ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

FinishReason = Literal["stop", "length", "error"]


@dataclass
class GenRequest:
    """One assistant turn to sample.

    Attributes:
        session_key: stable id of the session across its turns (for caches).
        prompt_ids: the exact full context the model is fed.
        max_new_tokens: cap on sampled tokens for this turn.
        meta: what a scripted policy may read (task id, session kind, turn index, ...);
            a model-backed policy ignores it.
        context_budget: the requesting session's context budget (prompt + sampled tokens the
            harness allows it before compacting or stopping; the harness sets it from
            :meth:`~mosaic.config.harness.HarnessConfig.budget`); None when the caller has none.
    """

    session_key: str
    prompt_ids: list[int]
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    context_budget: int | None = None


@dataclass
class GenResult:
    """A sampled turn: ``token_ids`` includes the end-of-turn token when ``finish_reason == "stop"``.

    ``logprobs[i]`` is the sampling log-prob of ``token_ids[i]`` under the policy that sampled it
    (after temperature / top-p, as the sampler saw it); 0.0 for a scripted policy.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    error: str | None = None


@runtime_checkable
class Policy(Protocol):
    """Samples assistant turns for a batch of sessions at once."""

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Sample one turn for every request; results in request order."""
        ...

    def release(self, session_key: str) -> None:
        """The session ended: drop any state kept for it (no-op if none)."""
        ...
