"""OpenAIPolicy against our real server (tiny model, in-process uvicorn): ids, logprobs,
concurrency, retries with backoff, timeouts, and errors that never raise."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from _tiny import tiny_model
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policies.openai import OpenAIPolicy, OpenAIPolicyConfig
from mosaic.agent.policy import GenRequest, Policy
from mosaic.agent.server import create_app
from mosaic.serving import ServerThread


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def prompts(model_tok):
    _, tok = model_tok
    words = ["Velmora", "Oranthi", "Sel", "Tessaly", "Meridian", "Karlen", "fox", "dog", "river",
             "city", "tool", "answer"]
    return [tok(f"The capital of {w} is", add_special_tokens=False)["input_ids"] for w in words]


@pytest.fixture(scope="module")
def server(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, batch_window_s=0.02)
    with ServerThread(app) as srv:
        yield srv.url, app


def _reqs(prompts, n=8):
    return [GenRequest(f"s{i}", p, n) for i, p in enumerate(prompts)]


def test_is_a_policy():
    with OpenAIPolicy(base_url="http://127.0.0.1:1") as pol:
        assert isinstance(pol, Policy)


def test_greedy_ids_and_logprobs_match_local(server, model_tok, prompts):
    model, tok = model_tok
    ref = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0)).generate(_reqs(prompts))
    with OpenAIPolicy(base_url=server[0], temperature=0) as pol:
        out = pol.generate(_reqs(prompts))
    for a, b in zip(ref, out):
        assert b.error is None
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_sampled_turns_are_concurrent_and_well_formed(server, prompts):
    url, app = server
    stats = app.state.server.worker.stats
    with OpenAIPolicy(base_url=url + "/v1", temperature=1.0, max_concurrency=12) as pol:
        b0, s0 = stats["batches"], stats["sequences"]
        out = pol.generate(_reqs(prompts, 6))
        b1, s1 = stats["batches"], stats["sequences"]
        again = pol.generate(_reqs(prompts[:2], 6))  # the client and loop are reusable
    assert all(r.error is None and 1 <= len(r.token_ids) == len(r.logprobs) <= 6 for r in out + again)
    assert all(lp <= 0 for r in out for lp in r.logprobs)
    assert s1 - s0 == len(prompts) and b1 - b0 < len(prompts)  # concurrent requests were batched


def test_stop_token_ids_are_honoured(server, model_tok, prompts):
    model, tok = model_tok
    free = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0)).generate(_reqs(prompts[:1], 12))[0]
    stop = free.token_ids[2]
    with OpenAIPolicy(base_url=server[0], temperature=0, stop_token_ids=(stop,)) as pol:
        r = pol.generate(_reqs(prompts[:1], 12))[0]
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_bad_request_is_an_error_result_without_retry(server):
    with OpenAIPolicy(base_url=server[0], max_retries=3, backoff_s=5.0) as pol:
        t0 = time.monotonic()
        out = pol.generate([GenRequest("bad", [10 ** 6], 4), GenRequest("ok", [5, 6, 7], 3),
                            GenRequest("empty", [], 3), GenRequest("zero", [5], 0)])
    assert time.monotonic() - t0 < 4.0  # a 4xx is not retried (backoff would take >= 3.75 s)
    assert out[0].finish_reason == "error" and "out of range" in out[0].error
    assert out[1].error is None and out[1].token_ids
    assert out[2].finish_reason == "error" and out[3].finish_reason == "length"


def test_server_down_gives_errors_after_bounded_retries(refused_url):
    cfg = OpenAIPolicyConfig(base_url=refused_url, max_retries=2, backoff_s=0.05,
                             connect_timeout_s=1.0)
    with OpenAIPolicy(cfg) as pol:
        out = pol.generate(_reqs([[1, 2, 3]] * 3, 4))
    assert all(r.finish_reason == "error" and "after 3 attempts" in r.error for r in out)


def test_transient_5xx_is_retried_then_succeeds(model_tok):
    model, tok = model_tok
    app = create_app(model, tok)
    calls = {"n": 0}

    @app.middleware("http")
    async def flaky(request, call_next):
        if request.url.path.endswith("/completions"):
            calls["n"] += 1
            if calls["n"] <= 2:
                return JSONResponse(status_code=503, content={"error": {"message": "warming up"}})
        return await call_next(request)

    with ServerThread(app) as srv:
        with OpenAIPolicy(base_url=srv.url, model="mosaic-local", max_retries=2, backoff_s=0.05) as pol:
            ok = pol.generate([GenRequest("a", [5, 6, 7], 3)])[0]
        calls["n"] = 0
        with OpenAIPolicy(base_url=srv.url, model="mosaic-local", max_retries=1, backoff_s=0.05) as pol:
            bad = pol.generate([GenRequest("a", [5, 6, 7], 3)])[0]
    assert ok.error is None and ok.token_ids
    assert bad.finish_reason == "error" and "503" in bad.error and "after 2 attempts" in bad.error


def test_read_timeout_is_retried_then_reported():
    """A server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        cfg = OpenAIPolicyConfig(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", model="m",
                                 timeout_s=0.3, max_retries=1, backoff_s=0.05)
        with OpenAIPolicy(cfg) as pol:
            t0 = time.monotonic()
            out = pol.generate([GenRequest("a", [1, 2], 4), GenRequest("b", [3], 4)])
            elapsed = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        sock.close()
    assert all(r.finish_reason == "error" and "ReadTimeout" in r.error for r in out)
    assert 0.6 <= elapsed < 5.0  # two attempts of 0.3 s each, then give up


def test_config_validation():
    with pytest.raises(ValueError, match="max_concurrency"):
        OpenAIPolicyConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="top_p"):
        OpenAIPolicyConfig(top_p=1.5)


# ----------------------------------------------------------------------------- untrusted replies (issue 11)


def _lying_server(chat, bad_reply):
    """A /v1/completions server that answers the 'Osk' task well and the 'Ruo Ces' task with
    ``bad_reply(good_ids, max_tokens) -> (token_ids, token_logprobs)`` (JSON may carry NaN / Infinity)."""
    import json as _json

    tok = chat.tokenizer
    good = list(tok("<answer>Port Osk</answer>", add_special_tokens=False)["input_ids"])
    good.append(tok.convert_tokens_to_ids("<|im_end|>"))
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "liar"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        text = tok.decode(body["prompt"])
        ids, lps = (good, [-0.25] * len(good)) if "Osk" in text else bad_reply(good, body["max_tokens"])
        reply = {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": lps}, "finish_reason": "stop"}]}
        return Response(_json.dumps(reply), media_type="application/json")  # allow_nan: NaN, Infinity

    return app


BAD_REPLIES = {
    "id >= vocab": (lambda g, n: ([*g[:-1], 10 ** 6], [-0.1] * len(g)), "token_ids", "outside [0, "),
    "negative id": (lambda g, n: ([-3, *g[1:]], [-0.1] * len(g)), "token_ids", "token id -3"),
    "string id": (lambda g, n: (["5", *g[1:]], [-0.1] * len(g)), "token_ids", "token id '5'"),
    "too many tokens": (lambda g, n: ([g[0]] * (n + 5), [-0.1] * (n + 5)), "length", "tokens for a turn capped"),
    "NaN log-prob": (lambda g, n: (g, [float("nan")] * len(g)), "logprobs", "log-prob nan"),
    "-inf log-prob": (lambda g, n: (g, [float("-inf")] * len(g)), "logprobs", "log-prob -inf"),
    "+3.0 log-prob": (lambda g, n: (g, [3.0] * len(g)), "logprobs", "log-prob 3.0"),
    "null log-prob": (lambda g, n: (g, [None] * len(g)), "logprobs", "log-prob None"),
    "count mismatch": (lambda g, n: (g, [-0.1] * (len(g) - 1)), "count", "logprobs for"),
}


@pytest.mark.parametrize("case", sorted(BAD_REPLIES))
def test_bad_replies_become_counted_error_results_in_the_harness(case):
    from mosaic.agent.chat import ChatFormat
    from mosaic.agent.harness import Harness, HarnessConfig
    from _doubles import FakeEnv, FakeTask
    from mosaic.agent.tokenizer import train_tokenizer

    make, kind, fragment = BAD_REPLIES[case]
    chat = ChatFormat(train_tokenizer(["<answer>Port Osk</answer> Who is the founder of Ruo Ces? Where is Osk?"] * 30,
                                      vocab_size=400))
    tasks = [FakeTask("t0", "Who is the founder of Ruo Ces?", "Ama Rell"), FakeTask("t1", "Where is Osk?", "Port Osk")]
    with ServerThread(_lying_server(chat, make)) as srv:
        with OpenAIPolicy(base_url=srv.url, vocab_size=len(chat.tokenizer), max_retries=0) as pol:
            trajs = Harness(pol, chat, FakeEnv(), HarnessConfig(mode="single")).run(tasks, group_size=2)
            stats = dict(pol.stats)
    bad = [t for t in trajs if t.task_id == "t0"]
    ok = [t for t in trajs if t.task_id == "t1"]
    assert all(t.end_reason == "answer" and t.reward == 1.0 and "policy" not in t.meta for t in ok)
    for t in bad:
        assert t.end_reason == "policy_error" and t.reward == 0.0
        assert f"invalid reply ({kind})" in t.meta["error"] and fragment in t.meta["error"], t.meta["error"]
        assert t.meta["policy"]["invalid_replies"] == 1 and fragment in t.meta["policy"]["invalid_reply_reasons"][0]
        assert t.sessions[0].completion_ids == [] or all(x <= 0 for x in t.sessions[0].logprobs)
    assert stats == {"invalid_replies": 2, f"invalid_reply/{kind}": 2}


def test_vocab_size_is_validated():
    with pytest.raises(ValueError, match="vocab_size"):
        OpenAIPolicyConfig(vocab_size=0)
