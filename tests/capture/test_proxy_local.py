"""A proxy embedded beside its upstream in one process: whole calls reach the upstream's app directly."""

from __future__ import annotations

import socket

import openai
import pytest

from mosaic.capture.proxy import ProxyConfig, create_proxy_app
from mosaic.capture.records import load_records
from mosaic.capture.scripted_server import create_scripted_app
from mosaic.serving import ServerThread

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the river?"}]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_whole_calls_go_through_the_upstream_app_and_streams_over_http(tok, tmp_path):
    """With the upstream's app given and nothing listening at its URL, a whole call is answered (through
    the app, in the proxy's event loop) and recorded with the upstream's exact ids; a streamed call still
    goes over HTTP, so here it fails with 502 (and is recorded as failed)."""
    app = create_scripted_app(tok)
    cfg = ProxyConfig(upstream=f"http://127.0.0.1:{_closed_port()}", out_dir=str(tmp_path), retries=0)
    with ServerThread(create_proxy_app(cfg, upstream_app=app)) as px:
        client = openai.OpenAI(base_url=f"{px.url}/rollouts/r1/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="scripted", messages=MSGS)
        assert r.choices[0].message.content.startswith("Echo")
        with pytest.raises(openai.APIStatusError) as err:
            for _ in client.chat.completions.create(model="scripted", messages=MSGS, stream=True):
                pass
        assert err.value.status_code == 502
    calls, _ = load_records(tmp_path)
    whole, streamed = sorted(calls, key=lambda c: c.seq)
    prompt, comp = app.state.log[-1]
    assert not whole.stream and whole.status == 200 and whole.prompt_ids == prompt and whole.completion_ids == comp
    assert len(whole.logprobs) == len(comp) and whole.text == r.choices[0].message.content
    assert streamed.stream and streamed.status == 502 and len(app.state.log) == 1
