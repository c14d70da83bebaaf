"""Size and load time of a ``mosaic view`` page for a run of N trajectories (default 1,000).

The trajectories come from a real run dir's ``samples.jsonl`` (``mosaic train ... train.rollout_samples=K``),
replicated until there are N of them (each copy gets its own trajectory id and group, and copies are
spread over ``--steps`` steps) when the run holds fewer: say so when quoting the figures. Times, in
headless Chromium (``apt-get install chromium``):

- ``build``        ``mosaic view`` itself: read, compact, write the page (Python);
- ``open``         navigation start until the page says it is ready (data parsed, first cards drawn);
- ``all steps``    switching the step filter to every step (draws the first page of cards);
- ``transcript``   a click on a session until its transcript is drawn.

Prints figures (median of ``--repeat`` opens, each in a fresh tab); asserts nothing (benchmarks are not tests).

    python bench/view.py RUN_DIR
    python bench/view.py RUN_DIR --n 1000 --steps 50 --screenshot /tmp/view-1000.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mosaic.view.browser import Browser  # noqa: E402
from mosaic.view.data import load_view  # noqa: E402
from mosaic.view.page import write_page  # noqa: E402


def replicate(run_dir: Path, out_dir: Path, n: int, steps: int) -> int:
    """A copy of ``run_dir``'s samples with ``n`` trajectories over ``steps`` steps; returns how many were real."""
    recs = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    if not recs:
        raise SystemExit(f"{run_dir}/samples.jsonl is empty: train with train.rollout_samples > 0")
    out_dir.mkdir(parents=True, exist_ok=True)
    per_step = -(-n // steps)
    with open(out_dir / "samples.jsonl", "w") as fh:
        for i in range(n):
            r = dict(recs[i % len(recs)])
            copy = i // len(recs)
            r["step"] = 1 + i // per_step
            r["trajectory"] = f"{r['trajectory']}#{copy}"
            r["group_id"] = f"{r['group_id']}#{copy}"
            fh.write(json.dumps(r) + "\n")
    for name in ("vocab.json", "metrics.jsonl", "config.yaml"):
        if (run_dir / name).exists():
            (out_dir / name).write_text((run_dir / name).read_text())
    if (run_dir / "plots").is_dir():
        (out_dir / "plots").mkdir(exist_ok=True)
        for p in (run_dir / "plots").glob("*.png"):
            (out_dir / "plots" / p.name).write_bytes(p.read_bytes())
    return min(n, len(recs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--n", type=int, default=1000, help="trajectories on the page")
    ap.add_argument("--steps", type=int, default=50, help="steps the replicated trajectories are spread over")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--screenshot", type=Path)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "run"
        real = replicate(args.run_dir, work, args.n, args.steps)
        t0 = time.perf_counter()
        view = load_view(work)
        page = write_page(view, work / "view.html")
        build = time.perf_counter() - t0
        sessions = sum(len(t["sessions"]) for t in view["samples"])
        tokens = sum(len(s["prompt"]) + len(s["completion"]) for t in view["samples"] for s in t["sessions"])
        print(f"page: {args.n} trajectories ({real} real, the rest replicated), {sessions} sessions, "
              f"{tokens} stored tokens, {args.steps} steps")
        print(f"size: {page.stat().st_size / 1e6:.2f} MB")
        print(f"build: {build:.2f} s (python, mosaic view)")
        opens, ready_ms, alls, clicks = [], [], [], []
        with Browser() as b:
            for _ in range(args.repeat):
                b.send("Page.navigate", {"url": "about:blank"})
                opens.append(b.open(page))
                ready_ms.append(b.eval("window.mosaicViewReadyMs"))
                t = time.perf_counter()
                b.eval("(() => { const s = document.getElementById('f-step'); s.value = 'all';"
                       " s.dispatchEvent(new Event('change')); })()")
                alls.append(time.perf_counter() - t)
                t = time.perf_counter()
                b.click("article.traj g.node")
                b.wait_for("!document.getElementById('transcript').hidden")
                clicks.append(time.perf_counter() - t)
            errors = b.page_errors()
            if args.screenshot:
                b.screenshot(args.screenshot)
        med = statistics.median
        print(f"open: {med(opens):.2f} s median of {args.repeat} (page's own clock: ready at {med(ready_ms):.0f} ms)")
        print(f"all steps: {1000 * med(alls):.0f} ms; transcript after a click: {1000 * med(clicks):.0f} ms")
        if errors:
            print(f"page errors: {errors}")
        if args.screenshot:
            print(f"screenshot: {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
