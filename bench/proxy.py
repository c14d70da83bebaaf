"""Throughput and latency through the recording proxy vs directly to the same upstream.

Starts the scripted OpenAI-compatible upstream and the proxy (``mosaic proxy
serve``) as separate processes on loopback, then drives both with the same
concurrent load from this process (httpx.AsyncClient, keep-alive): direct →
upstream, and → proxy → upstream, alternating rounds so drift hits both.

The upstream models a model server: each request takes ``--delay`` seconds of
"generation" and at most ``--slots`` generate at once (vLLM's
``max_num_seqs``), the rest queue, so its capacity is ``slots / delay`` req/s.
With more clients than slots, throughput measures whether the proxy keeps
that capacity (the target: >= 0.9x direct). ``--slots 0`` removes the
capacity bound (then a closed-loop client measures added latency instead);
``--delay 0 --slots 0`` measures the proxy's raw CPU overhead. Bounded: each
phase stops after ``--requests`` requests or ``--seconds`` seconds.

    python bench/proxy.py                             # 32 clients, 100 ms x 8 slots, 2 rounds
    python bench/proxy.py --slots 0 --delay 0 --stream  # raw overhead, streamed

Prints requests/s, p50/p99 latency, CPU ms per request of each process (from
/proc, robust to other load on the machine), the proxy/direct throughput
ratio, and how many calls the proxy recorded. The direct client asks for the
same token ids and log-probs the proxy adds, so the upstream's work is equal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _start(cmd: list[str], health_path: str) -> tuple[subprocess.Popen, str]:
    """Start a server given ``--port 0``; returns it and the address it announces once bound."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # stderr to a file, never a pipe nobody drains (a full pipe would block the server).
    log = tempfile.NamedTemporaryFile(prefix="mosaic-bench-", suffix=".log", delete=False)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    p.log_path = log.name
    deadline = time.time() + 60
    url = None
    while time.time() < deadline:
        if url is None:
            m = re.search(r"listening on (http://\S+)", Path(log.name).read_text())
            url = m.group(1) if m else None
        try:
            if url is not None and httpx.get(url + health_path, timeout=1).status_code < 500:
                return p, url
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise RuntimeError(f"{cmd[:5]} exited: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.1)
    p.kill()
    raise RuntimeError(f"{cmd[:5]} did not start")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _body(i: int, stream: bool) -> dict:
    # The direct client asks for what the proxy adds (token ids, log-probs), as an RL client of the
    # upstream would, so the upstream does the same work on both paths.
    return {
        "return_token_ids": True,
        "logprobs": True,
        "model": "scripted",
        "messages": [
            {"role": "system", "content": "You are a research agent. Use the tools, then answer." * 4},
            {"role": "user", "content": f"Question {i % 64}: what is the fact about the river?"},
        ],
        "max_tokens": 32,
        "stream": stream,
    }


async def _phase(url: str, *, clients: int, requests: int, seconds: float, stream: bool) -> dict:
    # Pool headroom: with exactly one connection per worker, httpx's pool intermittently held a
    # request ~1 s before sending it (seen on the proxy path: the proxy's arrival stamp was late,
    # its handling time normal); twice the workers removes that client-side artefact.
    limits = httpx.Limits(max_connections=2 * clients, max_keepalive_connections=2 * clients)
    lat: list[float] = []
    errors = 0
    sent = 0
    t_end = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def worker(w: int) -> None:
            nonlocal sent, errors
            while sent < requests and time.perf_counter() < t_end:
                sent += 1
                hdr = {"X-Mosaic-Rollout": f"bench-{w}"}
                t0 = time.perf_counter()
                try:
                    if stream:
                        async with client.stream("POST", "/chat/completions", json=_body(sent, True),
                                                 headers=hdr) as r:
                            async for _ in r.aiter_raw():
                                pass
                            ok = r.status_code == 200
                    else:
                        r = await client.post("/chat/completions", json=_body(sent, False), headers=hdr)
                        ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")  # noqa: E731
    return {"ok": len(lat), "errors": errors, "wall_s": wall, "rps": len(lat) / wall, "p50_ms": q(0.50),
            "p99_ms": q(0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=1500, help="requests per phase (upper bound)")
    ap.add_argument("--seconds", type=float, default=15.0, help="time per phase (upper bound)")
    ap.add_argument("--rounds", type=int, default=2, help="direct/proxy rounds, alternating")
    ap.add_argument("--delay", type=float, default=0.1, help="upstream generation time per request, seconds")
    ap.add_argument("--slots", type=int, default=8,
                    help="upstream requests generated at once (its capacity is slots/delay req/s); 0 = unlimited")
    ap.add_argument("--stream", action="store_true", help="streamed responses")
    args = ap.parse_args()

    load0 = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    out = tempfile.mkdtemp(prefix="mosaic-bench-proxy-")
    py = sys.executable
    up, up_url = _start([py, "-m", "mosaic.cli", "proxy", "scripted-upstream", "--port", "0",
                         "--delay", str(args.delay), "--slots", str(args.slots)], "/v1/models")
    px = None
    try:
        px, px_url = _start([py, "-m", "mosaic.cli", "proxy", "serve", "--upstream", up_url,
                             "--out", out, "--port", "0"], "/healthz")
        direct_url, proxy_url = f"{up_url}/v1", f"{px_url}/v1"
        kw = dict(clients=args.clients, requests=args.requests, seconds=args.seconds, stream=args.stream)
        # Warm both paths (tokenizer caches, connection pools).
        asyncio.run(_phase(direct_url, **{**kw, "requests": 100, "seconds": 5}))
        asyncio.run(_phase(proxy_url, **{**kw, "requests": 100, "seconds": 5}))
        results: dict[str, list[dict]] = {"direct": [], "proxy": []}
        for _ in range(args.rounds):
            for name, url in (("direct", direct_url), ("proxy", proxy_url)):
                c0 = {"up": _cpu_s(up.pid), "px": _cpu_s(px.pid), "me": time.process_time()}
                r = asyncio.run(_phase(url, **kw))
                r["cpu_ms"] = {k: (_cpu_s(up.pid) if k == "up" else _cpu_s(px.pid) if k == "px"
                                   else time.process_time()) - v for k, v in c0.items()}
                r["cpu_ms"] = {k: 1000 * v / max(1, r["ok"]) for k, v in r["cpu_ms"].items()}
                results[name].append(r)
        recorded = httpx.get(f"{px_url}/healthz").json()["records"]
    finally:
        for p in (px, up):
            if p is not None:
                p.terminate()
                p.wait(30)

    cap = f"{args.slots / args.delay:.0f} req/s" if args.slots and args.delay else "unbounded"
    print(f"bench/proxy.py: {args.clients} clients, upstream delay {args.delay * 1000:.0f} ms x {args.slots or 'inf'} "
          f"slots (capacity {cap}), "
          f"{'stream' if args.stream else 'non-stream'}, {args.rounds} round(s), "
          f"<= {args.requests} requests or {args.seconds:.0f} s per phase, cpus={os.cpu_count()}")
    print(f"load average before: {load0}")
    print(f"{'path':<8}{'round':>6}{'ok':>7}{'err':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'CPU ms/req: upstream':>22}{'proxy':>7}{'client':>8}")
    for name, rs in results.items():
        for i, r in enumerate(rs):
            c = r["cpu_ms"]
            print(f"{name:<8}{i:>6}{r['ok']:>7}{r['errors']:>5}{r['rps']:>9.1f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
                  f"{c['up']:>22.2f}{c['px']:>7.2f}{c['me']:>8.2f}")
    agg = {n: sum(r["ok"] for r in rs) / sum(r["wall_s"] for r in rs) for n, rs in results.items()}
    p50 = {n: statistics.median(r["p50_ms"] for r in rs) for n, rs in results.items()}
    ratio = agg["proxy"] / agg["direct"]
    print(f"throughput: direct {agg['direct']:.1f} req/s, proxy {agg['proxy']:.1f} req/s, "
          f"ratio {ratio:.3f} (target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    print(f"median p50 latency: direct {p50['direct']:.2f} ms, proxy {p50['proxy']:.2f} ms "
          f"(+{p50['proxy'] - p50['direct']:.2f} ms)")
    print(f"proxy recorded {recorded} calls ({sum(r['ok'] for r in results['proxy'])} measured + warm-up)")
    print(json.dumps({"ratio": ratio, "direct_rps": agg["direct"], "proxy_rps": agg["proxy"],
                      "p50_ms": p50}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
