"""``mosaic data generate`` / ``show`` for ``data.family=service`` (called by :mod:`mosaic.envs.cli`)."""

from __future__ import annotations

import json
import time
from collections import Counter

from mosaic.envs.service.expert import ServiceExpert, run_episode
from mosaic.envs.service.splits import load_service_split, service_config_for
from mosaic.envs.service.tools import ServiceEnv


def generate(cfg, split: str) -> int:
    """Generate ``split``, print its summary and how the two scripted experts do on it."""
    t0 = time.perf_counter()
    sc = service_config_for(cfg, split)
    episodes = load_service_split(split, sc)
    seconds = time.perf_counter() - t0
    env, solved = ServiceEnv(), Counter()
    for ep in episodes:
        for name, revalidate in (("expert", True), ("trusting", False)):
            out = run_episode(env, ep, ServiceExpert(revalidate))
            solved[name] += out.success
            solved[name + "_stale"] += out.stale_actions
    n = len(episodes)
    requests = Counter(v.request.kind for e in episodes for v in e.visits)
    print(f"split={split} family=service episodes={n} visits={sc.visits} events_between={sc.events_between} "
          f"unannounced_share={sc.unannounced_share} seed={sc.seed} ({seconds:.2f}s)")
    print(f"requests={dict(sorted(requests.items()))} events={sum(len(e.events) for e in episodes)} "
          f"unannounced={sum(e.unannounced for e in episodes)} traps={sum(e.trap for e in episodes) / n:.1%}")
    print(f"revalidating expert solves {solved['expert'] / n:.1%} (stale actions {solved['expert_stale']}); "
          f"trusting expert solves {solved['trusting'] / n:.1%} (stale actions {solved['trusting_stale']})")
    return 0


def show(cfg, split: str, index: int, as_json: bool) -> str | None:
    """Print episode ``index`` of ``split``; returns an error line when ``index`` is out of range."""
    episodes = load_service_split(split, service_config_for(cfg, split))
    if not 0 <= index < len(episodes):
        return f"--index must be in [0, {len(episodes)}), got {index}"
    ep = episodes[index]
    if as_json:
        print(json.dumps(ep.to_json(), indent=2))
        return None
    acct = {k: v for k, v in ep.initial.items() if k != "orders"}
    print(f"id:      {ep.id}\nuser:    {ep.user}\naccount: {acct}")
    for oid, o in ep.initial["orders"].items():
        print(f"  {oid}: {o['item']} ({o['status']}) to {o['address']}")
    for v in ep.visits:
        for e in ep.events_before(v.index):
            what = e.target or e.value or e.field
            print(f"  day {e.day}: {e.kind} {what} ({'announced' if e.announced else 'backend only'})")
        print(f"visit {v.index + 1}: {v.text}")
        for c in v.required:
            print(f"  required: {c.name}({', '.join(f'{k}={x!r}' for k, x in c.args)})")
    print(f"answer:  {ep.answer}\ntrap:    {ep.trap}" + (f" ({ep.trap_reason})" if ep.trap else ""))
    return None
