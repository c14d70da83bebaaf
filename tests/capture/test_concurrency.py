"""64 concurrent agent clients over interleaved rollouts, through the proxy with the official async client."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import openai

from mosaic.capture.reconstruct import reconstruct
from mosaic.capture.records import load_records
from ._harness import OpenAILLM, run_agent

N = 64


class CountingLLM(OpenAILLM):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.n = 0

    async def __call__(self, messages, tools):
        self.n += 1
        return await super().__call__(messages, tools)


async def _run_all(proxy_url: str):
    limits = httpx.Limits(max_connections=N * 3, max_keepalive_connections=N * 3)
    http = httpx.AsyncClient(limits=limits, timeout=120)
    llms, tasks = [], []
    for i in range(N):
        client = openai.AsyncOpenAI(base_url=f"{proxy_url}/rollouts/c{i}/v1", api_key="x", http_client=http,
                                    max_retries=0)
        llm = CountingLLM(client, stream=(i % 2 == 1))
        llms.append(llm)
        tasks.append(run_agent(llm, f"Question number {i}: what is the fact about river {i}?"))
    answers = await asyncio.gather(*tasks)
    async with httpx.AsyncClient() as c:
        for i, a in enumerate(answers):
            r = await c.post(f"{proxy_url}/rollouts/c{i}/reward",
                             json={"reward": float(i % 2), "ground_truth": "FACT", "group_id": f"g{i // 8}"})
            assert r.status_code == 200
    await http.aclose()
    return answers, [llm.n for llm in llms]


def test_64_concurrent_rollouts_recorded_once_and_rebuilt(upstream, make_proxy):
    px = make_proxy(upstream.url)
    answers, counts = asyncio.run(_run_all(px.url))
    assert all(a.startswith("ANSWER: FACT-") for a in answers)
    px.stop()
    calls, rewards = load_records(px.out_dir)
    # Every call recorded exactly once, under its own rollout, and nothing else.
    assert len(calls) == sum(counts) == len(upstream.app.state.log)
    assert len({c.call_id for c in calls}) == len(calls)
    per = Counter(c.rollout_id for c in calls)
    assert [per[f"c{i}"] for i in range(N)] == counts
    assert all(c.ok for c in calls) and len(rewards) == N
    # Rollouts really interleaved at the proxy.
    order = [c.rollout_id for c in sorted(calls, key=lambda c: c.seq)]
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches > N
    upstream_gen = {tuple(p): c for p, c in upstream.app.state.log}
    trajs = reconstruct(calls, rewards)
    assert len(trajs) == N
    for t in trajs:
        assert [(s.kind, s.parent, s.edge, s.is_final) for s in t.sessions] == [
            ("main", None, None, False), ("subagent", 0, "forks", False), ("subagent", 0, "forks", False),
            ("compaction", 0, "continues", False), ("main", 3, "continues", True)], t.id
        assert t.reward == float(int(t.id[1:]) % 2) and t.group_id == f"g{int(t.id[1:]) // 8}"
        assert not t.meta["retries_dropped"] and not t.meta["unlinked_sessions"]
        for s in t.sessions:
            # Each trained stretch is exactly what the upstream generated for that prompt.
            toks = s.tokens()
            start = len(s.prompt_ids)
            i = 0
            while i < len(s.loss_mask):
                if not s.loss_mask[i]:
                    i += 1
                    continue
                j = i
                while j < len(s.loss_mask) and s.loss_mask[j]:
                    j += 1
                assert upstream_gen[tuple(toks[: start + i])] == toks[start + i: start + j]
                i = j
