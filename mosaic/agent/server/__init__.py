"""An OpenAI-compatible HTTP server over a local ``transformers`` model (embedded or SmolLM2).

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (``prompt`` as text or as a
token-id list, or a list of either, like vLLM), ``POST /v1/chat/completions``
(``messages`` rendered with the tokenizer's chat template), each streaming (SSE)
or not. Token-in, token-out extensions as in vLLM: ``return_token_ids: true`` adds
``prompt_token_ids`` and per-choice ``token_ids``; ``stop_token_ids`` adds end ids.

What agent harnesses send is accepted: ``content`` null or a list of text parts, assistant
``tool_calls`` and ``tool`` messages in the history, ``tools`` (offered to the model in the
Hermes / Qwen format unless the chat template takes them itself) with replies parsed into
OpenAI ``tool_calls`` (``finish_reason: "tool_calls"``, streamed too), and ``stop`` strings
(the text ends before the stop string, the ids end with the tokens that completed it; the
worker ends that sequence's decoding there). Types are strict (``"stream": "yes"``
is a 400). Bodies over ``max_body_bytes`` get 413; ``api_key`` requires a bearer token on
every route but ``/health``; parsing, templating and tokenising run off the event loop
(:mod:`.textops` holds the text work).

Concurrency: one worker thread owns the model. Requests queue up; the worker
takes everything waiting (up to ``max_batch_size`` sequences), groups it by
sampling parameters and decodes each group as one batch with
:class:`~mosaic.agent.policies.local.LocalPolicy`. So concurrent requests are
batched, and the model is never touched from two threads at once.

Batching is continuous (``continuous_batching=True``, the default, for full-attention models): a
request that arrives while a batch decodes, with the batch's sampling parameters and no seed, joins
it at the next step (prefilled, then laid out beside the live rows), and each request's result is
sent as soon as its last sequence finishes, not when the batch ends. Requests with other sampling
parameters wait for the next batch; while a trainer waits to change the weights, nothing joins.
Through ``bench/harness.py`` it took the served batches from ~3 sequences to ~10-17 (docs/speed.md).

Log-probs are those of :class:`LocalPolicy`: the sampling log-prob of each token
under the processed (temperature / top-p) distribution; ``top_logprobs`` lists only
the sampled token (alternatives are not computed).

Modules: :mod:`.schema` (request models, errors, response pieces), :mod:`.textops` (messages,
tool calls, stop strings), :mod:`.worker`
(the batching model thread), :mod:`.app` (the FastAPI app and its handlers),
:mod:`.stream` (server-sent events).
"""

from mosaic.agent.server.app import create_app

__all__ = ["create_app"]
