"""``mosaic train | sft | eval | compare``.

``train``, ``sft`` and ``eval`` take ``--config YAML``, ``--preset NAME`` and
trailing ``section.field=value`` overrides; the config is resolved and
validated first, and an invalid one exits with status 2 and the message
before any work. ``--print-config`` prints the resolved YAML and exits.
``compare`` runs a paired bootstrap on two per-question outcome files.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register"]

EXIT_CONFIG = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="YAML file of config sections (merged over the preset)")
    p.add_argument("--preset", help="base preset: cpu (default), smollm2, paper")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. algo.lam=0.2")


def _config(args):
    """The resolved config, or (None, exit code) after printing the error."""
    from mosaic.train.config import ConfigError, dump_config, load_config

    try:
        cfg = load_config(preset=args.preset, yaml_path=args.config, overrides=args.overrides)
    except ConfigError as exc:
        print(f"mosaic {args.command}: config error: {exc}", file=sys.stderr)
        return None, EXIT_CONFIG
    if args.print_config:
        print(dump_config(cfg), end="")
        return None, 0
    return cfg, None


def _run(fn_name: str):
    def cmd(args) -> int:
        cfg, code = _config(args)
        if cfg is None:
            return code
        from mosaic.train import entrypoints

        try:
            if fn_name == "run_eval":
                return int(entrypoints.run_eval(cfg, args.checkpoint, args.out) or 0)
            if fn_name == "run_train":
                try:
                    entrypoints.prepare_run(cfg)
                except FileNotFoundError as exc:  # a bad train.resume path is a config error
                    print(f"mosaic {args.command}: config error: {exc}", file=sys.stderr)
                    return EXIT_CONFIG
            return int(getattr(entrypoints, fn_name)(cfg) or 0)
        except NotImplementedError as exc:
            print(f"mosaic {args.command}: not implemented yet: {exc}", file=sys.stderr)
            return 1

    return cmd


def _compare(args) -> int:
    from mosaic.train.stats import compare_outcome_files, format_comparison

    try:
        c = compare_outcome_files(args.a, args.b, ci=args.ci, n_boot=args.n_boot, seed=args.seed,
                                  on_mismatch="intersect" if args.intersect else "error")  # fmt: skip
    except (OSError, ValueError) as exc:
        print(f"mosaic compare: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(c), indent=1))
    else:
        print(format_comparison(c, args.name_a or "A", args.name_b or "B"))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="RL training (GRPO / broadcast / Mosaic) on the deep-search tasks")
    _add_config_args(p)
    p.set_defaults(func=_run("run_train"))

    p = subparsers.add_parser("sft", help="warm-start SFT on scripted-expert trajectories")
    _add_config_args(p)
    p.set_defaults(func=_run("run_sft"))

    p = subparsers.add_parser("eval", help="evaluate a checkpoint on held-out tasks; writes per-question outcomes")
    p.add_argument("--checkpoint", help="checkpoint dir or run dir (default: the config's run dir, latest)")
    p.add_argument("--out", help="per-question outcome file to write (JSONL)")
    _add_config_args(p)
    p.set_defaults(func=_run("run_eval"))

    p = subparsers.add_parser("compare", help="paired bootstrap CI of the accuracy difference of two outcome files")
    p.add_argument("a", help="outcome file of run A (JSONL: question_id + correct, one line per sample)")
    p.add_argument("b", help="outcome file of run B, same questions")
    p.add_argument("--n-boot", type=int, default=10000, help="bootstrap resamples (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--ci", type=float, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--intersect", action="store_true", help="compare the common questions instead of failing")
    p.add_argument("--name-a", help="label of A")
    p.add_argument("--name-b", help="label of B")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_compare)
