"""The recording proxy under hostile input and upstream faults (issue 12): no 500 and no lost record
for any body, export that never appends, no re-sent generation, one deadline, any SSE framing,
identity encoding, and a context overflow that keeps its prompt."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mosaic.capture.records import RewardRecord, load_records
from mosaic.cli import main as mosaic_main
from mosaic.serving import ServerThread
from mosaic.capture.scripted import Renderer
from mosaic.trace import load_trajectories

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the river?"}]


def _post(url, body, **kw):
    """POST a JSON text exactly as given (``json.dumps`` escapes lone surrogates as ``\\udfff``)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=data, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=30, **kw)


def _drain(px):
    deadline = time.time() + 10
    while time.time() < deadline and httpx.get(f"{px.url}/healthz").json()["in_flight"]:
        time.sleep(0.05)
    return httpx.get(f"{px.url}/healthz").json()


# --------------------------------------------------------------------------- fault 5: any body


@pytest.mark.parametrize("stream", [False, True])
def test_lone_surrogates_are_made_safe_where_they_enter_and_counted(upstream, make_proxy, stream, tmp_path, capsys):
    # issue 33: a lone surrogate that came through a reward POST crashed `mosaic view` and `proxy export`
    # to Parquet (UnicodeEncodeError). Now the proxy makes every text safe on arrival (U+FFFD, as the
    # harness does), forwards it so, and counts it on the record.
    px = make_proxy(upstream.url)
    body = {"model": "m\udfff", "messages": [{"role": "user", "content": "river \udfff \ud800 é"}], "stream": stream,
            "user": "\udc80"}
    r = _post(f"{px.url}/rollouts/sur/v1/chat/completions", body)
    assert r.status_code == 200 and r.content
    r = _post(f"{px.url}/rollouts/sur/reward", {"reward": 1.0, "answer": "\udfff", "ground_truth": "x\ud800",
                                                  "meta": {"k\ud800": "v"}})
    assert r.status_code == 200
    health = _drain(px)
    assert health["in_flight"] == 0 and health["records"] == 2 and health["write_errors"] == 0
    px.stop()
    raw = open(f"{px.out_dir}/records.jsonl", encoding="utf-8").read()
    assert "\\ud" not in raw and "\\udfff" not in raw  # nothing unsafe written
    (rec,), rewards = load_records(px.out_dir)
    assert rec.ok and rec.messages[0]["content"] == "river \ufffd \ufffd é" and rec.model == "m\ufffd"
    assert rec.request_params["user"] == "\ufffd" and rec.sanitized_text == 3  # model, content, user
    assert rec.prompt_ids == upstream.app.state.log[-1][0]
    rw = rewards["sur"]
    assert (rw.answer, rw.ground_truth, rw.meta, rw.sanitized_text) == ("\ufffd", "x\ufffd", {"k\ufffd": "v"}, 3)
    for suffix in (".parquet", ".jsonl"):
        out = tmp_path / f"sur{suffix}"
        assert mosaic_main(["proxy", "export", "--records", px.out_dir, "--out", str(out)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sanitized_text"] == 6
        [t] = load_trajectories(out)
        assert t.answer == "\ufffd" and t.ground_truth == "x\ufffd"


def test_deeply_nested_json_is_a_400(upstream, make_proxy):
    px = make_proxy(upstream.url)
    for depth in (100, 100_000):
        nested = "[" * depth + "]" * depth
        r = _post(f"{px.url}/v1/chat/completions",
                  f'{{"model": "m", "messages": {json.dumps(MSGS)}, "x": {nested}}}'.encode())
        assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
    r = _post(f"{px.url}/rollouts/x/reward", ("[" * 5000 + "]" * 5000).encode())
    assert r.status_code == 400


def test_integers_too_long_to_parse_are_a_400_on_every_route(upstream, make_proxy):
    px = make_proxy(upstream.url)
    huge = "9" * 5000  # Python refuses to convert integers of more than 4,300 digits
    for path, body in (("/rollouts/x/v1/chat/completions", f'{{"model": "m", "messages": {json.dumps(MSGS)}, "max_tokens": {huge}}}'),
                       ("/rollouts/x/v1/completions", f'{{"model": "m", "prompt": "hi", "max_tokens": {huge}}}'),
                       ("/rollouts/x/reward", f'{{"reward": {huge}}}')):
        r = _post(f"{px.url}{path}", body.encode())
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], (path, r.text)


_chars = st.characters(codec=None, categories=None, exclude_categories=())  # lone surrogates included
_text = st.text(_chars, max_size=12)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), _text)
_json = st.recursive(_scalar, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(_text, kids, max_size=4)), max_leaves=12)
_content = st.one_of(_text, st.none(), _json,
                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                     "text": st.one_of(_text, _json)}), max_size=3))
_message = st.one_of(_json, st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), _text)},
    optional={"content": _content, "tool_calls": _json, "name": _json}))
def _with_extra(fixed):
    """A fixed-keys body plus a few arbitrary keys (the fixed ones win)."""
    return st.tuples(fixed, st.dictionaries(_text, _json, max_size=2)).map(lambda t: {**t[1], **t[0]})


_chat = _with_extra(st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(_message, min_size=1, max_size=4), _json)},
    optional={"model": _json, "stream": st.one_of(st.booleans(), _json), "tools": _json,
              "n": st.one_of(st.just(1), _json), "max_tokens": st.one_of(st.integers(1, 40), _json),
              "temperature": _json}))
_completion = _with_extra(st.fixed_dictionaries(
    {"prompt": st.one_of(_text, st.lists(_text, max_size=2), _json)},
    optional={"stream": st.one_of(st.booleans(), _json), "max_tokens": st.one_of(st.integers(1, 20), _json)}))
_plain_chat = st.fixed_dictionaries(  # well-formed, odd text: most reach the upstream
    {"model": st.just("m"), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user"]), "content": _text}), min_size=1, max_size=3)},
    optional={"stream": st.booleans(), "max_tokens": st.integers(1, 30)})
_body = st.one_of(
    st.tuples(st.just("chat"), _plain_chat),
    st.tuples(st.just("chat"), _chat), st.tuples(st.just("completions"), _completion),
    st.tuples(st.sampled_from(["chat", "completions", "reward"]), _json),
    st.tuples(st.just("reward"), _with_extra(st.fixed_dictionaries(
        {"reward": st.one_of(st.floats(0, 1), _json)}, optional={"answer": _json, "meta": _json}))),
    st.tuples(st.sampled_from(["chat", "reward"]), st.binary(max_size=40)),
)
FUZZ_EXAMPLES = 300


def test_fuzzed_bodies_never_500_and_every_answered_call_has_one_record(upstream, make_proxy):
    """Hypothesis drives arbitrary bodies (any JSON, lone surrogates, wrong types, raw bytes, streams)
    through the proxy: nothing is a 5xx, and each call it answered after forwarding has exactly one
    record, which reads back (calls the proxy refused itself, 4xx, have none)."""
    px = make_proxy(upstream.url)
    sent: list[tuple[str, str, int]] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=_body)
    def one(case):
        kind, body = case
        rid = f"fz{len(sent)}"
        url = {"chat": f"{px.url}/rollouts/{rid}/v1/chat/completions",
               "completions": f"{px.url}/rollouts/{rid}/v1/completions",
               "reward": f"{px.url}/rollouts/{rid}/reward"}[kind]
        r = _post(url, body)
        assert r.status_code < 500, (r.status_code, r.text[:300], body)
        if r.status_code >= 400:  # the proxy's own OpenAI error, or the upstream's passed through
            j = r.json()
            assert "message" in (j.get("error") or j)
        sent.append((rid, kind, r.status_code))

    forwarded_before = len(upstream.app.state.calls)
    one()
    assert _drain(px)["in_flight"] == 0
    px.stop()
    calls, rewards = load_records(px.out_dir)
    per = {}
    for c in calls:
        per[c.rollout_id] = per.get(c.rollout_id, 0) + 1
    assert all(n == 1 for n in per.values())
    assert len(calls) == len(upstream.app.state.calls) - forwarded_before  # each forwarded call, once
    for rid, kind, status in sent:
        if kind == "reward":
            assert (rid in rewards) == (status == 200)
        elif status == 200:
            assert per.get(rid) == 1, rid
    answered = sum(1 for _, k, s in sent if k != "reward" and s == 200)
    print(f"fuzz: {len(sent)} bodies, {len(calls)} forwarded and recorded, {answered} answered 200")
    assert answered >= FUZZ_EXAMPLES // 50  # not all rejected


# --------------------------------------------------------------------------- fault 6: export


def test_export_refuses_an_existing_file_and_replaces_it_whole_with_force(upstream, make_proxy, capsys):
    px = make_proxy(upstream.url)
    for rid in ("a", "b", "c"):
        _post(f"{px.url}/rollouts/{rid}/v1/chat/completions", {"model": "m", "messages": MSGS})
        _post(f"{px.url}/rollouts/{rid}/reward", {"reward": 1.0})
    px.stop()
    # docs/capture.md's layout: the export sits in the records directory; the next export reads past it.
    out = f"{px.out_dir}/sessions.jsonl"
    assert mosaic_main(["proxy", "export", "--records", px.out_dir, "--out", out]) == 0
    assert mosaic_main(["proxy", "export", "--records", px.out_dir, "--out", out]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    for _ in range(2):
        assert mosaic_main(["proxy", "export", "--records", px.out_dir, "--out", out, "--force"]) == 0
    with open(out) as fh:
        assert len(fh.read().splitlines()) == 3
    assert sorted(t.id for t in load_trajectories(out)) == ["a", "b", "c"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rollouts"] == 3


# --------------------------------------------------------------------------- fault 7: retries, deadline


def test_a_read_timeout_is_never_resent_and_the_call_has_one_deadline(scripted_app_factory, make_proxy):
    app = scripted_app_factory(delay_s=3.0)
    with ServerThread(app) as slow:
        px = make_proxy(slow.url, timeout_s=0.6, retries=2, retry_backoff_s=0.05)
        t0 = time.time()
        r = _post(f"{px.url}/v1/chat/completions", {"model": "m", "messages": MSGS})
        took = time.time() - t0
        assert r.status_code == 504 and "not re-sent" in r.json()["error"]["message"]
        assert took < 2.0
        time.sleep(0.2)
        assert len(app.state.calls) == 1  # one generation started upstream, not retries + 1
        px.stop()
    (rec,), _ = load_records(px.out_dir)
    assert rec.status == 504 and not rec.ok


def test_connect_failures_are_retried_within_the_deadline(make_proxy, refused_url):
    px = make_proxy(refused_url, retries=3, retry_backoff_s=0.4, timeout_s=0.5)
    t0 = time.time()
    r = _post(f"{px.url}/v1/chat/completions", {"model": "m", "messages": MSGS})
    assert r.status_code in (502, 504) and time.time() - t0 < 1.5  # backoff 0.4 + 0.8 would pass 0.5 s
    assert "2 attempt(s)" in r.json()["error"]["message"]
    px.stop()


def test_slow_stream_is_cut_at_the_deadline(scripted_app_factory, make_proxy):
    with ServerThread(scripted_app_factory(chunk_delay_s=0.3)) as slow:
        px = make_proxy(slow.url, timeout_s=0.8)
        t0 = time.time()
        with httpx.stream("POST", f"{px.url}/rollouts/s/v1/chat/completions", timeout=30,
                          json={"model": "m", "messages": MSGS, "stream": True}) as s:
            s.read()
        assert time.time() - t0 < 3.0
        _drain(px)
        px.stop()
    (rec,), _ = load_records(px.out_dir)
    assert not rec.ok and "deadline" in rec.error


# --------------------------------------------------------------------------- fault 9: SSE, encoding


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_streams_with_crlf_or_cr_framing_are_recorded(scripted_app_factory, make_proxy, newline):
    app = scripted_app_factory(sse_newline=newline)
    with ServerThread(app) as up:
        px = make_proxy(up.url)
        with httpx.stream("POST", f"{px.url}/rollouts/crlf/v1/chat/completions", timeout=30,
                          json={"model": "m", "messages": MSGS, "stream": True}) as s:
            raw = s.read()
        assert newline.encode() * 2 in raw
        _drain(px)
        px.stop()
    (rec,), _ = load_records(px.out_dir)
    prompt, comp = app.state.log[-1]
    assert rec.ok and rec.prompt_ids == prompt and rec.completion_ids == comp and rec.finish_reason == "stop"
    assert len(rec.logprobs) == len(comp)


def test_upstream_is_asked_for_identity_encoding(upstream, make_proxy):
    px = make_proxy(upstream.url)
    _post(f"{px.url}/v1/chat/completions", {"model": "m", "messages": MSGS}, headers={"accept-encoding": "gzip"})
    assert upstream.app.state.upstream.headers[-1]["accept-encoding"] == "identity"
    px.stop()


# --------------------------------------------------------------------------- pattern 4: overflow


def test_context_overflow_is_recorded_with_its_prompt_ids(scripted_app_factory, make_proxy, tok):
    app = scripted_app_factory(max_context=40)
    long = [{"role": "user", "content": "Where is the river? " * 10}]
    with ServerThread(app) as up:
        px = make_proxy(up.url)
        r = _post(f"{px.url}/rollouts/o/v1/chat/completions", {"model": "m", "messages": long, "max_tokens": 8})
        assert r.status_code == 400 and "maximum context length" in r.json()["message"]
        px.stop()
    (rec,), _ = load_records(px.out_dir)
    assert rec.context_overflow and not rec.ok and rec.status == 400 and not rec.retokenized
    assert rec.prompt_ids == Renderer(tok).chat_prompt(long, None) and rec.completion_ids == []


def test_records_read_back_with_surrogates_are_made_safe_and_counted(tmp_path):
    # a records file written before issue 33 (lone surrogates escaped as "\udfff"): the readers make
    # the texts safe and count them in their report
    from mosaic.capture.records import RecordWriter, read_records

    w = RecordWriter(tmp_path / "r.jsonl")
    w.write(RewardRecord("x\udfff", 0.5, answer="\ud800é"))
    w.close()
    _, rewards, report = read_records(tmp_path / "r.jsonl")
    assert rewards["x\ufffd"].answer == "\ufffdé" and report.sanitized_text == 2
    assert "2 text(s) with lone surrogates made safe" in report.summary()


def test_context_overflow_without_tokenize_route_uses_the_proxys_tokenizer(scripted_app_factory, make_proxy, tok):
    app = scripted_app_factory(max_context=40)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/tokenize"]
    long = [{"role": "user", "content": "Where is the river? " * 10}]
    with ServerThread(app) as up:
        px = make_proxy(up.url, tokenizer_obj=tok)
        r = _post(f"{px.url}/rollouts/o/v1/chat/completions", {"model": "m", "messages": long, "max_tokens": 8})
        assert r.status_code == 400
        px2 = make_proxy(up.url)  # no tokenizer either: the overflow is recorded without ids, said so
        _post(f"{px2.url}/rollouts/o/v1/chat/completions", {"model": "m", "messages": long, "max_tokens": 8})
        px.stop()
        px2.stop()
    (rec,), _ = load_records(px.out_dir)
    assert rec.context_overflow and rec.retokenized and rec.prompt_ids == Renderer(tok).chat_prompt(long, None)
    assert "maximum context length" in rec.error
    (rec2,), _ = load_records(px2.out_dir)
    assert rec2.context_overflow and rec2.prompt_ids == [] and "maximum context length" in rec2.error


def test_an_upstream_that_sends_garbage_ids_is_recorded_as_failed():
    """What the upstream says is checked as strictly as the reader will: bad ids leave a record that
    says so (and reads back), never a record the exporter rejects or a lost one."""
    from fastapi import FastAPI

    from mosaic.capture.proxy import ProxyConfig, create_proxy_app

    bad = FastAPI()
    replies = [{"choices": [{"index": 0, "message": {"role": "assistant", "content": 7, "tool_calls": "x"},
                             "finish_reason": 3, "token_ids": [1, "two", -3],
                             "logprobs": {"content": [{"logprob": 5.0}]}}], "prompt_token_ids": [1, 2]},
               {"choices": [{"index": 0, "message": {"content": "hi"}, "token_ids": [3],
                             "logprobs": {"content": [1, "x"]}}], "prompt_token_ids": [1, 2]},
               {"choices": "nope"}, [1, 2]]

    @bad.post("/v1/chat/completions")
    async def chat():
        return replies.pop(0)

    import tempfile
    with ServerThread(bad) as up, tempfile.TemporaryDirectory() as d:
        with ServerThread(create_proxy_app(ProxyConfig(upstream=up.url, out_dir=d))) as px:
            for k in range(4):
                r = _post(f"{px.url}/rollouts/g{k}/v1/chat/completions", {"model": "m", "messages": MSGS})
                assert r.status_code == 200
        recs, _ = load_records(d)
    assert [r.rollout_id for r in recs] == ["g0", "g1", "g2", "g3"] and not any(r.ok for r in recs)
    rec = recs[0]
    assert rec.error == "upstream returned malformed token ids"
    assert rec.prompt_ids == [] and rec.logprobs == [] and rec.text == "" and rec.tool_calls == []
    assert all(r.error.startswith("upstream response is not a completion object") for r in recs[1:])
