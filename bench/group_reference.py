"""How close are gains scored against the group's answer (``algo.gain_reference=group``, docs/algorithm.md
§4.11) to gains scored against the reference answer (§4.4)? And what does the downstream credit (§4.10)
say beside the immediate gain?

Sampled rollouts of the shipped base model (temperature 1, as in training) on deep-search training tasks,
``--batches`` batches of ``--tasks`` tasks × ``--group`` samples, in ``--mode`` (compaction by default, the
main job's). Per batch, over the non-final sessions whose group has a success:

- Spearman rank correlation of the group-reference gains with the true-reference gains;
- the share of groups with a reference, and how often that reference is the gold answer (the reward is
  exact match, so a success's answer normalises to the gold one);
- with ``--downstream``: the rank correlation of the downstream credit with the immediate gain, and the
  share of sessions where the two disagree in sign.

Prints figures; asserts nothing.

    python bench/group_reference.py                       # 3 batches of 8 tasks x 8, compaction
    python bench/group_reference.py --mode fork --downstream
    python bench/group_reference.py harness.reward_metric=f1 harness.success_threshold=0.5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mosaic.agent.harness import DeepSearchEnv, Harness  # noqa: E402
from mosaic.config.loader import load_config  # noqa: E402
from mosaic.envs.rewards import normalize_answer  # noqa: E402
from mosaic.trace import flatten  # noqa: E402
from mosaic.train import setup  # noqa: E402
from mosaic.train.downstream import group_references, score_downstream, with_references  # noqa: E402
from mosaic.train.pretrain import base_model_dir  # noqa: E402
from mosaic.train.scorer import score_gains  # noqa: E402


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() < 3:
        return float("nan")
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--mode", default="compaction")
    ap.add_argument("--downstream", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. harness.reward_metric=f1 "
                    "harness.success_threshold=0.5 (a success's answer then need not be the gold one)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config("cpu", overrides=[f"data.cache_dir={tempfile.mkdtemp()}", f"harness.mode={args.mode}",
                                        *args.overrides])
    model, tok = setup.load_policy(base_model_dir(cfg.model.embedded_preset), device=torch.device("cpu"),
                                   dtype=torch.float32)
    chat = setup.chat_format(tok)
    split = setup.load_split(cfg, "train")
    rows = []
    for b in range(args.batches):
        tasks = split.tasks[b * args.tasks : (b + 1) * args.tasks]
        policy = setup.sampling_policy(cfg, model, tok, seed=1000 + b)
        t0 = time.perf_counter()
        trajs = Harness(policy, chat, DeepSearchEnv(split), cfg.harness).run(tasks, args.group, seed=b,
                                                                             progress=False)
        t_roll = time.perf_counter() - t0
        true = score_gains(trajs, model, chat.answer_probe).gains
        refs = group_references(trajs)
        grouped = with_references(trajs, refs)
        have = [i for i, t in enumerate(grouped) if t.ground_truth is not None]
        sub = [grouped[i] for i in have]
        g_group = score_gains(sub, model, chat.answer_probe).gains if sub else torch.zeros(0)
        fb_all = flatten(trajs)
        off = [0]
        for t in trajs:
            off.append(off[-1] + len(t.sessions))
        sel = torch.cat([torch.arange(off[i], off[i + 1]) for i in have]) if have else torch.zeros(0, dtype=torch.long)
        live = ~torch.as_tensor(fb_all.is_final)[sel]
        a, g = true[sel][live], g_group[live]
        gold = sum(1 for t in trajs if refs[t.group_id] is not None
                   and normalize_answer(refs[t.group_id]) == normalize_answer(t.ground_truth)) / max(1, len(have))
        row = {"batch": b, "trajs": len(trajs), "success": sum(t.success for t in trajs) / len(trajs),
               "groups_with_ref": sum(r is not None for r in refs.values()) / len(refs),
               "ref_is_gold": gold, "sessions": int(a.numel()), "spearman": spearman(a, g),
               "mean_abs_diff": float((a - g).abs().mean()) if a.numel() else float("nan"), "rollout_s": t_roll}
        if args.downstream:
            r = score_downstream(trajs, model, chat.answer_probe, true, empty_result_ids=chat.tool_delta(""),
                                 header_ids=chat.generation_header_ids)  # fmt: skip
            nf = ~torch.as_tensor(fb_all.is_final)
            d, gg = r.downstream[nf], true[nf]
            row.update({"D_vs_g_spearman": spearman(d, gg), "D_g_disagree": float(((d * gg) < 0).float().mean()),
                        "D_seconds": r.stats.seconds, **{k: v for k, v in r.metrics.items() if k.startswith("dag/")}})
        rows.append(row)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    rho = [r["spearman"] for r in rows if r["spearman"] == r["spearman"]]
    print(f"\ngroup-reference vs true-reference gains: Spearman per batch {', '.join(f'{x:.3f}' for x in rho)}; "
          f"mean {statistics.mean(rho):.3f}" if rho else "\nno batch had a group with a success")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
