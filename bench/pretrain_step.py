"""A pretraining step in length groups against one padded batch (``mosaic pretrain``'s ``lm_step``).

The same batches of expert rows (generated worlds of both families, as ``mosaic pretrain --service-share``
mixes them, plus copy drills), the same model and optimizer state, run once as one right-padded batch
(``max_tokens`` unbounded) and once in micro-batches of similar length (the default ``max_tokens``),
alternating batch by batch so both see the same machine load. Prints CPU seconds per step (this process's
CPU time: a shared machine's load does not count), the share of padded positions that are real tokens,
the ratio, and the largest loss difference (the two are the same step up to float rounding).

    python bench/pretrain_step.py                      # 6 batches of 16 rows, 1 thread
    python bench/pretrain_step.py --batches 10 --threads 2 --service-share 0
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--service-share", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=8192, help="the grouped side's budget per micro-batch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from mosaic.config.loader import load_config
    from mosaic.train import pretrain as pt
    from mosaic.train.batching import row_lengths
    from mosaic.train.setup import base_model_dir

    cfg = load_config("cpu")
    pc = pt.PretrainConfig(service_share=args.service_share, modes=("compaction", "compaction", "fork", "reset"),
                           init=str(base_model_dir(cfg.model.embedded_preset, "tiny-base")))
    work = Path(tempfile.mkdtemp(prefix="bench-pretrain-"))
    run = pt._Run(cfg, pc, work, torch.device("cpu"))
    rows: list = []
    k = 0
    while len(rows) < args.batches * args.batch_size:
        new, _ = pt.world_rows(cfg, pc, k, run.tok, run.chat, work / "gen")
        rows += new
        k += 1
    rng = random.Random(0)
    rng.shuffle(rows)
    batches = [rows[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.batches)]

    sides = {"padded": 10 ** 12, "length groups": args.max_tokens}
    models = {n: copy.deepcopy(run.model).train() for n in sides}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    cpu: dict[str, list[float]] = {n: [] for n in sides}
    losses: dict[str, list[float]] = {n: [] for n in sides}
    real = padded = 0
    for b in batches:
        lengths = row_lengths(b)
        real += sum(lengths)
        padded += len(lengths) * max(lengths)
        for name, budget in sides.items():
            t = time.process_time()
            act, _ = pt.lm_step(models[name], b, opts[name], pad_id=run.tok.pad_token_id,
                                device=torch.device("cpu"), context_weight=pc.context_weight, max_tokens=budget)
            cpu[name].append(time.process_time() - t)
            losses[name].append(act)
    print(f"{args.batches} batches of {args.batch_size} rows ({len(rows)} rows from {k} worlds, service share "
          f"{args.service_share}), {args.threads} thread(s); real tokens {100 * real / padded:.0f} % of a padded batch")
    for name in sides:
        print(f"{name:14s} {statistics.median(cpu[name]):7.2f} CPU s per step (median), {sum(cpu[name]):7.1f} in all")
    print(f"padded / length groups: {sum(cpu['padded']) / sum(cpu['length groups']):.2f}x; largest expert-loss "
          f"difference {max(abs(a - b) for a, b in zip(losses['padded'], losses['length groups'])):.2e}")


if __name__ == "__main__":
    main()
