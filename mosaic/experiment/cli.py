"""``mosaic experiment GRID.yaml`` (run a grid) and ``mosaic experiment report WORK_DIR``.

The runner, report and config modules load torch: they are imported inside the commands so that
``mosaic --help`` stays fast (the same rule for every ``*/cli.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mosaic.config.cliargs import output_error

__all__ = ["register"]

EXIT_USAGE = 2


def _work_dir(args, grid) -> Path:
    return Path(args.work) if args.work else Path("runs") / "experiments" / grid.name


def default_jobs() -> int:
    """One unit per usable core, one thread each, on CPU (measured faster than fewer units with more threads:
    bench/threads.py, docs/speed.md); one at a time when a GPU is visible (units would share its memory)."""
    import torch

    from mosaic.experiment.runner import usable_cores

    return 1 if torch.cuda.is_available() else usable_cores()


def _run(args) -> int:
    import yaml

    from mosaic.experiment.runner import plan, print_plan, run_grid
    from mosaic.experiment.spec import QUICK_GRID, GridError, load_grid, parse_grid

    if args.jobs is None:
        args.jobs = default_jobs()
    if args.jobs < 1:
        print("mosaic experiment: --jobs must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    for flag, path in (("--work", args.work), ("--report", args.report)):
        if path and (why := output_error(flag, path, is_dir=True)):
            print(f"mosaic experiment: {why}", file=sys.stderr)
            return EXIT_USAGE
    try:
        if args.quick:
            work = _work_dir(args, parse_grid(QUICK_GRID))
            work.mkdir(parents=True, exist_ok=True)
            (work / "quick.yaml").write_text(yaml.safe_dump(QUICK_GRID, sort_keys=False))
            args.target = str(work / "quick.yaml")
        grid = load_grid(args.target)
    except GridError as exc:
        print(f"mosaic experiment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    work = _work_dir(args, grid)
    arms = None
    if args.arms:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        if unknown := [a for a in arms if a not in grid.arms]:
            print(f"mosaic experiment: --arms: no arm {', '.join(map(repr, unknown))} in {grid.name} "
                  f"(its arms: {', '.join(grid.arms)})", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
    print_plan(grid, plan(grid, work, arms=arms), work, args.jobs)
    from mosaic.train.preflight import warm_start_error

    if missing := next((f"run {r.name}: {bad}" for r in grid.runs if (bad := warm_start_error(r.config))), None):
        # every run of this warm start would fail at its start: say so before any work
        print(f"mosaic experiment: {missing}", file=sys.stderr)
        return 0 if args.dry_run else EXIT_USAGE
    if args.dry_run:
        return 0
    failed = run_grid(grid, work, jobs=args.jobs, arms=arms)
    if failed:
        print(f"mosaic experiment: {failed} unit(s) failed; rerun the same command to retry them", file=sys.stderr)
        return 1
    if args.report:
        return _report_dir(work, Path(args.report))
    return 0


def _report_dir(work: Path, out: Path) -> int:
    from mosaic.experiment.report import write_report
    from mosaic.experiment.spec import GridError

    try:
        paths = write_report(work, out)
    except GridError as exc:  # a work dir whose grid.yaml was damaged or edited into nonsense
        print(f"mosaic experiment report: {work}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for p in paths:
        print(p)
    return 0


def _dispatch(args) -> int:
    if args.target == "report":
        if not args.rest:
            print("mosaic experiment report: give the grid's work dir (runs/experiments/<grid>)", file=sys.stderr)
            return EXIT_USAGE
        work = Path(args.rest[0])
        if work.name == "grid.yaml" and work.is_file():  # (the grid file inside the work dir: its dir was meant)
            work = work.parent
        if not (work / "grid.yaml").is_file():
            print(f"mosaic experiment report: {work} is not a grid work dir (no grid.yaml)", file=sys.stderr)
            return EXIT_USAGE
        out = Path(args.out) if args.out else Path("reports") / work.name
        if why := output_error("--out", out, is_dir=True):
            print(f"mosaic experiment report: {why}", file=sys.stderr)
            return EXIT_USAGE
        return _report_dir(work, out)
    if args.rest or (args.target is None) == (not args.quick):
        print("mosaic experiment: give one grid file, or --quick", file=sys.stderr)
        return EXIT_USAGE
    return _run(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "experiment", help="run a grid of `mosaic train` runs (arms x settings x seeds) and report it",
        description="mosaic experiment GRID.yaml [--jobs N] [--dry-run] [--report DIR] | mosaic experiment --quick | "
                    "mosaic experiment report WORK_DIR [--out DIR]")
    p.add_argument("target", nargs="?", help="a grid file, or 'report'")
    p.add_argument("--quick", action="store_true", help="run the built-in smoke grid (2 arms x 2 seeds, 3 steps)")
    p.add_argument("rest", nargs="*", help="for 'report': the grid's work dir")
    p.add_argument("--jobs", type=int, default=None,
                   help="units run at once, each with cores / jobs threads "
                        "(default: one per core, 1 thread each; 1 with a GPU)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated cost, run nothing")
    p.add_argument("--arms", metavar="A,B", help="only these arms' runs (and the warm start): finish part of a grid first")
    p.add_argument("--work", help="work dir (default runs/experiments/<grid name>)")
    p.add_argument("--report", metavar="DIR", help="after the grid, write its report to DIR")
    p.add_argument("--out", help="for 'report': where report.md, results.json and plots go (default reports/<grid>)")
    p.set_defaults(func=_dispatch)
