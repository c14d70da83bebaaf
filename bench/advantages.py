"""Benchmark: Mosaic's advantage estimators against verl's GRPO, in one run.

4,096 trajectories in groups of 8, 1-8 sessions each (~18k sessions), binary
rewards. Times (median over repeats, after one warm-up):
- ours ``grpo`` (T,) and ours ``mosaic`` (S,) with gains given (both levels);
- verl 0.9.1 ``compute_grpo_outcome_advantage`` (the default ``grpo`` estimator,
  a Python loop) and ``compute_grpo_vectorized_outcome_advantage`` on the same
  trajectories as (T, L) token rows;
- verl's v1 ``compute_advantage_for_multi_trajectories`` (broadcasting over the
  ~18k session rows), our ``broadcast`` counterpart.

verl lives in its own venv (see ``bench/_peers.py``); this script re-executes
itself there (building the venv if missing), with the repo on ``sys.path`` —
``mosaic.core`` needs only torch and numpy. Prints a table and ratios; asserts
nothing about time.

Usage: ``python bench/advantages.py [--repeats 15] [--width 256] [--seed 0]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _reexec_in_verl_venv() -> None:
    try:
        import verl  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO / "bench"))
        from _peers import ensure_verl_venv

        py = ensure_verl_venv()
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-sessions", type=int, default=8)
    ap.add_argument("--width", type=int, default=256, help="response length L of verl's (B, L) token rows")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    _reexec_in_verl_venv()
    sys.path.insert(0, str(REPO))
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch
    import verl
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import (
        AdvantageEstimator,
        compute_grpo_outcome_advantage,
        compute_grpo_vectorized_outcome_advantage,
    )
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    from mosaic.core.advantages import broadcast, grpo, mosaic

    rng = np.random.default_rng(args.seed)
    t = args.trajectories
    group = np.repeat(np.arange(t // args.group_size), args.group_size)  # (T,)
    rewards = rng.integers(0, 2, t).astype(np.float32)
    counts = rng.integers(1, args.max_sessions + 1, t)
    session_traj = np.repeat(np.arange(t), counts)  # (S,)
    s = session_traj.size
    position = np.concatenate([np.arange(n) for n in counts])
    is_final = position == counts[session_traj] - 1
    kinds = np.where(is_final, 0, position % 2)  # alternating main / compaction
    gains = rng.normal(0, 1, s).astype(np.float32)

    r_t, g_t, n_t = torch.from_numpy(rewards), torch.from_numpy(group), torch.from_numpy(counts)
    ok_t = r_t >= 1.0
    st_t, k_t, f_t, gn_t = (torch.from_numpy(x) for x in (session_traj, kinds, is_final, gains))

    width = args.width
    lengths = rng.integers(1, width + 1, t)
    mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).float()  # (T, L)
    tlr = torch.zeros(t, width)
    tlr[torch.arange(t), torch.from_numpy(lengths) - 1] = r_t  # outcome on the last token
    index = np.array([str(x) for x in group], dtype=object)  # verl uses uid strings

    # verl multi-trajectory rows: one per session; the reward sits on each trajectory's last output.
    s_len = rng.integers(1, width + 1, s)
    s_mask = (torch.arange(width)[None, :] < torch.from_numpy(s_len)[:, None]).float()  # (S, L)
    s_tlr = torch.zeros(s, width)
    s_tlr[torch.arange(s), torch.from_numpy(s_len) - 1] = torch.from_numpy(np.where(is_final, rewards[session_traj], 0))
    s_uid = np.array([f"g{x}" for x in group[session_traj]], dtype=object)
    keys = [f"g{g}_{tr}_{p}" for g, tr, p in zip(group[session_traj], session_traj, position, strict=True)]

    def verl_multi():
        data = DataProto.from_dict(tensors={"token_level_rewards": s_tlr, "response_mask": s_mask},
                                   non_tensors={"uid": s_uid})  # fmt: skip
        return compute_advantage_for_multi_trajectories(data, keys, AdvantageEstimator.GRPO)

    # Same numbers first (groups of 8: no singleton convention difference).
    ours_a = grpo(r_t, g_t)
    verl_a, _ = compute_grpo_outcome_advantage(tlr, mask, index)
    assert torch.allclose(ours_a[:, None] * mask, verl_a, atol=1e-5), "grpo disagrees with verl"
    verl_b = verl_multi().batch["advantages"]
    assert torch.allclose(broadcast(ours_a, st_t)[:, None] * s_mask, verl_b, atol=1e-5), "broadcast disagrees"

    reps = args.repeats
    rows = [
        ("ours grpo (T,)", _median_ms(lambda: grpo(r_t, g_t), reps)),
        ("ours mosaic, both levels (S,)", _median_ms(lambda: mosaic(r_t, g_t, n_t, ok_t, st_t, gn_t, k_t, f_t), reps)),
        ("ours broadcast of grpo (S,)", _median_ms(lambda: broadcast(grpo(r_t, g_t), st_t), reps)),
        ("ours grpo expanded to tokens (T, L), like verl",
         _median_ms(lambda: grpo(tlr.sum(-1), g_t)[:, None] * mask, reps)),
        ("verl compute_grpo_outcome_advantage (T, L)",
         _median_ms(lambda: compute_grpo_outcome_advantage(tlr, mask, index), reps)),
        ("verl compute_grpo_vectorized_outcome_advantage (T, L)",
         _median_ms(lambda: compute_grpo_vectorized_outcome_advantage(tlr, mask, index), reps)),
        ("verl v1 multi-trajectory broadcast (S, L)", _median_ms(verl_multi, max(3, reps // 3))),
    ]  # fmt: skip
    t_ms = dict(rows)

    print(f"verl {verl.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"T = {t} trajectories, groups of {args.group_size}, S = {s} sessions, L = {width}, "
          f"median of {reps} repeats")  # fmt: skip
    print(f"{'estimator':<56}{'ms':>10}")
    for name, ms in rows:
        print(f"{name:<56}{ms:>10.3f}")
    verl_grpo = t_ms["verl compute_grpo_outcome_advantage (T, L)"]
    verl_vec = t_ms["verl compute_grpo_vectorized_outcome_advantage (T, L)"]
    mos = t_ms["ours mosaic, both levels (S,)"]
    print()
    print(f"mosaic / verl grpo            = {mos / verl_grpo:.3f}  (target <= 2)")
    print(f"mosaic / verl grpo vectorized = {mos / verl_vec:.3f}")
    print(f"ours grpo / verl grpo         = {t_ms['ours grpo (T,)'] / verl_grpo:.3f}")
    tok = t_ms["ours grpo expanded to tokens (T, L), like verl"]
    print(f"ours grpo (T, L) / verl grpo vectorized = {tok / verl_vec:.3f}")
    print(f"ours broadcast / verl v1 multi-trajectory = "
          f"{t_ms['ours broadcast of grpo (S,)'] / t_ms['verl v1 multi-trajectory broadcast (S, L)']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
