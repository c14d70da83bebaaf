"""``mosaic data …``: generate, inspect, search, score, export and calibrate the deep-search data.

Every command that reads a split takes ``--split`` and the config grammar of every verb
(:mod:`mosaic.config.cliargs`): ``--preset`` (cpu, the default | smollm2 | paper), ``--config YAML``,
``--help-config`` and trailing ``section.field=value`` overrides of the shared sections, e.g.
``data.seed=1 data.world_entities=300 data.n_eval_tasks=50`` — the split is built from the
``data`` section exactly as ``mosaic train`` builds it. Older spellings still work with a
deprecation line: ``--seed N`` (``data.seed``), ``--cache-dir DIR`` (``data.cache_dir``) and
``--set key=value`` (``n_tasks``, ``task_seed``, ``snippet_tokens``, ``snippet_mode``,
``hop_mix=2:0.5,3:0.5``, ``world.<field>``; applied to the split after the sections). The cache
directory is the one of every verb (:mod:`mosaic.envs.cache`). Heavy imports (the split, world and
export modules) stay inside the commands, so that ``mosaic --help`` stays fast.

Bad arguments (a count below its minimum, an unknown or ill-typed ``--set``, a
missing or unreadable input, an unwritable output) exit with status 2 and one
line naming the flag, before any work; never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

EXIT_USAGE = 2


class UsageError(ValueError):
    """A bad command-line argument; the message names the flag."""


# Least value of each integer flag (checked before any work).
_MINIMA = {"k": ("-k", 1), "snippet_tokens": ("--snippet-tokens", 1), "head": ("--head", 0),
           "max_new_tokens": ("--max-new-tokens", 1), "searches_per_hop": ("--searches-per-hop", 1),
           "budget": ("--budget", 1)}  # fmt: skip


def _add_split_args(p: argparse.ArgumentParser, default_split: str = "validation") -> None:
    from mosaic.config.cliargs import add_config_args

    p.add_argument("--split", default=default_split, choices=("train", "validation", "test"))
    p.add_argument("--seed", type=int, default=None, help="deprecated: data.seed=N")
    p.add_argument("--cache-dir", default=None, help="deprecated: data.cache_dir=DIR (default: $MOSAIC_CACHE "
                                                     "or ./.mosaic-cache, for every verb)")
    p.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                   help="deprecated: a split field applied after the sections, e.g. world.n_entities=300")
    add_config_args(p)


def shared_config(args: argparse.Namespace, verb: str):
    """The shared config of the command line (older flags mapped onto their keys, with a deprecation
    line); :class:`UsageError` on a config error, :class:`ConfigExit` for ``--help-config`` /
    ``--print-config``."""
    from mosaic.config.cliargs import deprecated, resolve_config

    aliases = []
    if getattr(args, "seed", None) is not None:
        deprecated(args, f"--seed {args.seed}", f"data.seed={args.seed}")
        aliases.append(f"data.seed={args.seed}")
    if getattr(args, "cache_dir", None) is not None:
        deprecated(args, f"--cache-dir {args.cache_dir}", f"data.cache_dir={args.cache_dir}")
        aliases.append(f"data.cache_dir={args.cache_dir}")
    cfg, code = resolve_config(args, verb, aliases=aliases, sections=("data",))
    if cfg is None:
        raise ConfigExit(code)
    return cfg


class ConfigExit(Exception):
    """``--help-config`` / ``--print-config`` done (status 0), or a config error already printed (2)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def parse_value(text: str):
    """A ``--set`` value: int, then float, else the text."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def split_config_from_args(args: argparse.Namespace, verb: str = "data"):
    """The split config of ``--split``, the shared ``data`` section and the deprecated ``--set`` items;
    :class:`UsageError` naming the ``--set`` item that is malformed, unknown or out of range."""
    import dataclasses

    from mosaic.envs.world import WorldConfig
    from mosaic.envs.splits import split_config_for

    cfg = getattr(args, "resolved_config", None) or shared_config(args, verb)
    args.resolved_config = cfg
    if cfg.data.family != "deepsearch":
        raise UsageError(f"data.family={cfg.data.family}: only generate, show and export (and import of its "
                         "files) are available for this family so far")
    base = split_config_for(cfg, args.split)
    if args.set_items:
        from mosaic.config.cliargs import deprecated

        deprecated(args, "--set", "section.field=value of the data section where one exists (data.seed, "
                   "data.world_entities, data.n_eval_tasks, data.n_train_tasks, data.hop_mix)")
    world_fields = {f.name: f.default for f in dataclasses.fields(WorldConfig)}
    world_over, top_over = {}, {}
    for item in args.set_items:
        if "=" not in item:
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if key.startswith("world."):
            name, v = key[len("world."):], parse_value(value)
            if name not in world_fields:
                raise UsageError(f"--set {item}: unknown world field {name!r}; known: {sorted(world_fields)}")
            default = world_fields[name]
            if isinstance(default, int) and not isinstance(v, int):
                raise UsageError(f"--set {item}: {key} must be an integer, got {value!r}")
            if isinstance(default, float) and not isinstance(v, (int, float)):
                raise UsageError(f"--set {item}: {key} must be a number, got {value!r}")
            world_over[name] = v
        elif key == "hop_mix":
            try:
                top_over[key] = tuple((int(k), float(w)) for k, w in
                                      (pair.split(":") for pair in value.split(",")))
            except ValueError:
                raise UsageError(f"--set hop_mix={value}: expected HOPS:WEIGHT[,HOPS:WEIGHT...], "
                                 f"e.g. hop_mix=2:0.5,3:0.5") from None
        else:
            top_over[key] = parse_value(value)
    given = " ".join(f"--set {x}" for x in args.set_items)
    try:
        sc = dataclasses.replace(base, world=dataclasses.replace(base.world, **world_over)) if world_over else base
    except TypeError as exc:  # (unknown fields and ill-typed numbers are caught above)
        raise UsageError(f"{given}: a world field has the wrong type ({exc})") from None
    except ValueError as exc:
        raise UsageError(f"{given}: {exc}") from None
    try:
        return dataclasses.replace(sc, **top_over)
    except TypeError as exc:
        raise UsageError(f"{given}: bad key or value ({exc})") from None
    except ValueError as exc:
        raise UsageError(f"{given}: {exc}") from None


def _check_args(args: argparse.Namespace) -> None:
    """Flags with a least value, and ``--cache-dir``, checked before any work."""
    for dest, (flag, least) in _MINIMA.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v < least:
                raise UsageError(f"{flag} must be >= {least}, got {v}")
    from mosaic.config.cliargs import output_error

    cache = getattr(args, "cache_dir", None)
    bad = output_error("--cache-dir", cache, is_dir=True) if cache is not None else None
    if bad:
        raise UsageError(bad)


def _guarded(fn):
    """Run a ``data`` command; a bad argument is one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def cmd(args: argparse.Namespace) -> int:
        try:
            _check_args(args)
            code = fn(args)
            from mosaic.config.cliargs import print_deprecations

            print_deprecations(args, f"data {args.data_command}")
            return code
        except UsageError as exc:
            print(f"mosaic data {args.data_command}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ConfigExit as done:
            return done.code

    return cmd


def _load(args: argparse.Namespace):
    from mosaic.envs.cache import cache_dir_error, resolve_cache_dir
    from mosaic.envs.splits import load_split

    sc = split_config_from_args(args, f"data {args.data_command}")
    bad = cache_dir_error(args.resolved_config.data.cache_dir)
    if bad:
        raise UsageError(bad)
    args.cache_root = resolve_cache_dir(args.resolved_config.data.cache_dir)
    try:
        return load_split(args.split, sc, args.cache_root)
    except ValueError as exc:  # some split fields are only checked while generating (hop_mix, snippet_mode)
        if not args.set_items:
            raise
        raise UsageError(f"{' '.join(f'--set {x}' for x in args.set_items)}: {exc}") from None


def _service(args: argparse.Namespace) -> bool:
    """Whether the command line asks for ``data.family=service`` (the config is resolved and kept)."""
    if getattr(args, "resolved_config", None) is None:
        args.resolved_config = shared_config(args, f"data {args.data_command}")
    if args.resolved_config.data.family != "service":
        return False
    if args.data_command not in ("generate", "show", "export"):
        raise UsageError("data.family=service: only generate, show and export (and import of its files) are available "
                         "for this family so far")
    if args.set_items:
        raise UsageError("--set applies to deep-search splits; use data.visits=, data.events_between=, "
                         "data.unannounced_share=, data.n_train_tasks= for the service family")
    if getattr(args, "recall", False):
        raise UsageError("--recall measures deep search's retrieval; the service family has no searched world")
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    import collections
    import time

    if _service(args):
        from mosaic.envs.service.cli import generate

        return generate(args.resolved_config, args.split)
    t0 = time.perf_counter()
    split = _load(args)
    hops = collections.Counter(t.hops for t in split.tasks)
    print(f"split={split.name} entities={len(split.world.entities)} documents={len(split.world.documents)} "
          f"tasks={len(split.tasks)} hops={dict(sorted(hops.items()))} world_seed={split.world.config.seed} "
          f"index={'built' if split.index.built else 'cached'} ({time.perf_counter() - t0:.2f}s)")
    if args.recall:
        from mosaic.envs.deepsearch import retrieval_recall

        r = retrieval_recall(split.index, split.tasks, k=3)
        print(f"retrieval: gold document in top-3 for {r['recall']:.2%} of {r['hops']} hops "
              f"(top-1 {r['top1']:.2%})")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    if _service(args):
        from mosaic.envs.service.cli import show

        bad = show(args.resolved_config, args.split, args.index, args.json)
        if bad:
            raise UsageError(bad)
        return 0
    split = _load(args)
    if not 0 <= args.index < len(split.tasks):
        raise UsageError(f"--index must be in [0, {len(split.tasks)}), got {args.index}")
    t = split.tasks[args.index]
    if args.json:
        print(json.dumps(t.to_json(), indent=2))
        return 0
    print(f"id:       {t.id}\nhops:     {t.hops} ({t.style})\nquestion: {t.question}\nanswer:   {t.answer}")
    for i, h in enumerate(t.gold_chain, 1):
        print(f"  hop {i}: search {h.query!r} -> {h.doc_id} ({h.title}) --{h.relation}--> {h.target}")
    return 0


_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")


def sort_query(args: argparse.Namespace) -> None:
    """``data search``'s positionals, in any order: the ``section.field=value`` overrides, and one QUERY
    (argparse alone would take a lone override for the query, or a query before an override for one)."""
    pool = [*args.overrides, args.query]
    args.overrides, queries = [x for x in pool if _OVERRIDE.match(x)], [x for x in pool if not _OVERRIDE.match(x)]
    if len(queries) != 1:
        raise UsageError("QUERY: give one search query (quoted if it has spaces) besides the SECTION.FIELD=VALUE "
                         f"overrides; got {', '.join(repr(q) for q in queries) or 'none'}")
    args.query = queries[0]


def cmd_search(args: argparse.Namespace) -> int:
    from mosaic.envs.search import SearchIndex, format_hits

    sort_query(args)
    split = _load(args)
    index = split.index
    if args.snippet_tokens is not None:
        index = SearchIndex(split.world, args.cache_root, snippet_tokens=args.snippet_tokens,
                            snippet_mode=split.config.snippet_mode)
    print(format_hits(index.search(args.query, args.k)))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from mosaic.envs.rewards import normalize_answer, score_answer

    if not normalize_answer(args.ground_truth):
        raise UsageError(f"GROUND_TRUTH {args.ground_truth!r}: must be a non-empty answer "
                         f"(once normalized: lower case, no articles or punctuation)")
    s = score_answer(args.text, args.ground_truth, metric=args.metric)
    print(json.dumps({"reward": s.reward, "answer": s.answer, "status": s.status}))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mosaic.envs.export import export_parquet, load_parquet

    from mosaic.config.cliargs import output_error

    bad = output_error("--out", args.out, is_dir=False)
    if bad:
        raise UsageError(bad)
    service = _service(args)
    if service:
        from mosaic.envs.service.splits import load_service_split_for

        split = load_service_split_for(args.resolved_config, args.split)
    else:
        split = _load(args)
    path = export_parquet(split.tasks, args.out, split_config=split.config)
    back = load_parquet(path)  # (service episodes: regenerated from the rows' configs, checked whole)
    if back != split.tasks:
        print(f"round-trip mismatch in {path}", file=sys.stderr)
        return 1
    print(f"wrote {len(split.tasks)} {split.name} {'service episodes' if service else 'tasks'} to {path} "
          f"(verl layout; read back OK)")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import collections

    from mosaic.envs.export import load_parquet

    path = Path(args.path)
    if not path.is_file():
        raise UsageError(f"PATH {path}: " + ("is a directory" if path.is_dir() else "no such file"))
    try:
        tasks = load_parquet(path)
    except Exception as exc:  # noqa: BLE001 — any reader failure: a file that is not an export
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UsageError(f"PATH {path}: not a task Parquet file written by `mosaic data export` "
                         f"({type(exc).__name__}: {first[:200]})") from None
    splits = collections.Counter(t.split for t in tasks)
    if tasks and not hasattr(tasks[0], "hops"):  # service episodes
        visits = collections.Counter(len(t.visits) for t in tasks)
        print(f"{args.path}: {len(tasks)} service episodes, splits={dict(splits)}, visits={dict(sorted(visits.items()))}, "
              f"traps={sum(t.trap for t in tasks)}")
        for t in tasks[: args.head]:
            print(f"  {t.id}: {t.question} -> {t.answer}")
        return 0
    hops = collections.Counter(t.hops for t in tasks)
    print(f"{args.path}: {len(tasks)} tasks, splits={dict(splits)}, hops={dict(sorted(hops.items()))}")
    for t in tasks[: args.head]:
        print(f"  {t.id}: {t.question} -> {t.answer}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from mosaic.envs.calibrate import CalibrationConfig, calibration_table, format_table
    from mosaic.envs.search import SearchIndex

    split = _load(args)
    index = split.index
    if args.snippet_tokens is not None:
        index = SearchIndex(split.world, args.cache_root, snippet_tokens=args.snippet_tokens,
                            snippet_mode=split.config.snippet_mode)
    for budget in args.budget:
        cfg = CalibrationConfig(context_budget=budget, k=args.k, max_new_tokens=args.max_new_tokens,
                                tokenizer=args.tokenizer, searches_per_hop=args.searches_per_hop)
        print(f"\nbudget={budget} tokenizer={args.tokenizer} k={args.k} snippet_tokens="
              f"{index.snippet_tokens} max_new_tokens={args.max_new_tokens} split={split.name} "
              f"(preset {args.resolved_config.preset})")
        print(format_table(calibration_table(index, split.tasks, cfg)))
    return 0


def _data_group(args, parser) -> int:
    """``mosaic data`` without a sub-command: its config keys (``--help-config`` / ``--print-config``),
    else the help."""
    if not (args.help_config or args.print_config):
        parser.print_help()
        return 0
    import yaml

    from mosaic.config.loader import ConfigError, describe_config, load_config  # lazy: torch

    try:
        cfg = load_config(preset=args.preset)
    except ConfigError as exc:
        print(f"mosaic data: config error: {exc}", file=sys.stderr)
        return 2
    if args.help_config:
        print(describe_config(cfg, ("data",)))
    else:
        import dataclasses

        print(yaml.safe_dump({"data": dataclasses.asdict(cfg.data)}, sort_keys=False), end="")
    return 0


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="the task data (deep search; data.family=service): generate, "
                                               "show, search, score, export, import, calibrate")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.add_argument("--preset", help="base preset for --help-config / --print-config: cpu (default), cpu-service, smollm2, paper")
    data.add_argument("--help-config", action="store_true",
                      help="print the data section's keys (what every sub-command takes as data.field=value), then exit")
    data.add_argument("--print-config", action="store_true", help="print the resolved data section, then exit")
    data.set_defaults(func=lambda a: _data_group(a, data))

    p = sub.add_parser("generate", help="generate (or load) a split and print its summary")
    _add_split_args(p, "train")
    p.add_argument("--recall", action="store_true", help="also measure gold-hop retrieval (top-3)")
    p.set_defaults(func=_guarded(cmd_generate))

    p = sub.add_parser("show", help="print one task: question, answer, gold chain")
    _add_split_args(p)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guarded(cmd_show))

    p = sub.add_parser("search", help="run the search tool on a split's world")
    _add_split_args(p)
    p.add_argument("query")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--snippet-tokens", type=int, default=None)
    p.set_defaults(func=_guarded(cmd_search))

    p = sub.add_parser("score", help="score a model message against a ground truth")
    p.add_argument("text", help='the model message, e.g. "<answer>Port Osk</answer>"')
    p.add_argument("ground_truth")
    p.add_argument("--metric", choices=("em", "f1"), default="em")
    p.set_defaults(func=_guarded(cmd_score))

    p = sub.add_parser("export", help="write a split as verl-layout Parquet (and read it back)")
    _add_split_args(p, "train")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_guarded(cmd_export))

    p = sub.add_parser("import", help="read a verl-layout Parquet file written by export")
    p.add_argument("path")
    p.add_argument("--head", type=int, default=3)
    p.set_defaults(func=_guarded(cmd_import))

    p = sub.add_parser("calibrate", help="searches and sessions per hop count under a context budget")
    _add_split_args(p)
    p.add_argument("--budget", type=int, nargs="+", default=[512])
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--searches-per-hop", type=int, default=1)
    p.add_argument("--tokenizer", choices=("proxy", "bpe"), default="proxy")
    p.add_argument("--snippet-tokens", type=int, default=None)
    p.set_defaults(func=_guarded(cmd_calibrate))
