"""The served model in a worker process (``create_app(worker_process=True)``): the same answers as the
in-process thread, the trainer's in-place updates reach it, its prefix cache is readable, and a child that
dies or cannot start fails loudly instead of hanging."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import time

import httpx
import pytest
import torch

from _tiny import tiny_model
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest
from mosaic.agent.server import create_app
from mosaic.agent.server.procworker import CallFailed, ProcessWorker, WorkerStartError
from mosaic.serving import ServerThread

NAME = "tiny-proc"
PROMPT = "The capital of Velmora is"


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=3, initializer_range=0.3)


def _app(model, tok, process: bool):
    return create_app(model, tok, model_name=NAME, max_batch_size=16, batch_window_s=0.02, worker_process=process)


def _asks(c: httpx.Client) -> list:
    """Seeded, streamed, stop-string and concurrent greedy requests; what each answered."""
    out = []
    for stream in (False, True):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 5, "stream": stream,
                "logprobs": 0, "return_token_ids": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"] if not stream
                   else [ln for ln in r.text.splitlines() if '"token_ids"' in ln][-1].split('"token_ids": ')[1])
    r = c.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                        "stop": ["a"], "return_token_ids": True})
    out.append((r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]))

    def greedy(i: int):
        body = {"model": NAME, "prompt": f"{PROMPT} {i}", "max_tokens": 10 + i, "temperature": 0,
                "return_token_ids": True}
        return c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    with cf.ThreadPoolExecutor(6) as ex:
        out.append(list(ex.map(greedy, range(6))))
    return out


def test_the_worker_process_answers_as_the_thread_does(model_tok):
    model, tok = model_tok
    answers = {}
    for process in (False, True):
        app = _app(copy.deepcopy(model), tok, process)
        srv = app.state.server
        assert isinstance(srv.worker, ProcessWorker) == process and srv.worker_fallback is None
        with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
            answers[process] = _asks(c)
            health = c.get("/health").json()
            assert health["worker_process"] is process
            assert health["worker"]["sequences"] == 9  # the child's counters reach the parent
    assert answers[True] == answers[False]


@pytest.mark.parametrize("swap", [False, True])
def test_an_update_reaches_the_worker_process_in_place_or_by_a_new_one(model_tok, swap):
    """An optimizer step writes the shared weights in place: the child reads them, its cache dropped. An update
    that swaps the tensors (``p.data = ...``) would leave it decoding the old ones: a new child serves instead."""
    model, tok = model_tok
    model = copy.deepcopy(model)
    app = _app(model, tok, True)
    srv = app.state.server
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    body = {"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
        before = c.post("/v1/completions", json=body).json()
        old = srv.worker
        assert old.prefix_cache.longest_cached(ids + [1]) is not None
        with srv.weights_update(), torch.no_grad():
            for p in model.parameters():
                if swap:  # new tensors, not shared with the child
                    p.data = p.data + torch.randn_like(p) * 0.3
                else:  # what an optimizer step does
                    p.add_(torch.randn_like(p) * 0.3)
        assert srv.policy_version == 1 and srv.worker_fallback is None
        assert (old.replaced, old.gone, srv.worker is old) == ((True, True, False) if swap else (False, False, True))
        assert srv.worker.prefix_cache.longest_cached(ids + [1]) is None  # the child's cache was dropped
        after = c.post("/v1/completions", json=body).json()
        with srv.weights_update():  # an update that changes nothing keeps the child
            pass
        assert not srv.worker.replaced and srv.policy_version == 2
    fresh = LocalPolicy(copy.deepcopy(model), tok, LocalPolicyConfig(temperature=0)).generate([GenRequest("x", ids, 8)])
    assert after["choices"][0]["token_ids"] == fresh[0].token_ids != before["choices"][0]["token_ids"]
    assert (before["policy_version"], after["policy_version"]) == (0, 1)


def test_the_worker_processs_prefix_cache_reads_as_the_threads(model_tok):
    """What the trainer scores gains off (``prefix_cache.longest_cached``) is the same through the process."""
    model, tok = model_tok
    ids = tok(PROMPT + " and more words here", add_special_tokens=False)["input_ids"]
    hits = []
    for process in (False, True):
        app = _app(copy.deepcopy(model), tok, process)
        with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
            c.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0})
            hits.append(app.state.server.worker.prefix_cache.longest_cached(ids + [3, 4]))
    (n0, kv0), (n1, kv1) = hits
    assert n0 == n1 >= len(ids)
    for (k0, v0), (k1, v1) in zip(kv0, kv1):
        torch.testing.assert_close(k1, k0, atol=0, rtol=0)
        torch.testing.assert_close(v1, v0, atol=0, rtol=0)


def test_a_dead_worker_process_fails_requests_instead_of_hanging(model_tok):
    model, tok = model_tok
    app = _app(copy.deepcopy(model), tok, True)
    worker = app.state.server.worker
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
        ok = c.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 4})
        assert ok.status_code == 200
        worker.process.kill()
        deadline = time.monotonic() + 20
        while worker.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.dead and "exited" in worker.dead
        t0 = time.monotonic()
        for stream in (False, True):
            r = c.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 4, "stream": stream})
            assert r.status_code >= 500 or "error" in r.text, r.text
        assert time.monotonic() - t0 < 10
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "worker_dead"
        assert health.json()["worker"]["sequences"] >= 1  # the last counters known
        with app.state.server.weights_update():  # goes ahead without a child: nothing decodes
            pass
        assert app.state.server.policy_version == 1
        # what a trainer does at its next step: a new worker process, at the same policy version
        assert app.state.server.revive_worker() and not app.state.server.revive_worker()
        assert isinstance(app.state.server.worker, ProcessWorker) and app.state.server.worker is not worker
        r = c.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["policy_version"] == 1
        assert c.get("/health").status_code == 200


def test_requests_queued_while_the_weights_are_held_never_block_the_event_loop(model_tok):
    """The child stops reading its pipe while the trainer holds the weights; what the server sends meanwhile
    (here ~40 requests of 16 x 200 token ids, far more than a pipe buffer) waits in a queue, not on the loop."""
    model, tok = model_tok
    app = _app(copy.deepcopy(model), tok, True)
    srv = app.state.server
    big = [[5 + (i + j) % 300 for j in range(200)] for i in range(16)]
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=120) as c:
        with cf.ThreadPoolExecutor(40) as ex, srv.weights_update():
            futs = [ex.submit(c.post, "/v1/completions", json={"model": NAME, "prompt": big, "max_tokens": 1})
                    for _ in range(40)]
            time.sleep(2.0)  # the requests reach the worker's queue
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            assert time.monotonic() - t0 < 2.0
        assert all(f.result().status_code == 200 for f in futs)


def test_a_control_call_that_fails_in_the_child_is_an_error_there_not_a_dead_child(model_tok):
    model, tok = model_tok
    worker = ProcessWorker(copy.deepcopy(model), tok, LocalPolicyConfig(), device="cpu", max_batch_size=4,
                           batch_window_s=0.0)
    try:
        with pytest.raises(CallFailed, match="no_such_call"):
            worker._call("no_such_call")
        with pytest.raises(CallFailed, match="longest"):
            worker._call("longest", None)
        assert worker.longest_cached([1, 2, 3]) is None and worker.dead is None  # still serving
    finally:
        pid = worker.process.pid
        worker.close()
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pid, 0)


def test_a_worker_process_that_cannot_start_says_why_and_the_server_falls_back(model_tok):
    model, tok = model_tok
    with pytest.raises(WorkerStartError, match="did not start.*(CUDA|cuda)"):  # the child's own error comes back
        ProcessWorker(copy.deepcopy(model), tok, LocalPolicyConfig(), device="cuda", max_batch_size=4,
                      batch_window_s=0.0)
    bad = copy.copy(tok)
    bad.unpicklable = lambda: None  # the tokenizer cannot reach a child
    app = _app(copy.deepcopy(model), bad, True)
    srv = app.state.server
    assert not isinstance(srv.worker, ProcessWorker) and "could not start" in srv.worker_fallback
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
        assert c.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 4}).status_code == 200
        assert c.get("/health").json()["worker_fallback"] == srv.worker_fallback
