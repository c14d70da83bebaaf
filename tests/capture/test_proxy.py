"""The recording proxy with the official openai client, and its behaviour under bad input and faults."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from mosaic.capture.records import RECORDS_FILE, CallRecord, RecordWriter, load_records
from mosaic.cli import main as mosaic_main
from mosaic.serving import ServerThread
from mosaic.trace import TornLineWarning, load_trajectories

REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the river?"}]


def _client(url, rollout="r1", **kw):
    return openai.OpenAI(base_url=f"{url}/rollouts/{rollout}/v1", api_key="sk-test", max_retries=0, **kw)


def _calls(out_dir):
    calls, rewards = load_records(out_dir)
    return calls, rewards


def test_chat_nonstream_records_exact_ids(upstream, make_proxy):
    px = make_proxy(upstream.url)
    r = _client(px.url).chat.completions.create(model="scripted", messages=MSGS)
    assert r.choices[0].message.content.startswith("Echo")
    px.stop()
    (rec,), _ = _calls(px.out_dir)
    prompt, comp = upstream.app.state.log[-1]
    assert rec.rollout_id == "r1" and rec.endpoint == "chat" and not rec.stream
    assert rec.prompt_ids == prompt and rec.completion_ids == comp
    assert len(rec.logprobs) == len(comp) and all(lp < 0 for lp in rec.logprobs)
    assert rec.messages == MSGS and rec.finish_reason == "stop" and not rec.retokenized
    assert rec.text == r.choices[0].message.content
    assert rec.t_start <= rec.t_first <= rec.t_end
    # The proxy asked the upstream for ids and log-probs on the client's behalf.
    fwd = upstream.app.state.calls[-1]
    assert fwd["return_token_ids"] is True and fwd["logprobs"] is True


def test_chat_streaming_with_tool_calls(upstream, make_proxy):
    px = make_proxy(upstream.url)
    tools = [{"type": "function", "function": {"name": "task", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    stream = _client(px.url, "rs").chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Research the river."}], tools=tools, stream=True)
    got = {}
    for ch in stream:
        for tc in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            got.setdefault(tc.index, "")
            got[tc.index] += tc.function.arguments or ""
    assert len(got) == 2 and all("SUBTASK" in json.loads(a)["description"] for a in got.values())
    px.stop()
    (rec,), _ = _calls(px.out_dir)
    prompt, comp = upstream.app.state.log[-1]
    assert rec.stream and rec.prompt_ids == prompt and rec.completion_ids == comp
    assert len(rec.logprobs) == len(comp) and rec.finish_reason == "tool_calls"
    assert [tc["function"]["name"] for tc in rec.tool_calls] == ["task", "task"]
    assert rec.tools == tools


def test_completions_and_header_rollout_id(upstream, make_proxy):
    px = make_proxy(upstream.url)
    c = openai.OpenAI(base_url=f"{px.url}/v1", api_key="x", max_retries=0,
                      default_headers={"X-Mosaic-Rollout": "hdr-7", "X-Mosaic-Task": "t9"})
    r = c.completions.create(model="scripted", prompt="Once upon a time", max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    s = c.completions.create(model="scripted", prompt="Once upon a time", max_tokens=50, stream=True)
    text = "".join(ch.choices[0].text for ch in s)
    assert text.startswith(" echo")
    px.stop()
    recs, _ = _calls(px.out_dir)
    assert [r.rollout_id for r in recs] == ["hdr-7", "hdr-7"]
    assert recs[0].headers["x-mosaic-task"] == "t9"
    for rec, (prompt, comp) in zip(recs, upstream.app.state.log[-2:]):
        assert rec.endpoint == "completions" and rec.prompt == "Once upon a time"
        assert rec.prompt_ids == prompt and rec.completion_ids == comp and len(rec.logprobs) == len(comp)
    assert len(recs[0].completion_ids) == 5


def test_reward_and_export_cli(upstream, make_proxy, tmp_path, capsys):
    px = make_proxy(upstream.url)
    _client(px.url, "ro").chat.completions.create(model="scripted", messages=MSGS)
    r = httpx.post(f"{px.url}/rollouts/ro/reward", json={"reward": 1.0, "ground_truth": "north", "task_id": "q1"})
    assert r.status_code == 200
    bad = httpx.post(f"{px.url}/rollouts/ro/reward", json={"reward": 3})
    assert bad.status_code == 422 and "reward" in bad.json()["error"]["message"]
    px.stop()
    out = tmp_path / "s.parquet"
    assert mosaic_main(["proxy", "export", "--records", px.out_dir, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rollouts"] == 1 and summary["sessions"] == {"main": 1}
    (t,) = load_trajectories(out)
    assert t.id == "ro" and t.task_id == "q1" and t.reward == 1.0 and t.success and t.ground_truth == "north"


def test_a_harness_that_resets_through_the_proxy_rebuilds_as_reset_sessions(upstream, make_proxy, tmp_path, capsys):
    """Issue 30, end to end: a harness that restarts its agent every two calls from the same system prompt, the
    task and the notes so far (written by the harness: a reply carried over verbatim would be a summary, i.e.
    a compaction), talking to the proxy with the official client; `mosaic proxy export` rebuilds
    the rollout as a chain of ``reset`` sessions (not unrelated mains), the last one final, each after-state
    the next session's prompt."""
    px = make_proxy(upstream.url)
    client, notes = _client(px.url, "hma"), []
    system = {"role": "system", "content": "You work in sessions of two steps; your notes carry over."}
    for s in range(3):
        shown = "\n".join(f"- {n}" for n in notes) or "(none)"
        msgs = [system, {"role": "user", "content": f"Task: where is the river?\nNotes:\n{shown}"}]
        for _ in range(2):
            text = client.chat.completions.create(model="scripted", messages=msgs).choices[0].message.content
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
        notes.append(f"session {s}: checked {2 * s + 2} places")  # the harness's notes, not a reply's text
    assert httpx.post(f"{px.url}/rollouts/hma/reward", json={"reward": 1.0, "ground_truth": "north"}).status_code == 200
    px.stop()
    out = tmp_path / "hma.jsonl"
    assert mosaic_main(["proxy", "export", "--records", px.out_dir, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rollouts"] == 1 and summary["sessions"] == {"reset": 3}
    (t,) = load_trajectories(out)
    assert [(x.kind, x.parent, x.edge, x.is_final) for x in t.sessions] == [
        ("reset", None, None, False), ("reset", 0, "continues", False), ("reset", 1, "continues", True)]
    for a, b in zip(t.sessions, t.sessions[1:]):
        assert t.resolve_state(a.state_after) == b.prompt_ids  # the next session's prompt, notes included
        assert t.resolve_state(a.state_before) == a.prompt_ids
    assert "session 1:" in upstream.app.state.calls[-1]["messages"][1]["content"]


def test_retokenized_when_upstream_gives_no_ids(scripted_app_factory, make_proxy, tok, tmp_path, capsys):
    app = scripted_app_factory(token_ids=False)
    with ServerThread(app) as up:
        px = make_proxy(up.url, tokenizer_obj=tok)
        _client(px.url).chat.completions.create(model="scripted", messages=MSGS)
        px.stop()
        (rec,), _ = _calls(px.out_dir)
        prompt, comp = app.state.log[-1]
        assert rec.retokenized and rec.prompt_ids == prompt and rec.completion_ids == comp
        # Without a tokenizer the record says why it has no ids, and export can fix it later.
        px2 = make_proxy(up.url)
        _client(px2.url, "late").chat.completions.create(model="scripted", messages=MSGS)
        px2.stop()
        (rec2,), _ = _calls(px2.out_dir)
        assert rec2.error.startswith("no token ids") and rec2.prompt_ids == []
    out = tmp_path / "late.jsonl"
    assert mosaic_main(["proxy", "export", "--records", px2.out_dir, "--out", str(out),
                        "--tokenizer", str(Path(tok.name_or_path)), "--rule", "include_unrewarded=true"]) == 0
    (t,) = load_trajectories(out)
    assert t.sessions[0].prompt_ids == prompt and t.sessions[0].meta["retokenized"] is True


# --------------------------------------------------------------------------- bad input


def test_bad_requests_get_clear_4xx(upstream, make_proxy):
    os.environ["MOSAIC_TEST_PROXY_KEY"] = "s3cret"
    px = make_proxy(upstream.url, api_key="s3cret", max_body_bytes=4096)
    url = f"{px.url}/v1/chat/completions"
    auth = {"Authorization": "Bearer s3cret"}
    assert httpx.post(url, json={"model": "m", "messages": MSGS}).status_code == 401
    assert httpx.post(url, json={"model": "m", "messages": MSGS}, headers={"Authorization": "Bearer no"}).status_code == 401
    ok = httpx.post(url, json={"model": "m", "messages": MSGS}, headers=auth)
    assert ok.status_code == 200
    r = httpx.post(url, content=b"{not json", headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "m"}, headers=auth)
    assert r.status_code == 422 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "m", "messages": [{"content": "no role"}]}, headers=auth)
    assert r.status_code == 422 and "messages[0]" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "m", "messages": MSGS, "n": 2}, headers=auth)
    assert r.status_code == 422 and "'n'" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}, headers=auth)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(f"{px.url}/v1/completions", json={"model": "m", "prompt": ["a", "b"]}, headers=auth)
    assert r.status_code == 422
    # The official client surfaces the messages too.
    with pytest.raises(openai.AuthenticationError):
        _client(px.url).chat.completions.create(model="m", messages=MSGS)
    px.stop()
    recs, _ = _calls(px.out_dir)
    assert len(recs) == 1  # only the accepted call was forwarded and recorded


def test_upstream_down_is_502_after_bounded_retries(make_proxy, refused_url):
    px = make_proxy(refused_url, retries=2, retry_backoff_s=0.1)
    t0 = time.time()
    r = httpx.post(f"{px.url}/v1/chat/completions", json={"model": "m", "messages": MSGS})
    dt = time.time() - t0
    assert r.status_code == 502 and "after 3 attempt(s)" in r.json()["error"]["message"]
    assert 0.3 <= dt < 10  # waited 0.1 + 0.2 between attempts, then gave up
    px.stop()
    (rec,), _ = _calls(px.out_dir)
    assert rec.status == 502 and "unreachable" in rec.error and not rec.ok


def test_upstream_errors_pass_through_and_are_recorded(upstream, make_proxy):
    px = make_proxy(upstream.url)
    with pytest.raises(openai.BadRequestError, match="scripted failure 400"):
        _client(px.url).chat.completions.create(model="fail-400", messages=MSGS)
    r = httpx.post(f"{px.url}/v1/chat/completions", json={"model": "fail-503", "messages": MSGS, "stream": True})
    assert r.status_code == 503 and "scripted failure 503" in r.text
    assert len(upstream.app.state.calls) == 2  # errors from the upstream itself are not retried
    px.stop()
    recs, _ = _calls(px.out_dir)
    assert [(r.status, r.ok) for r in recs] == [(400, False), (503, False)]
    assert all("scripted failure" in r.error for r in recs)


def test_top_level_proxy_form_is_serve():
    from mosaic.cli import build_parser

    args = build_parser().parse_args(["proxy", "--upstream", "http://127.0.0.1:9", "--out", "d", "--port", "1"])
    assert args.func.__name__ == "_cmd_proxy" and args.upstream == "http://127.0.0.1:9" and args.port == 1
    args = build_parser().parse_args(["proxy", "serve", "--upstream", "http://127.0.0.1:9", "--out", "d"])
    assert args.func.__name__ == "_cmd_serve" and args.host == "127.0.0.1"


def test_upstream_timeout_is_504(scripted_app_factory, make_proxy):
    with ServerThread(scripted_app_factory(delay_s=2.0)) as slow:
        px = make_proxy(slow.url, timeout_s=0.3, retries=1, retry_backoff_s=0.05)
        t0 = time.time()
        r = httpx.post(f"{px.url}/v1/chat/completions", json={"model": "m", "messages": MSGS}, timeout=30)
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        assert time.time() - t0 < 2.0
        px.stop()
    (rec,), _ = _calls(px.out_dir)
    assert rec.status == 504


# --------------------------------------------------------------------------- durability


def test_client_leaving_mid_stream_is_recorded_as_an_error(scripted_app_factory, make_proxy):
    with ServerThread(scripted_app_factory(chunk_delay_s=0.2)) as slow:
        px = make_proxy(slow.url)
        with httpx.stream("POST", f"{px.url}/rollouts/gone/v1/chat/completions",
                          json={"model": "m", "messages": MSGS, "stream": True}) as r:
            first = next(r.iter_raw())
            assert first.startswith(b"data:")
        # The client is gone; the proxy finishes the record once the relay notices.
        deadline = time.time() + 15
        while time.time() < deadline and httpx.get(f"{px.url}/healthz").json()["in_flight"]:
            time.sleep(0.1)
        px.stop()
    (rec,), _ = _calls(px.out_dir)
    assert rec.rollout_id == "gone" and rec.stream and not rec.ok
    assert "stream ended before the last chunk" in rec.error


def test_torn_last_line_is_skipped_and_repaired(upstream, make_proxy, tmp_path):
    out = str(tmp_path / "torn")
    px = make_proxy(upstream.url, out_dir=out)
    _client(px.url).chat.completions.create(model="scripted", messages=MSGS)
    px.stop()
    path = Path(out) / RECORDS_FILE
    with open(path, "ab") as fh:
        fh.write(b'{"type": "call", "schema": "mosaic.capt')  # a crash mid-write
    with pytest.warns(TornLineWarning):
        calls, _ = load_records(out)
    assert len(calls) == 1
    # A restarted proxy cuts the torn tail off (kept in .torn) and appends after it.
    with pytest.warns(TornLineWarning):
        px2 = make_proxy(upstream.url, out_dir=out)
    _client(px2.url).chat.completions.create(model="scripted", messages=MSGS)
    px2.stop()
    calls, _ = load_records(out)
    assert len(calls) == 2 and (Path(out) / (RECORDS_FILE + ".torn")).exists()


def test_cli_proxy_flushes_on_sigterm_and_loses_nothing_on_sigkill(upstream, tmp_path, spawn_server):
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start():
        return spawn_server([sys.executable, "-m", "mosaic.cli", "proxy", "serve", "--upstream", upstream.url,
                             "--out", str(out), "--port", "0"], "/healthz", env=env, timeout=30)

    p, url = start()
    c = _client(url, "cli")
    for _ in range(5):
        c.chat.completions.create(model="scripted", messages=MSGS)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful stop
    log = p.stdout.read().decode()
    p.stdout.close()
    assert "5 record(s) flushed" in log, log
    assert len(load_records(out)[0]) == 5
    p, url = start()  # a restarted proxy appends to the same records
    c = _client(url, "cli")
    for _ in range(3):
        c.chat.completions.create(model="scripted", messages=MSGS)
    p.kill()  # no shutdown at all: every answered call was already flushed
    p.wait(30)
    p.stdout.close()
    assert len(load_records(out)[0]) == 8


def test_record_writer_roundtrip(tmp_path):
    with RecordWriter(tmp_path / "r.jsonl") as w:
        w.write(CallRecord(call_id="a", rollout_id="r", seq=0, endpoint="chat", prompt_ids=[1], completion_ids=[2]))
    (rec,), rewards = load_records(tmp_path / "r.jsonl")
    assert rec.tip() == [1, 2] and rewards == {}
    (tmp_path / "bad.jsonl").write_text('{"schema": "other"}\n')
    from mosaic.capture.records import RecordError

    with pytest.raises(RecordError, match="not a Mosaic capture record"):
        load_records(tmp_path / "bad.jsonl")


def test_proxy_config_validates_fields(tmp_path):
    from mosaic.capture.proxy import ProxyConfig

    for kw, field in [({"upstream": "localhost:8000"}, "upstream"), ({"retries": 50}, "retries"),
                      ({"max_body_bytes": 0}, "max_body_bytes"), ({"pool_shards": 0}, "pool_shards")]:
        with pytest.raises(ValueError, match=field):
            ProxyConfig(**{"upstream": "http://127.0.0.1:1", "out_dir": str(tmp_path), **kw})
