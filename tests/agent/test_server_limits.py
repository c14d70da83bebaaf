"""mosaic serve bounds the work of one request by the model's context, not by the body limit (issue 33
item 3): a prompt too long to fit is refused by its characters before any tokenising, and at most
``max_heavy_requests`` large bodies are prepared at once (503 beyond)."""

from __future__ import annotations

import threading

import httpx
import pytest

from _tiny import tiny_model
from mosaic.agent.server import create_app
from mosaic.serving import ServerThread


class CountingTokenizer:
    """The tokenizer, with its calls (tokenising a text) counted; everything else passes through."""

    def __init__(self, tok):
        self.tok, self.texts = tok, []

    def __call__(self, text, *args, **kwargs):
        self.texts.append(len(text))
        return self.tok(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=7)


@pytest.fixture(scope="module")
def served(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name="tiny-limits", default_max_tokens=2,
                     heavy_body_bytes=100_000, max_heavy_requests=1)
    with ServerThread(app) as srv:
        yield srv.url, app


@pytest.fixture()
def counting(served):
    srv = served[1].state.server
    orig, srv.tokenizer = srv.tokenizer, CountingTokenizer(srv.tokenizer)
    try:
        yield srv.tokenizer
    finally:
        srv.tokenizer = orig


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Velmora " * 250_000}]}),
    ("/v1/completions", {"prompt": "Velmora " * 250_000}),
])
def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenising(served, counting, path, body):
    srv = served[1].state.server
    r = httpx.post(served[0] + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert f"context is {srv.max_positions} tokens" in msg and f"at most {srv.max_chars} characters" in msg
    assert counting.texts == []  # the 2 MB text never reached the tokenizer
    ok = httpx.post(served[0] + path, json={"messages": [{"role": "user", "content": "Velmora"}]}
                    if "chat" in path else {"prompt": "Velmora"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert len(counting.texts) == 1 and counting.texts[0] <= srv.max_chars


def test_the_character_bound_never_refuses_a_prompt_that_fits(served, model_tok):
    """Texts at the bound in characters but dense in characters per token: the bound is an upper one."""
    _, tok = model_tok
    srv = served[1].state.server
    longest = max(tok.get_vocab(), key=len)
    assert srv.token_chars == len(longest)
    for text in ("Velmora " * 100, "x" * 5000, "<answer>Oranthi</answer> " * 300):
        n_tok = len(tok(text, add_special_tokens=False)["input_ids"])
        assert len(text) <= n_tok * srv.token_chars


def test_heavy_requests_beyond_the_cap_get_503_while_small_ones_pass(served):
    url, app = served
    srv = app.state.server
    entered, gate = threading.Event(), threading.Event()
    orig = srv._render_chat

    def held(body):
        entered.set()
        assert gate.wait(60)
        return orig(body)

    heavy = {"messages": [{"role": "user", "content": "Velmora " * 20_000}], "max_tokens": 1}
    out = {}
    srv._render_chat = held
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(url + "/v1/chat/completions",
                                                                       json=heavy, timeout=120)))
    try:
        t.start()
        assert entered.wait(60)
        busy = httpx.post(url + "/v1/completions", json={"prompt": "Velmora " * 20_000}, timeout=60)
        assert busy.status_code == 503 and "max_heavy_requests" in busy.json()["error"]["message"]
        assert busy.headers.get("retry-after") == "1"
        small = httpx.post(url + "/v1/completions", json={"prompt": "Velmora", "max_tokens": 1}, timeout=60)
        assert small.status_code == 200, small.text
    finally:
        gate.set()
        t.join(120)
        srv._render_chat = orig
    assert out["r"].status_code == 400 and "characters" in out["r"].text  # 160k characters: over 2047 x 16
    again = httpx.post(url + "/v1/completions", json={"prompt": "Velmora " * 20_000}, timeout=60)
    assert again.status_code == 400  # the slot was given back
