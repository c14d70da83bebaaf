"""The recording proxy's request checks of issue 33: a constant-time token compare, ``max_tokens``
refused at the proxy when it could never be served, and a call naming no rollout recorded in a
bucket that says so."""

from __future__ import annotations

import hmac
from pathlib import Path

import httpx
import pytest

from mosaic.capture.records import NO_ROLLOUT_ID, load_records

MSGS = [{"role": "user", "content": "Where is the river?"}]


def test_the_token_is_compared_in_constant_time(upstream, make_proxy, monkeypatch):
    compared = []
    real = hmac.compare_digest

    def counting(a, b):
        compared.append((a, b))
        return real(a, b)

    import mosaic.capture.proxy as proxy_mod

    monkeypatch.setattr(proxy_mod.hmac, "compare_digest", counting)
    px = make_proxy(upstream.url, api_key="s3cr\u00e9t")  # non-ASCII: compared as the bytes sent
    url = f"{px.url}/v1/chat/completions"
    body = {"model": "m", "messages": MSGS}
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 401
    assert httpx.post(url, json=body).status_code == 401
    ok = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cr\u00e9t".encode()})
    assert ok.status_code == 200, ok.text
    assert len(compared) == 3 and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in compared)


@pytest.mark.parametrize("key, value", [
    ("max_tokens", -5), ("max_tokens", 0), ("max_tokens", 2**64), ("max_tokens", 2**31), ("max_tokens", 2.5),
    ("max_tokens", "16"), ("max_tokens", True), ("max_completion_tokens", -1), ("max_completion_tokens", 10**30),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_max_tokens_that_cannot_be_served_is_a_400_not_forwarded(upstream, make_proxy, key, value, endpoint):
    px = make_proxy(upstream.url)
    path, body = (("/v1/chat/completions", {"model": "m", "messages": MSGS}) if endpoint == "chat"
                  else ("/v1/completions", {"model": "m", "prompt": "Once upon a time"}))
    before = len(upstream.app.state.calls)
    r = httpx.post(px.url + path, json={**body, key: value}, headers={"X-Mosaic-Rollout": "r"})
    assert r.status_code == 400, r.text
    assert key in r.json()["error"]["message"] and "[1, 2147483647]" in r.json()["error"]["message"]
    assert len(upstream.app.state.calls) == before  # never reached the upstream
    ok = httpx.post(px.url + path, json={**body, key: 3}, headers={"X-Mosaic-Rollout": "r"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("raw, key", [
    ('NaN', "temperature"), ('Infinity', "temperature"), ('-0.5', "temperature"), ('"hot"', "temperature"),
    ('1.5', "top_p"), ('NaN', "top_p"), ('-Infinity', "presence_penalty"), ('true', "temperature"),
    ('NaN', "seed"), ('1e400', "seed"), ('NaN', "foo"), ('{"5": NaN}', "logit_bias"), ('{"x": -Infinity}', "metadata"),
])
def test_a_sampling_number_that_is_nan_or_out_of_range_is_a_400_not_forwarded(upstream, make_proxy, raw, key):
    """Python's JSON reads ``NaN``: it used to be forwarded and written into the records as a bare NaN."""
    px = make_proxy(upstream.url)
    before = len(upstream.app.state.calls)
    content = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (key, raw)
    r = httpx.post(px.url + "/v1/chat/completions", content=content,
                   headers={"X-Mosaic-Rollout": "r", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert f"field '{key}" in msg and "finite number" in msg, msg
    assert len(upstream.app.state.calls) == before
    px.stop()
    assert "NaN" not in "".join(p.read_text() for p in Path(px.out_dir).glob("*.jsonl"))


def test_a_call_naming_no_rollout_is_recorded_in_the_named_bucket(upstream, make_proxy):
    px = make_proxy(upstream.url)
    url = f"{px.url}/v1/chat/completions"
    assert httpx.post(url, json={"model": "m", "messages": MSGS}).status_code == 200
    assert httpx.post(url, json={"model": "m", "messages": MSGS}, headers={"X-Mosaic-Rollout": ""}).status_code == 200
    assert httpx.post(url, json={"model": "m", "messages": MSGS}, headers={"X-Mosaic-Rollout": "r7"}).status_code == 200
    px.stop()
    calls, _ = load_records(px.out_dir)
    assert [c.rollout_id for c in calls] == [NO_ROLLOUT_ID, NO_ROLLOUT_ID, "r7"]
    assert NO_ROLLOUT_ID == "no-rollout-id"
