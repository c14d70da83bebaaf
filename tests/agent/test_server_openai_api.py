"""mosaic serve: the OpenAI-compatible app over the tiny model, started in-process with uvicorn."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from _tiny import tiny_model
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest
from mosaic.agent.server import create_app
from mosaic.serving import ServerThread

NAME = "tiny-test"


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def server(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, max_batch_size=16, batch_window_s=0.02)
    with ServerThread(app) as srv:
        yield srv.url, app


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def _greedy(model_tok, ids, n):
    model, tok = model_tok
    return LocalPolicy(model, tok, LocalPolicyConfig(temperature=0)).generate([GenRequest("x", ids, n)])[0]


def test_models(client):
    data = client.get("/v1/models").json()
    assert [m["id"] for m in data["data"]] == [NAME]


def test_completion_token_ids_and_logprobs(client, model_tok):
    _, tok = model_tok
    ids = tok("The capital of Velmora is", add_special_tokens=False)["input_ids"]
    ref = _greedy(model_tok, ids, 8)
    for prompt in (ids, "The capital of Velmora is"):
        r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 8,
                                                 "temperature": 0, "logprobs": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["prompt_token_ids"] == ids
        assert ch["token_ids"] == ref.token_ids
        assert ch["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
        assert ch["text"] == tok.decode(ref.token_ids, skip_special_tokens=True)
        assert ch["finish_reason"] == ref.finish_reason
        assert r.json()["usage"]["completion_tokens"] == len(ref.token_ids)


def test_completion_batch_of_prompts_and_n(client):
    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 4,
                                             "temperature": 1.0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert all(1 <= len(c["token_ids"]) <= 4 for c in choices)


def test_chat_completion(client, model_tok):
    _, tok = model_tok
    messages = [{"role": "user", "content": "Who founded Meridian Works?"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    ref = _greedy(model_tok, ids, 6)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                  "logprobs": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == ids
    ch = body["choices"][0]
    assert ch["token_ids"] == ref.token_ids
    assert ch["message"]["role"] == "assistant"
    assert [x["logprob"] for x in ch["logprobs"]["content"]] == pytest.approx(ref.logprobs, abs=1e-4)


def _sse(client, path, body):
    events = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_streaming_matches_non_streaming(client, model_tok):
    _, tok = model_tok
    ids = tok("Karlen Duvas founded", add_special_tokens=False)["input_ids"]
    ref = _greedy(model_tok, ids, 10)
    events = _sse(client, "/v1/completions", {"prompt": ids, "max_tokens": 10, "temperature": 0,
                                               "stream": True, "return_token_ids": True, "logprobs": 0})
    toks, text, lps, finish, prompt = [], "", [], None, None
    for ev in events:
        for ch in ev["choices"]:
            toks += ch.get("token_ids", [])
            text += ch["text"]
            prompt = ch.get("prompt_token_ids", prompt)
            if ch.get("logprobs"):
                lps += ch["logprobs"]["token_logprobs"]
            finish = ch["finish_reason"] or finish
    assert prompt == ids and toks == ref.token_ids and finish == ref.finish_reason
    assert text == tok.decode(ref.token_ids, skip_special_tokens=True)
    assert lps == pytest.approx(ref.logprobs, abs=1e-4)
    assert events[-1]["usage"]["completion_tokens"] == len(ref.token_ids)


def test_chat_streaming(client):
    events = _sse(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 5, "stream": True, "return_token_ids": True})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "prompt_token_ids" in events[0]
    toks = [t for ev in events for ch in ev["choices"] for t in ch.get("token_ids", [])]
    assert 1 <= len(toks) <= 5
    assert any(ch["finish_reason"] in ("stop", "length") for ev in events for ch in ev["choices"])


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 6], "max_tokens": 4}, "out of range"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "model": "other"}, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/completions", {"prompt": [1, 2], "seed": 99999999999999999999999}, "seed"),  # was a 500 (overflow)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 0.5}, "presence_penalty"),  # was silently ignored
    ("/v1/completions", {"prompt": [1, 2], "logit_bias": {"5": 2.0}}, "logit_bias"),
])
def test_bad_requests_are_4xx_with_message(client, path, body, needle):
    r = client.post(path, json=body)
    assert 400 <= r.status_code < 500
    assert needle in r.json()["error"]["message"]


def test_concurrent_requests_are_batched_and_correct(server, model_tok):
    url, app = server
    _, tok = model_tok
    prompts = [tok(f"The capital of {w} is", add_special_tokens=False)["input_ids"]
               for w in ("Velmora", "Oranthi", "Sel", "Tessaly", "Meridian", "Karlen", "fox", "dog")]
    refs = [_greedy(model_tok, p, 8).token_ids for p in prompts]
    stats = app.state.server.worker.stats
    b0, s0 = stats["batches"], stats["sequences"]
    got: dict[int, list[int]] = {}

    def call(i):
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 8, "temperature": 0,
                                                "return_token_ids": True})
            got[i] = r.json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(prompts))] == refs
    # Requests that arrive while a batch decodes queue up and share the next batch.
    assert stats["sequences"] - s0 == len(prompts) and stats["batches"] - b0 < len(prompts)


def test_openai_client_package_talks_to_it(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")
    out = client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["prompt_token_ids"] == [5, 6, 7]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
