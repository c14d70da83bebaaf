"""Continuous batching (``LocalPolicyConfig.continuous_batching``): rows that finish leave the running decode
and waiting rows join it (:func:`~mosaic.agent.policies.kvcache.join_batches`). Greedy tokens do not depend on
the batch's composition, so the running batch must give the tokens of the chunked path and of one big
batch; a server's queue (``more``) joins mid-decode and every result is handed over once, as it finishes."""

from __future__ import annotations

import pytest
import torch

from _tiny import tiny_model
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=3, initializer_range=0.3)


def _requests(tok, n: int = 11) -> list[GenRequest]:
    """Prompts from 2 to ~60 tokens, decode lengths 2..13, two identical prompts."""
    words = "search the archive for who founded Meridian Works and when the Velmora bridge opened".split()
    reqs = []
    for i in range(n):
        text = " ".join(words[: 1 + (5 * i) % len(words)] * (1 + (3 * i) % 5))
        reqs.append(GenRequest(f"r{i}", tok(text, add_special_tokens=False)["input_ids"], 2 + (7 * i) % 12))
    reqs[6] = GenRequest("r6", list(reqs[2].prompt_ids), 9)
    return reqs


def _policy(model, tok, batch: int, continuous: bool, stop) -> LocalPolicy:
    return LocalPolicy(model, tok, LocalPolicyConfig(temperature=0.0, max_batch_size=batch, seed=1,
                                                     stop_token_ids=stop, continuous_batching=continuous))


def _stop(tok):
    return tuple(tok(" the", add_special_tokens=False)["input_ids"][:1]) + (tok.eos_token_id,)


def _turns(pol: LocalPolicy, tok, reqs: list[GenRequest], n_turns: int = 3):
    """Three turns per session (each turn's prompt extends the last: the prefix cache is used)."""
    tool = tok("<|im_end|>\n<|im_start|>tool\nresult<|im_end|>\n", add_special_tokens=False)["input_ids"]
    seen = []
    for _ in range(n_turns):
        out = pol.generate(reqs)
        seen.append(out)
        reqs = [GenRequest(r.session_key, r.prompt_ids + x.token_ids + tool, r.max_new_tokens)
                for r, x in zip(reqs, out)]
    return seen


def test_running_batch_gives_the_greedy_tokens_of_chunks_and_of_one_batch(model_tok):
    model, tok = model_tok
    stop = _stop(tok)
    reqs = _requests(tok)
    runs = {name: _turns(_policy(model, tok, b, c, stop), tok, reqs)
            for name, b, c in (("one batch", 64, True), ("chunks", 3, False), ("running", 3, True),
                               ("running4", 4, True))}
    ref = runs["one batch"]
    assert len({len(r.token_ids) for turn in ref for r in turn}) > 3  # rows finish at different steps
    for name, turns in runs.items():
        for a, b in zip(turns, ref):
            assert [r.token_ids for r in a] == [r.token_ids for r in b], name
            assert [r.finish_reason for r in a] == [r.finish_reason for r in b], name
            for x, y in zip(a, b):
                assert x.raw_logprobs == pytest.approx(y.raw_logprobs, abs=1e-4)


def test_rows_join_a_running_batch_and_are_handed_over_once(model_tok):
    """A server's queue: requests arrive while the batch decodes (longer and shorter than its rows so far)."""
    model, tok = model_tok
    stop = _stop(tok)
    reqs = _requests(tok)
    alone = _policy(model, tok, 64, True, stop).generate(reqs)
    pol = _policy(model, tok, 4, True, stop)
    queue = list(reqs[2:]) + [GenRequest("bad", [], 3)]
    asked, handed = [], {}

    def more(free: int):
        asked.append(free)
        got, queue[:] = queue[:1], queue[1:]  # one at a time: they join over many steps
        return got

    def on_result(i, res):
        assert i not in handed
        handed[i] = res

    out = pol.generate_with(reqs[:2], more=more, on_result=on_result)
    assert not queue and len(out) == len(reqs) + 1 and len(handed) == len(out)
    assert all(f <= 4 for f in asked)
    assert out[-1].finish_reason == "error" and "empty" in out[-1].error
    for i, (a, b) in enumerate(zip(out, alone)):
        assert handed[i] is a
        assert a.token_ids == b.token_ids, i
        assert a.raw_logprobs == pytest.approx(b.raw_logprobs, abs=1e-4)


def test_sampled_rows_stay_valid_when_batches_join(model_tok):
    """Sampling (T 1): every request decodes to a stop id or its length, with finite log-probs."""
    model, tok = model_tok
    stop = _stop(tok)
    reqs = _requests(tok, 17)
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, max_batch_size=4, seed=2, stop_token_ids=stop,
                                                    continuous_batching=True))
    for turn in _turns(pol, tok, reqs):
        for r, res in zip(reqs, turn):
            assert res.finish_reason in ("stop", "length")
            assert len(res.token_ids) == len(res.logprobs) <= r.max_new_tokens
            assert (res.finish_reason == "stop") == (res.token_ids[-1] in stop)
            assert all(torch.isfinite(torch.tensor(res.logprobs)))


def test_the_tests_above_join_rows_both_ways(model_tok):
    """The cases above do exercise joins: rows shorter than the running batch (placed after a gap) and longer."""
    model, tok = model_tok
    pol = _policy(model, tok, 3, True, _stop(tok))
    _turns(pol, tok, _requests(tok))
    assert pol.cache_stats["joined_rows"] >= 8
    assert pol.cache_stats["joins_shifted"] >= 2


def test_server_requests_join_the_running_batch_and_get_their_own_answers(model_tok):
    """The server's worker: a request sent while a long one decodes joins it (``joined_jobs``), is answered
    before the long one ends, with the greedy tokens it gets alone; one with other sampling waits."""
    import asyncio

    from mosaic.agent.server.app import ModelServer
    from mosaic.agent.server.worker import Job

    model, tok = model_tok
    reqs = _requests(tok)
    long_req = GenRequest("long", reqs[3].prompt_ids, 120)
    stop = (10**6,)  # never sampled: every request runs to its length
    alone = {r.session_key: LocalPolicy(model, tok, LocalPolicyConfig(temperature=0.0, stop_token_ids=stop))
             .generate([r])[0].token_ids for r in (long_req, reqs[5], reqs[8])}
    srv = ModelServer(model, tok, model_name="m", device="cpu", max_batch_size=8, batch_window_s=0.0,
                      default_max_tokens=16)

    async def main():
        loop, order = asyncio.get_running_loop(), []

        started = asyncio.Event()  # the long request has streamed its first tokens: it is decoding

        async def ask(req, temperature, wait):
            if wait:
                await started.wait()
            q = asyncio.Queue()
            srv.worker.submit(Job([req], temperature, 1.0, stop, None, loop, q, not wait))
            while (ev := await q.get())[0] != "done":
                if ev[0] == "token":
                    started.set()
            order.append(req.session_key)
            return ev[1][0]

        out = await asyncio.gather(ask(long_req, 0.0, False), ask(reqs[5], 0.0, True), ask(reqs[8], 1.0, True))
        return out, order

    try:
        (a, b, c), order = asyncio.run(main())
    finally:
        srv.worker.close()
    assert srv.worker.stats["joined_jobs"] >= 1
    assert a.token_ids == alone["long"] and b.token_ids == alone["r5"]
    assert order.index("r5") < order.index("long")  # answered as it finished, not at the batch's end
    assert len(c.token_ids) == reqs[8].max_new_tokens  # the T=1 request ran in a batch of its own


def test_a_long_running_batch_does_not_grow_with_its_steps(model_tok, monkeypatch):
    """Columns no live row uses are dropped at each join: 60 short requests through 4 rows keep the batch's
    length near one row's (prompt + decode), not the number of steps run so far."""
    import mosaic.agent.policies.local as local

    model, tok = model_tok
    lengths = []
    join = local.join_batches

    def spy(a, b, room):
        out = join(a, b, room)
        lengths.append(out.length)
        return out

    monkeypatch.setattr(local, "join_batches", spy)
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, max_batch_size=4, seed=0, stop_token_ids=(10**6,),
                                                    continuous_batching=True))
    out = pol.generate([GenRequest(f"q{i}", [5 + i % 7, 9, 11], 6) for i in range(60)])
    assert all(len(r.token_ids) == 6 for r in out)
    assert len(lengths) >= 10 and max(lengths) <= 3 + 6 + 1


def test_a_batch_that_fails_after_a_job_joined_answers_every_job():
    """The worker's error path reaches the jobs that joined the failing batch too (none waits forever)."""
    import asyncio
    import time

    from mosaic.agent.server.worker import Job, ModelWorker

    class Joins:
        device = torch.device("cpu")

        def generate_with(self, reqs, *, more=None, **_):
            time.sleep(0.3)
            got = more(4) if more else []
            raise RuntimeError(f"failed after {len(got)} joined")

    async def main():
        loop = asyncio.get_running_loop()
        w = ModelWorker(Joins(), max_batch_size=8, batch_window_s=0.0)
        jobs = []
        for _ in range(2):
            jobs.append(Job([GenRequest("k", [1, 2], 3)], 1.0, 1.0, (), None, loop, asyncio.Queue(), False))
            w.submit(jobs[-1])
            await asyncio.sleep(0.1)
        try:
            return [await asyncio.wait_for(j.events.get(), 5) for j in jobs], w.stats["joined_jobs"]
        finally:
            w.close()

    events, joined = asyncio.run(main())
    assert joined == 1
    assert all(ev[0] == "error" and "failed after 1 joined" in ev[1] for ev in events)
