"""``mosaic train | sft | eval | compare``.

``train``, ``sft``, ``eval`` and ``pretrain`` take ``--config YAML``, ``--preset NAME`` and
trailing ``section.field=value`` overrides (the grammar of every verb, :mod:`mosaic.config.cliargs`);
the config is resolved and validated first, and an invalid one exits with status 2 and the
message before any work. ``--print-config`` prints the resolved YAML and exits;
``--help-config`` prints every key with its value under the preset and its docstring.
``compare`` compares two arms from per-question outcome files: one file per arm tests the two trained
models on these questions (the unit is the question: conditional on the models); several files per arm
(one per training seed, comma-separated) test the arms over seeds (``mosaic.train.seedstats``). Bad
flags (``eval --checkpoint`` that is missing or does not verify, ``compare``
with a missing file, ``--n-boot 0``, ``--ci 2``) exit with status 2 and one
line naming the flag.

The trainer modules (torch) are imported inside the commands so that ``mosaic --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["register"]

EXIT_CONFIG = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from mosaic.config.cliargs import add_config_args

    add_config_args(p)


def _config(args):
    """The resolved config, or (None, exit code) after printing the error / --help-config / --print-config."""
    from mosaic.config.cliargs import resolve_config

    return resolve_config(args, args.command)


def _eval_args_error(args) -> str | None:
    """``eval --checkpoint / --out`` checked before any work; a run dir becomes its newest checkpoint
    that verifies (those skipped are printed). The message names the flag, or None when fine."""
    from mosaic.train.checkpoint import find_latest, verify_checkpoint

    from mosaic.config.cliargs import output_error

    bad = output_error("--out", args.out, is_dir=False) if args.out else None
    if bad:
        return bad
    if args.checkpoint is None:
        return None
    p = Path(args.checkpoint)
    if not p.exists():
        return f"--checkpoint {p}: no such directory"
    if not p.is_dir():
        return f"--checkpoint {p}: not a directory (want a checkpoint, a model directory or a run dir)"
    if (p / "COMPLETE").exists() or (p / "model").is_dir():  # a checkpoint
        why = verify_checkpoint(p)
        return f"--checkpoint {p}: not a usable checkpoint: {why}" if why else None
    if (p / "config.json").exists():  # a model directory
        from mosaic.agent.models.checkdir import model_dir_error

        bad = model_dir_error(p)
        return f"--checkpoint {bad}" if bad else None
    skipped: list[str] = []
    found = find_latest(p, verify=True, skipped=skipped)
    for why in skipped:
        print(f"[mosaic] eval: skipping {why}", file=sys.stderr)
    if found is None:
        return (f"--checkpoint {p}: neither a checkpoint, a model directory nor a run dir with a checkpoint "
                f"that verifies")
    args.checkpoint = str(found)
    return None


def _run(fn_name: str):
    def cmd(args) -> int:
        cfg, code = _config(args)
        if cfg is None:
            return code
        from mosaic.train import entrypoints
        from mosaic.train.checkpoint import CheckpointError
        from mosaic.agent.models.checkdir import ModelDirError
        from mosaic.config.loader import ConfigError
        from mosaic.train.preflight import eval_error, eval_notes, sft_error, train_error, train_notes

        bad = {"run_train": lambda: train_error(cfg), "run_sft": lambda: sft_error(cfg),
               "run_eval": lambda: eval_error(cfg, args.checkpoint)}[fn_name]()
        if bad:  # a path the config names that cannot be used: before any work
            print(f"mosaic {args.command}: config error: {bad}", file=sys.stderr)
            return EXIT_CONFIG
        notes = {"run_train": lambda: train_notes(cfg),
                 "run_eval": lambda: eval_notes(cfg, args.checkpoint, getattr(args, "config", None))}
        for note in notes.get(fn_name, list)():
            print(f"[mosaic] note: {note}", file=sys.stderr, flush=True)
        try:
            if fn_name == "run_eval":
                bad = _eval_args_error(args)
                if bad:
                    print(f"mosaic {args.command}: {bad}", file=sys.stderr)
                    return EXIT_CONFIG
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
        except CheckpointError as exc:  # a resume that must not go on (changed config) or a corrupt checkpoint
            print(f"mosaic {args.command}: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except ConfigError as exc:  # found once the run looks around (e.g. a logger that is not installed)
            print(f"mosaic {args.command}: config error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except ModelDirError as exc:  # a checkpoint's or warm start's model directory that does not load
            print(f"mosaic {args.command}: model error: {exc}", file=sys.stderr)
            return EXIT_CONFIG

    return cmd


def _compare_args_error(args) -> str | None:
    if not 1 <= args.n_boot <= 10_000_000:
        return f"--n-boot must be in [1, 10000000], got {args.n_boot}"
    if getattr(args, "seed", 0) is not None and not 0 <= getattr(args, "seed", 0) <= 2**32 - 1:
        return f"--seed must be in [0, {2**32 - 1}], got {args.seed}"
    if not 0 < args.ci < 1:
        return f"--ci must be in (0, 1), got {args.ci}"
    for name, paths in (("a", args.a), ("b", args.b)):
        for path in paths.split(","):
            if not path.strip():
                return f"outcome file {name}: an empty name in {paths!r} (a stray comma?)"
            p = Path(path)
            if not p.is_file():
                return f"outcome file {name} ({path}): " + ("is a directory" if p.is_dir() else "no such file")
    if (args.a.count(",") == 0) != (args.b.count(",") == 0):
        return "give one outcome file per arm, or several (one per training seed, comma-separated) for both"
    return None


def _compare(args) -> int:
    from mosaic.train.stats import compare_outcome_files, format_comparison

    bad = _compare_args_error(args)
    if bad:
        print(f"mosaic compare: {bad}", file=sys.stderr)
        return EXIT_CONFIG

    try:
        if "," in args.a:
            return _compare_seeds(args)
        c = compare_outcome_files(args.a, args.b, ci=args.ci, n_boot=args.n_boot, seed=args.seed,
                                  on_mismatch="intersect" if args.intersect else "error")  # fmt: skip
    except (OSError, ValueError) as exc:
        # (the library's hint names its keyword; the command line's switch is --intersect)
        msg = str(exc).replace("pass on_mismatch='intersect'", "pass --intersect")
        print(f"mosaic compare: {msg}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"unit": "questions", **asdict(c)}, indent=1))
    else:
        print("unit: questions, conditional on the two trained models (one run each): this says whether these "
              "checkpoints differ on these questions, not whether their training settings do; for that, give "
              "several runs (seeds) per arm: mosaic compare A1,A2,... B1,B2,...")  # fmt: skip
        print(format_comparison(c, args.name_a or "A", args.name_b or "B"))
    return 0


def _compare_seeds(args) -> int:
    """Several outcome files per arm, one per training seed: the seed is the unit."""
    from dataclasses import asdict

    from mosaic.train.seedstats import aa_calibration, compare_seeds, format_seed_comparison, seed_matrices

    _, a, b = seed_matrices(args.a.split(","), args.b.split(","), on_mismatch="intersect" if args.intersect else "error")
    c = compare_seeds(a, b, ci=args.ci, n_boot=args.n_boot, seed=args.seed)
    names = (args.name_a or "A", args.name_b or "B")
    aa = {n: aa_calibration(x, seed=args.seed) for n, x in zip(names, (a, b)) if x.shape[0] >= 4}
    if args.json:
        print(json.dumps({"unit": "seeds", **asdict(c), "aa": {n: asdict(r) for n, r in aa.items()}}, indent=1))
    else:
        print(format_seed_comparison(c, aa, *names))
    return 0


def _pretrain(args) -> int:
    cfg, code = _config(args)
    if cfg is None:
        return code
    from mosaic.config.cliargs import output_error
    from mosaic.train.pretrain import BASE_MODELS_DIR, PretrainConfig, pretrain

    bad = output_error("--out", args.out, is_dir=True) if args.out else None
    if bad:
        print(f"mosaic pretrain: {bad}", file=sys.stderr)
        return EXIT_CONFIG

    try:
        pc = PretrainConfig(**{k: v for k, v in (("steps", args.steps), ("lr", args.lr),
                                                 ("batch_size", args.batch_size),
                                                 ("vocab_size", args.vocab_size), ("seed", args.seed),
                                                 ("eval_every", args.eval_every), ("init", args.init),
                                                 ("copy_share", args.copy_share), ("save_every", args.save_every),
                                                 ("world_seed_base", args.world_seed_base),
                                                 ("service_share", args.service_share),
                                                 ("service_drills", args.service_drills),
                                                 ("modes", tuple(m.strip() for m in args.modes.split(",") if m.strip())
                                                  if args.modes is not None else None)) if v is not None})
    except ValueError as exc:
        print(f"mosaic pretrain: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.out and args.into_package:
        print("mosaic pretrain: --out and --into-package name two destinations; pass one", file=sys.stderr)
        return EXIT_CONFIG
    if args.into_package:  # the model the package ships (and `mosaic train` starts from): only when asked
        out = str(BASE_MODELS_DIR / (cfg.model.base or f"{cfg.model.embedded_preset}-base"))
        if bad := output_error("--into-package (model.base)", out, is_dir=True):
            print(f"mosaic pretrain: {bad}", file=sys.stderr)
            return EXIT_CONFIG
    else:
        out = args.out or str(Path("runs") / "pretrain" / (cfg.model.base or f"{cfg.model.embedded_preset}-base"))
    from mosaic.train.pretrain import PretrainError

    print(f"[mosaic] pretrain: writing to {out}", file=sys.stderr)
    try:
        meta = pretrain(cfg, pc, out, overwrite=args.into_package)
    except PretrainError as exc:  # `out` holds another run or an unreadable state; an init of another tokenizer
        print(f"mosaic pretrain: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"[mosaic] pretrain: {meta['parameters'] / 1e6:.2f}M parameters, {pc.steps} steps over "
          f"{meta['worlds']} worlds, final loss {meta['final_loss']:.3f}, {meta['seconds']:.0f} s -> {out}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("pretrain", help="build the embedded base model (expert rollouts over generated "
                                               "training-partition worlds)")
    p.add_argument("--out", help="output dir (default: runs/pretrain/<embedded preset>-base)")
    p.add_argument("--into-package", action="store_true",
                   help="write over the base model shipped inside the installed package (what `mosaic train` "
                        "starts from)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 1500)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 2e-3)")
    p.add_argument("--batch-size", type=int, help="rows per step (default 16)")
    p.add_argument("--vocab-size", type=int, help="tokenizer vocabulary (default 1024)")
    p.add_argument("--eval-every", type=int, help="validation check interval in steps (default 250)")
    p.add_argument("--seed", type=int, help="init / order seed (default 0)")
    p.add_argument("--init", help="continue from this saved model directory (same tokenizer recipe)")
    p.add_argument("--world-seed-base", type=int,
                   help="data seed of the first world (default 1000; use fresh seeds when continuing)")
    p.add_argument("--service-share", type=float,
                   help="share of the worlds that are service-family episodes (default 0: deep search only)")
    p.add_argument("--service-drills", type=float,
                   help="share of the drills that are service account drills (read a value, write a call; default 0)")
    p.add_argument("--modes", help="harness modes cycled over the deep-search worlds, comma-separated "
                                   "(default compaction,compaction,fork)")
    p.add_argument("--copy-share", type=float, help="share of each batch made of name drills (default 0.25)")
    p.add_argument("--save-every", type=int, help="write the resumable state every N steps (default 50; 0: only at "
                                                  "the validation checks); a stopped run started again with the "
                                                  "same --out and config goes on from there")
    _add_config_args(p)
    p.set_defaults(func=_pretrain)

    p = subparsers.add_parser("train", help="RL training (GRPO / broadcast / Mosaic) on the tasks (deep search, or "
                                            "data.family=service)")
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

    p = subparsers.add_parser("compare", help="compare two arms: one outcome file each (questions as the unit, "
                              "conditional on the two models) or one per training seed (seeds as the unit)")
    p.add_argument("a", help="outcome file of arm A (JSONL: question_id + correct, one line per sample), or "
                   "several, one per training seed, comma-separated: then the seed is the unit")
    p.add_argument("b", help="outcome file(s) of arm B, same questions")
    p.add_argument("--n-boot", type=int, default=10000, help="bootstrap resamples (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--ci", type=float, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--intersect", action="store_true", help="compare the common questions instead of failing")
    p.add_argument("--name-a", help="label of A")
    p.add_argument("--name-b", help="label of B")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_compare)
