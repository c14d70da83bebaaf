"""mosaic serve as a real agent harness meets it (issue 12): a body limit, tokenisation off the event
loop, an optional bearer token, strict types, content null / parts, tools answered with parsed
``tool_calls`` (Hermes in, OpenAI out), and ``stop`` strings.

Where the reply's text matters, the model's sampler is replaced by a script (the tokens a model
would sample), so the server's own work — rendering, parsing, truncating, framing — is what is
tested; the model path itself is covered by test_server_openai_api.py.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from _tiny import tiny_model
from mosaic.agent.policy import GenResult
from mosaic.agent.server import create_app
from mosaic.serving import ServerThread

NAME = "tiny-harness"
MSGS = [{"role": "user", "content": "What is the capital of Velmora?"}]
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the corpus.",
                                           "parameters": {"type": "object",
                                                          "properties": {"query": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=5)


@pytest.fixture(scope="module")
def served(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, max_batch_size=8, batch_window_s=0.01,
                     default_max_tokens=8, api_key="s3cret", max_body_bytes=64 * 1024)
    with ServerThread(app) as srv:
        yield srv.url, app


@pytest.fixture()
def client(served):
    with httpx.Client(base_url=served[0], timeout=60, headers={"Authorization": "Bearer s3cret"}) as c:
        yield c


class Script:
    """Stands in for the sampler: each request gets the ids of ``reply`` (then end-of-turn), streamed
    token by token through ``on_step`` like the real one."""

    def __init__(self, app, tok, reply: str):
        self.policy = app.state.server.policy
        self.ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        self.prompts: list[list[int]] = []

    def __enter__(self):
        self.orig = self.policy.generate_with

        def generate_with(reqs, *, on_step=None, **_):
            self.prompts += [list(r.prompt_ids) for r in reqs]
            if on_step is not None:
                for k, t in enumerate(self.ids):
                    on_step(list(range(len(reqs))), [t] * len(reqs), [-0.5] * len(reqs))
            return [GenResult(list(self.ids), [-0.5] * len(self.ids), "stop") for _ in reqs]

        self.policy.generate_with = generate_with
        return self

    def __exit__(self, *exc):
        self.policy.generate_with = self.orig


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# --------------------------------------------------------------------------- fault 8


def test_bearer_token_guards_every_route_but_health(served):
    url, _ = served
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and "bearer" in r.json()["error"]["message"]
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == NAME


def test_body_limit_is_413_with_or_without_a_length(client):
    big = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i: i + 8192]

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/health").status_code == 200


def test_tokenisation_runs_off_the_event_loop(served, client):
    """While one large request's prompt is being rendered and tokenised, /health and other requests are
    answered: the render is held inside its worker thread until /health has come back (every body counts
    as large here: ``inline_body_bytes`` 0)."""
    _, app = served
    srv = app.state.server
    srv.inline_body_bytes = 0
    entered, gate = threading.Event(), threading.Event()
    orig = srv._render_chat

    def held(body):
        entered.set()
        assert gate.wait(30)
        return orig(body)

    srv._render_chat = held
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", client.post(
        "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})))
    try:
        t.start()
        assert entered.wait(30)
        assert client.get("/health", timeout=10).status_code == 200
        assert client.get("/v1/models", timeout=10).status_code == 200
    finally:
        gate.set()
        srv._render_chat = orig
        srv.inline_body_bytes = 32 * 1024
        t.join(60)
    assert out["r"].status_code == 200


def test_small_bodies_answer_on_the_loop_as_in_a_worker_thread(served, client):
    """A body under ``inline_body_bytes`` is parsed, tokenised and answered on the event loop: the same
    seeded request gets the same answer (text, ids, log-probs, usage) as when every step runs in a worker
    thread, and the answer is plain JSON."""
    srv = served[1].state.server
    body = {"messages": MSGS, "max_tokens": 6, "seed": 11, "temperature": 1.0, "logprobs": True,
            "return_token_ids": True}
    got = {}
    for inline in (32 * 1024, 0):
        srv.inline_body_bytes = inline
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        got[inline] = {k: v for k, v in r.json().items() if k not in ("id", "created")}
    srv.inline_body_bytes = 32 * 1024
    assert got[0] == got[32 * 1024] and got[0]["choices"][0]["token_ids"]


@pytest.mark.parametrize("field, value", [
    ("stream", "yes"), ("stream", 1), ("max_tokens", "5"), ("max_tokens", 2.5), ("temperature", "1"),
    ("logprobs", 1), ("return_token_ids", "true"), ("n", True), ("stop", 3), ("seed", "7"),
])
def test_types_are_strict(client, field, value):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udfff there"}], "max_tokens": 3}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}], "stream": true}'),
    ("/v1/completions", '{"prompt": "hi \\udfff", "max_tokens": 3}'),
])
def test_lone_surrogates_are_a_400_not_a_500(client, path, body):
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_ints_are_fine_where_floats_are_asked(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "temperature": 0, "top_p": 1, "max_tokens": 2})
    assert r.status_code == 200


# --------------------------------------------------------------------------- fault 9


def test_content_null_and_text_parts_are_accepted(client, model_tok):
    _, tok = model_tok
    msgs = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "Velmora?"}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Velmora"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Oranthi is the capital."}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = tok.decode(r.json()["prompt_token_ids"])
    assert "Capital of Velmora?" in prompt and "Be brief." in prompt
    assert '<tool_call>{"name": "search", "arguments": {"query": "Velmora"}}</tool_call>' in prompt
    assert "<tool_response>\nOranthi is the capital.\n</tool_response>" in prompt
    bad = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert bad.status_code == 400 and "only text parts" in bad.json()["error"]["message"]


REPLY = 'Let me search.\n<tool_call>{"name": "search", "arguments": {"query": "Velmora capital"}}</tool_call>'


def test_tools_are_offered_and_tool_calls_parsed(served, client, model_tok):
    _, app = served
    _, tok = model_tok
    with Script(app, tok, REPLY) as script:
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "return_token_ids": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Let me search."
    (tc,) = ch["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["function"]["name"] == "search"
    assert json.loads(tc["function"]["arguments"]) == {"query": "Velmora capital"}
    assert ch["token_ids"] == script.ids  # the ids are what was sampled, untouched
    prompt = tok.decode(script.prompts[-1])
    assert "<tools>" in prompt and '"name": "search"' in prompt and "<tool_call>" in prompt
    # tools_in_prompt false (the messages document the tools): the prompt is the messages alone, and
    # the reply is still parsed for tool calls
    with Script(app, tok, REPLY) as script:
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tools_in_prompt": False})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["tool_calls"][0]["function"]["name"] == "search"
    bare = script.prompts[-1]
    with Script(app, tok, REPLY) as script:
        client.post("/v1/chat/completions", json={"messages": MSGS})
    assert bare == script.prompts[-1] and "<tools>" not in tok.decode(bare)
    # tool_choice "none": no tools offered, nothing parsed
    with Script(app, tok, REPLY):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none"})
    ch = r.json()["choices"][0]
    assert "tool_calls" not in ch["message"] and "<tool_call>" in ch["message"]["content"]


def test_streamed_tool_calls_in_openai_format(served, client, model_tok):
    _, app = served
    _, tok = model_tok
    with Script(app, tok, REPLY):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "stream": True})
    events = _sse(r)
    text = "".join(ch["delta"].get("content") or "" for ev in events for ch in ev["choices"])
    assert text.strip() == "Let me search." and "<tool" not in text
    calls = [tc for ev in events for ch in ev["choices"] for tc in ch["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["search"] and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "Velmora capital"}
    assert [ch["finish_reason"] for ev in events for ch in ev["choices"] if ch["finish_reason"]] == ["tool_calls"]


def test_openai_client_reads_the_tool_calls(served, model_tok):
    openai = pytest.importorskip("openai")
    url, app = served
    _, tok = model_tok
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    with Script(app, tok, REPLY):
        m = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS).choices[0].message
    assert m.tool_calls[0].function.name == "search"
    assert json.loads(m.tool_calls[0].function.arguments) == {"query": "Velmora capital"}


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_reply(served, client, model_tok, stream):
    _, app = served
    _, tok = model_tok
    with Script(app, tok, "The capital is Oranthi. END of the answer") as script:
        r = client.post("/v1/completions", json={"prompt": "Velmora", "stop": ["END", "never"], "stream": stream,
                                                 "return_token_ids": True})
    assert r.status_code == 200, r.text
    if stream:
        events = _sse(r)
        text = "".join(ch["text"] for ev in events for ch in ev["choices"])
        ids = [t for ev in events for ch in ev["choices"] for t in ch.get("token_ids") or []]
        finish = [ch["finish_reason"] for ev in events for ch in ev["choices"] if ch["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        ch = r.json()["choices"][0]
        text, ids, finish, usage = ch["text"], ch["token_ids"], [ch["finish_reason"]], r.json()["usage"]
    assert text == "The capital is Oranthi. " and finish == ["stop"]
    assert ids == script.ids[: len(ids)] and len(ids) < len(script.ids)
    assert "END" in tok.decode(ids) and "END" not in tok.decode(ids[:-1])
    assert usage["completion_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_real_models_decoding_early(served, client, model_tok, stream):
    _, app = served
    _, tok = model_tok
    req = {"prompt": "The capital of Velmora is", "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["token_ids"]
    pieces = [tok.decode(full[: k + 1]) for k in range(len(full))]
    k = next(k for k in range(3, len(full)) if pieces[k].strip() and pieces[k] != pieces[k - 1])
    stop = pieces[k][len(pieces[k - 1]):].strip() or pieces[k][-1]
    want = next(n for n in range(1, len(full) + 1) if stop in tok.decode(full[:n]))
    assert want < len(full)
    stats = app.state.server.worker.stats
    before = stats["stop_string_ends"]
    r = client.post("/v1/completions", json={**req, "stop": [stop], "stream": stream})
    if stream:
        events = _sse(r)
        ids = [t for ev in events for ch in ev["choices"] for t in ch.get("token_ids") or []]
        text = "".join(ch["text"] for ev in events for ch in ev["choices"])
        finish = [ch["finish_reason"] for ev in events for ch in ev["choices"] if ch["finish_reason"]][0]
    else:
        ch = r.json()["choices"][0]
        ids, text, finish = ch["token_ids"], ch["text"], ch["finish_reason"]
    assert ids == full[:want] and finish == "stop" and stop not in text
    assert text == tok.decode(full[:want])[: tok.decode(full[:want]).find(stop)]
    assert stats["stop_string_ends"] == before + 1  # the model stopped there, not at max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_recording_proxy_in_front_of_serve_records_the_tool_calls(served, model_tok, tmp_path, stream):
    """The whole chain a harness uses: openai client → recording proxy → mosaic serve with tools."""
    openai = pytest.importorskip("openai")
    from mosaic.capture.proxy import ProxyConfig, create_proxy_app
    from mosaic.capture.records import load_records

    url, app = served
    _, tok = model_tok
    cfg = ProxyConfig(upstream=url, out_dir=str(tmp_path), upstream_api_key="s3cret")
    with Script(app, tok, REPLY) as script, ServerThread(create_proxy_app(cfg)) as px:
        client = openai.OpenAI(base_url=f"{px.url}/rollouts/r1/v1", api_key="x", max_retries=0)
        if stream:
            calls = {}
            for ch in client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, stream=True):
                for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                    calls[tc.index] = tc.function
            (fn,) = calls.values()
        else:
            fn = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS).choices[0].message.tool_calls[0].function
        assert fn.name == "search" and json.loads(fn.arguments) == {"query": "Velmora capital"}
        prompt = script.prompts[-1]
    (rec,), _ = load_records(tmp_path)
    assert rec.ok and rec.stream == stream and rec.finish_reason == "tool_calls"
    assert rec.prompt_ids == prompt and rec.completion_ids == script.ids and len(rec.logprobs) == len(script.ids)
    assert [tc["function"]["name"] for tc in rec.tool_calls] == ["search"]
