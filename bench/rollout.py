"""Sampling throughput: LocalPolicy and the full harness against raw HF ``model.generate``.

All in one run, same model (the embedded ``--preset``, fp32, random init), same
machine, same batch size:

1. **policy level**: ``LocalPolicy.generate`` on ``--batch`` requests (prompt lengths
   drawn from ``--prompt-lens``) vs ``model.generate`` on the same left-padded prompts;
   both sample exactly ``--new-tokens`` per row (end-of-turn ignored: ``min_new_tokens``
   for HF, no stop ids for the policy), temperature 1, no top-k / top-p.
2. **harness level**: ``Harness(LocalPolicy, ChatFormat, DeepSearchEnv(cpu validation
   split), HarnessConfig(...)).run(tasks, group_size)`` with ``tasks x group_size = --batch``
   concurrent trajectories; every request's prompt length and sampled-token count is
   recorded. The peer is ``model.generate`` run right after each harness ``generate``
   call on the very same prompts (same batch size), ``max_new_tokens = min_new_tokens``
   = the harness's turn cap, so both see the same machine load call by call; its time
   is excluded from the harness's wall time. Sampled tokens/s of each and their ratio
   (target >= 0.9). The harness figure includes everything a rollout does: tool calls
   (BM25 search), chat-format bookkeeping, prefill of each turn's new tokens (the whole
   growing context with ``--no-prefix-cache``), shrinking batches as trajectories end,
   log-probs.

The model is untrained, so its turns are noise: they rarely stop early and never call
tools correctly (each bad call becomes an error tool response the harness appends).
That makes turns maximally long, which favours neither side.

Usage: python bench/rollout.py [--preset cpu] [--batch 32] [--new-tokens 64] [--threads 1]

On a shared machine use --threads 1: with 2 OpenMP threads and other jobs on the cores,
throughput dropped ~10x here and swung run to run (spinning threads).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    return ids, mask


class Clock:
    """Wall time and this process's CPU time (all threads). On a shared machine wall time
    swings with other jobs' load; CPU time is what this process itself spent."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "Clock":
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def raw_generate(model, prompts: list[list[int]], new_tokens: int, pad: int, seed: int) -> tuple[int, Clock]:
    """HF generate producing exactly ``new_tokens`` per row: (sampled tokens, time)."""
    ids, mask = _left_pad(prompts, pad)
    torch.manual_seed(seed)
    with Clock() as clock, torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad)
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens, clock


def policy_generate(policy, prompts: list[list[int]], new_tokens: int) -> tuple[int, Clock]:
    from mosaic.agent.policy import GenRequest

    reqs = [GenRequest(f"b{i}", p, new_tokens) for i, p in enumerate(prompts)]
    with Clock() as clock:
        res = policy.generate(reqs)
    n = sum(len(r.token_ids) for r in res)
    assert n == len(prompts) * new_tokens or new_tokens < 8, n
    return n, clock


class _Interleaved:
    """Wraps the harness's policy: after each ``generate`` call, times HF ``model.generate`` on
    the very same prompts (same batch size, ``new_tokens`` forced per row), so both sides see
    the same machine load, call by call. The peer's time is excluded from the harness's."""

    def __init__(self, inner, model, pad: int, new_tokens: int, seed: int):
        self.inner, self.model, self.pad, self.new_tokens, self.seed = inner, model, pad, new_tokens, seed
        self.lens: list[int] = []
        self.batches: list[int] = []
        self.sampled = 0
        self.gen_s = 0.0
        self.raw_tokens = 0
        self.raw = Clock()

    def generate(self, requests):
        t0 = time.perf_counter()
        out = self.inner.generate(requests)
        self.gen_s += time.perf_counter() - t0
        self.lens += [len(r.prompt_ids) for r in requests]
        self.sampled += sum(len(r.token_ids) for r in out)
        self.batches.append(len(requests))
        n, clock = raw_generate(self.model, [list(r.prompt_ids) for r in requests], self.new_tokens,
                                self.pad, self.seed + len(self.batches))
        self.raw_tokens += n
        self.raw.wall += clock.wall
        self.raw.cpu += clock.cpu
        return out

    def release(self, key):
        self.inner.release(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu", help="embedded model preset (tiny, cpu)")
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests / trajectories")
    ap.add_argument("--new-tokens", type=int, default=64, help="sampled tokens per turn")
    ap.add_argument("--prompt-lens", default="64,512", help="policy level: min,max prompt length")
    ap.add_argument("--repeats", type=int, default=3, help="policy level: timed repeats (median)")
    ap.add_argument("--group-size", type=int, default=4, help="harness level: rollouts per task")
    ap.add_argument("--context-budget", type=int, default=1024, help="harness level")
    ap.add_argument("--max-turns", type=int, default=6, help="harness level: turns per main session")
    ap.add_argument("--skip-harness", action="store_true")
    ap.add_argument("--skip-policy", action="store_true")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="harness level: re-prefill every context every turn")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mosaic.agent.models.embedded import EmbeddedModelConfig, build_model
    from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
    from mosaic.agent.models.corpus import build_project_tokenizer
    from mosaic.envs.splits import load_split

    cache = tempfile.mkdtemp(prefix="mosaic-bench-")
    split = load_split("validation", preset="cpu", cache_dir=cache)
    tok = build_project_tokenizer([split])
    cfg = EmbeddedModelConfig.preset(args.preset)
    model = build_model(cfg, tok, seed=args.seed)
    pad = tok.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: embedded/{args.preset} {cfg.arch}, {n_params / 1e6:.2f}M params, vocab {len(tok)}, "
          f"fp32, torch threads {torch.get_num_threads()}")

    rng = random.Random(args.seed)
    lo, hi = map(int, args.prompt_lens.split(","))
    V = len(tok)
    prompts = [[rng.randrange(10, V) for _ in range(rng.randint(lo, hi))] for _ in range(args.batch)]
    def no_stop(scripted: bool):
        return LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, max_batch_size=args.batch, stop_token_ids=(-1,),
                                                         seed=args.seed, prefix_cache=False, scripted_decode=scripted))
    # Warm up both paths once (allocator, kernels).
    raw_generate(model, prompts[:4], 8, pad, args.seed)
    policy_generate(LocalPolicy(model, tok), prompts[:4], 1)
    raw, pol, unscripted = [], [], []
    for r in range(0 if args.skip_policy else args.repeats):  # interleaved, so background load hits both alike
        raw.append(raw_generate(model, prompts, args.new_tokens, pad, args.seed + r))
        pol.append(policy_generate(no_stop(True), prompts, args.new_tokens))
        unscripted.append(policy_generate(no_stop(False), prompts, args.new_tokens))
    if not args.skip_policy:
        _report_policy(args, lo, hi, raw, pol, unscripted)
    if not args.skip_harness:
        _harness(args, model, tok, split, rng, pad)


def _report_policy(args, lo, hi, raw, pol, unscripted) -> None:
    print(f"\n[policy level] batch {args.batch}, prompts {lo}-{hi} tokens, {args.new_tokens} new tokens "
          f"per row, median of {args.repeats} interleaved repeats")
    for clock in ("wall", "cpu"):
        r = [n / getattr(c, clock) for n, c in raw]
        p = [n / getattr(c, clock) for n, c in pol]
        paired = [a / b for a, b in zip(p, r)]
        print(f"  {clock:4s} HF model.generate : {statistics.median(r):9.1f} sampled tok/s   "
              f"(runs: {', '.join(f'{x:.0f}' for x in r)})")
        print(f"  {clock:4s} LocalPolicy       : {statistics.median(p):9.1f} sampled tok/s   "
              f"(runs: {', '.join(f'{x:.0f}' for x in p)})")
        print(f"  {clock:4s} ratio policy/raw  : {statistics.median(paired):.3f}   (per-repeat: "
              f"{', '.join(f'{x:.2f}' for x in paired)})")
        u = [n / getattr(c, clock) for n, c in unscripted]  # the same policy, decode steps through Python
        print(f"  {clock:4s} scripted/Python   : {statistics.median(a / b for a, b in zip(p, u)):.3f}   "
              f"(LocalPolicy with scripted_decode=False: {statistics.median(u):.1f} sampled tok/s)")


def _harness(args, model, tok, split, rng, pad) -> None:
    from mosaic.agent.chat import ChatFormat
    from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    if args.batch % args.group_size:
        raise SystemExit("--batch must be a multiple of --group-size")
    chat = ChatFormat(tok)
    hcfg = HarnessConfig(mode="compaction", context_budget=args.context_budget,
                         max_new_tokens=args.new_tokens, summary_max_new_tokens=args.new_tokens,
                         max_turns=args.max_turns)
    inner = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, max_batch_size=args.batch,
                                                      seed=args.seed,
                                                      prefix_cache=not args.no_prefix_cache))
    policy = _Interleaved(inner, model, pad, args.new_tokens, args.seed + 100)
    tasks = split.tasks[:args.batch // args.group_size]
    with Clock() as total:
        trajs = Harness(policy, chat, DeepSearchEnv(split), hcfg).run(tasks, group_size=args.group_size,
                                                                     seed=args.seed)
    wall = total.wall - policy.raw.wall
    cpu = total.cpu - policy.raw.cpu
    sessions = sum(len(t.sessions) for t in trajs)
    print(f"\n[harness level] {len(trajs)} concurrent trajectories ({len(tasks)} tasks x {args.group_size}), "
          f"mode compaction, budget {args.context_budget}, turn cap {args.new_tokens} tokens")
    print(f"  {len(policy.batches)} generate calls (batch sizes {max(policy.batches)}..{min(policy.batches)}), "
          f"{len(policy.lens)} turns, {sessions} sessions, {policy.sampled} sampled tokens, "
          f"mean prompt {statistics.mean(policy.lens):.0f} tokens")
    print(f"  harness wall {wall:.1f} s, of which in policy.generate {policy.gen_s:.1f} s; prefix cache "
          f"{'off' if args.no_prefix_cache else 'on'}: {inner.cache_stats}")
    print(f"  peer: HF model.generate after each harness call on the same prompts, "
          f"{args.new_tokens} new per row: {policy.raw_tokens} tokens")
    for name, h_s, r_s in (("wall", wall, policy.raw.wall), ("cpu", cpu, policy.raw.cpu)):
        h_tps, r_tps = policy.sampled / h_s, policy.raw_tokens / r_s
        print(f"  {name:4s} harness           : {h_tps:9.1f} sampled tok/s   ({h_s:.1f} s)")
        print(f"  {name:4s} HF model.generate : {r_tps:9.1f} sampled tok/s   ({r_s:.1f} s)")
        print(f"  {name:4s} ratio harness/raw : {h_tps / r_tps:.3f}   (target >= 0.9)")


if __name__ == "__main__":
    main()
