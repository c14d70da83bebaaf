"""The fidelity check of a rebuilt trajectory: every trained token sits on exactly the context the model
was given when it sampled that token, and every token the policy sampled in a kept call is trained once."""

from __future__ import annotations

from collections import Counter

from mosaic.trace import to_rows


def sampled_keys(calls) -> Counter:
    """(context, token, log-prob) of every token the calls sampled: context = prompt + earlier completion."""
    out: Counter = Counter()
    for c in calls:
        for j, tok in enumerate(c.completion_ids):
            lp = float(c.logprobs[j]) if len(c.logprobs) == len(c.completion_ids) else 0.0
            out[(tuple(c.prompt_ids) + tuple(c.completion_ids[:j]), tok, lp)] += 1
    return out


def trained_keys(trajs) -> Counter:
    """(context, token, log-prob) of every trained token of the training rows (detached stretches included)."""
    out: Counter = Counter()
    for r in to_rows(trajs):
        ids = r.prompt_ids + r.completion_ids
        p = len(r.prompt_ids)
        for j, (tok, m) in enumerate(zip(r.completion_ids, r.loss_mask)):
            if m:
                out[(tuple(ids[: p + j]), tok, float(r.logprobs[j]))] += 1
    return out


def assert_trained_on_sampled_contexts(t, recs) -> None:
    """For the trajectory ``t`` rebuilt from ``recs``: the trained tokens are exactly the sampled tokens of
    its sessions' calls, each on the context it was sampled from."""
    by_id = {r.call_id: r for r in recs}
    calls = [by_id[c] for s in t.sessions for c in s.meta["call_ids"]]
    want, got = sampled_keys(calls), trained_keys([t])
    wrong = got - want
    assert not wrong, f"{sum(wrong.values())} trained token(s) on a context they were not sampled on"
    assert got == want, f"{sum((want - got).values())} sampled token(s) not trained"
