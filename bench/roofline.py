"""How close a training step runs to this machine's matmul limit.

1. **Peak.** Sustained fp32 matmul GFLOP/s (``torch.mm``, best of ``--repeats``) at the shapes the
   model's forward passes use: each linear layer at a decode batch (rows = the step's rollouts) and at a
   training micro-batch (rows = micro-batch x 512 tokens), the LM head at both, and a 1024^3 product.
   The peak is the best of them (CPU time, so a shared machine's other load does not count).
2. **A step.** One warm-up and ``--steps`` RL steps of the main job (``mosaic train``'s CPU preset, the
   compaction grid's KL anchor unless overridden). Forward hooks count the matmul FLOPs of every linear
   layer call (2 x in x out per row) and of attention (4 x hidden x query x key positions per layer; a
   call under autograd counts 3x: forward + backward), attributed to the phase running (generation, gain
   scoring, update, with the reference model's calls apart).

Prints the matmul table, then per phase: CPU seconds, GFLOP, achieved GFLOP/s and its fraction of the peak
(times the threads used).

    python bench/roofline.py                      # the compaction grid's step (kl 0.05), 2 steps
    python bench/roofline.py --steps 1 train.batch_tasks=2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASE = {"now": "other"}
CPU: dict[str, float] = {}  # CPU seconds per phase (process_time: robust to a shared machine)


def matmul_gflops(m: int, k: int, n: int, repeats: int) -> float:
    """Best sustained GFLOP/s of an fp32 (m, k) @ (k, n) product."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    reps = max(1, int(2e8 // (2 * m * k * n)) or 1)  # ~0.2 GFLOP per timing
    best = 0.0
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(reps):
            torch.mm(a, b)
        best = max(best, 2 * m * k * n * reps / max(1e-9, time.process_time() - t) / 1e9)
    return best


def model_shapes(model, rows: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of the distinct linear layers at ``rows`` (decode) and ``tokens`` (training) rows."""
    import torch

    seen, out = set(), []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            k, n = mod.in_features, mod.out_features
            kind = name.rsplit(".", 1)[-1]
            if (kind, k, n) not in seen:
                seen.add((kind, k, n))
                out += [(f"{kind} decode", rows, k, n), (f"{kind} train", tokens, k, n)]
    return out + [("square 1024", 1024, 1024, 1024)]


def count_flops(model, into: dict, label: str | None = None) -> None:
    """Hooks adding each forward's matmul FLOPs (x3 under autograd) to ``into[label or the running phase]``:
    every linear layer (2 x in x out per row it sees) and the decoder's attention (4 x hidden x query x key
    positions per layer and row)."""
    import torch

    cfg = model.config
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers

    def add(f: float) -> None:
        f *= 3 if torch.is_grad_enabled() and model.training else 1
        key = label or PHASE["now"]
        into[key] = into.get(key, 0.0) + f

    def linear(mod, args, out):
        add(2 * mod.in_features * mod.out_features * (args[0].numel() // mod.in_features))

    def attention(mod, args, kwargs, out):
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        if x is None:
            return
        B, T = x.shape[:2]
        mask = kwargs.get("attention_mask")
        kv = mask.shape[-1] if mask is not None else T
        add(4 * hidden * T * kv * B * layers)

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(linear)
    model.get_decoder().register_forward_hook(attention, with_kwargs=True)


def phase_wrappers() -> None:
    """Name the phase that runs while ``rl_step`` rolls out, scores and updates."""
    from mosaic.train import rl

    def wrap(name, label, owner=rl):
        fn = getattr(owner, name)

        def inner(*a, **k):
            PHASE["now"] = label
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                PHASE["now"] = "other"
                CPU[label] = CPU.get(label, 0.0) + time.process_time() - t
        setattr(owner, name, inner)

    try:  # the rollouts: the run's rollout source (older code: rl._rollout)
        from mosaic.train.sources import HarnessRollouts

        wrap("collect", "generation", HarnessRollouts)
    except ImportError:
        wrap("_rollout", "generation")
    wrap("score_for", "gain scoring")
    wrap("update", "update")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="mosaic train overrides (key=value)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be >= 1")

    import torch

    from trainer import _our_state
    from mosaic.train.rl import rl_step

    if args.threads:
        torch.set_num_threads(args.threads)
    # (RLState makes the KL anchor's reference itself when the anchor is on)
    st = _our_state([f"train.steps={args.steps + 1}", "algo.kl_coef=0.05", "harness.mode=compaction", *args.overrides])
    rows = st.cfg.train.batch_tasks * st.cfg.train.group_size
    table = [(name, m, k, n, matmul_gflops(m, k, n, args.repeats))
             for name, m, k, n in model_shapes(st.model, rows, st.cfg.optim.micro_batch_size * 512)]
    peak = max(g for *_, g in table)
    print(f"fp32 matmul on this machine ({torch.get_num_threads()} threads), GFLOP/s:")
    for name, m, k, n, g in table:
        print(f"  {name:<18}{m:>6} x {k:>5} x {n:>5}  {g:8.1f}")
    print(f"  peak (best of the above): {peak:.1f} GFLOP/s\n")

    flops: dict[str, float] = {}
    count_flops(st.model, flops)
    if st.ref_model is not None:
        count_flops(st.ref_model, flops, "reference pass")
    phase_wrappers()
    rl_step(st, 0)  # warm-up
    flops.clear()
    CPU.clear()
    t0 = time.process_time()
    metrics = [rl_step(st, k) for k in range(1, args.steps + 1)]
    CPU["step"] = time.process_time() - t0
    peak_all = peak * torch.get_num_threads()
    print(f"per step (mean of {args.steps}; CPU seconds of this process; peak x {torch.get_num_threads()} threads = "
          f"{peak_all:.1f} GFLOP/s; the update includes the reference pass, whose FLOPs are "
          f"{100 * flops.get('reference pass', 0.0) / max(1e-9, sum(flops.values())):.0f} % of the step's):")
    print(f"  {'phase':<16}{'CPU s':>8}{'GFLOP':>9}{'GFLOP/s':>9}{'of peak':>9}")
    for phase in ("generation", "gain scoring", "update", "step"):
        s_ = CPU.get(phase, 0.0)
        f = (sum(flops.values()) if phase == "step" else flops.get(phase, 0.0)
             + (flops.get("reference pass", 0.0) if phase == "update" else 0.0))
        rate = f / 1e9 / max(s_, 1e-9)
        print(f"  {phase:<16}{s_ / args.steps:8.2f}{f / 1e9 / args.steps:9.2f}{rate:9.2f}{100 * rate / peak_all:8.1f}%")
    print(f"  (wall: median step {statistics.median(m['timing_s/step'] for m in metrics):.2f} s)")


if __name__ == "__main__":
    main()
