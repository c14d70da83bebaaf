"""``mosaic view PATH``: write one self-contained HTML page showing a run's rollouts.

``PATH`` is a ``mosaic train`` run directory, its ``samples.jsonl``, or a rollouts file
(``mosaic.trajectory`` JSONL). The page needs no server and no network: open it in a browser.
Heavy modules (torch, through the estimators) are imported inside the command, so ``mosaic --help``
stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["register"]


def register(sub) -> None:
    p = sub.add_parser("view", help="write a static HTML page of a run's rollouts: session graphs, transcripts, credit",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("path", metavar="PATH", help="run dir, samples.jsonl, or a rollouts JSONL file")
    p.add_argument("-o", "--out", metavar="HTML",
                   help="output page (default: <run dir>/view.html, or the file's name with .html)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="model/tokenizer directory to print token ids with (default: vocab.json beside the data; a "
                        "`mosaic rollout` file has one when it was written with --save-tokenizer DIR: pass that DIR)")
    p.add_argument("--max-trajectories", type=int, metavar="N", help="keep only the last N trajectories")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from mosaic.config.cliargs import output_error
    from mosaic.trace import TraceError
    from mosaic.view.data import ViewError, load_view
    from mosaic.view.page import write_page

    path = Path(args.path)
    if args.max_trajectories is not None and args.max_trajectories < 1:
        print("mosaic view: --max-trajectories must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (path / "view.html" if path.is_dir() else path.with_suffix(".html"))
    why = output_error("--out" if args.out else "the page", out, is_dir=False)
    if why:
        print(f"mosaic view: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        view = load_view(path, tokenizer=args.tokenizer, max_trajectories=args.max_trajectories)
        write_page(view, out)
    except (ViewError, TraceError, OSError, ValueError) as exc:  # TraceError: a rollouts file that breaks the data model
        print(f"mosaic view: {exc}", file=sys.stderr)
        return 2
    n = len(view["samples"])
    if not n:
        print(f"mosaic view: {path} holds no trajectories (trained with train.rollout_samples=0?); the page shows "
              f"its metrics only", file=sys.stderr)
    fixed = view.get("sanitized", {})
    if any(fixed.values()):
        print(f"mosaic view: made {fixed['text']} text(s) with lone surrogates safe (U+FFFD) and "
              f"{fixed['numbers']} NaN/infinite number(s) null", file=sys.stderr)
    size = out.stat().st_size
    print(f"[mosaic] view: {n} trajectories, {sum(len(t['sessions']) for t in view['samples'])} sessions "
          f"→ {out} ({size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    return 0
