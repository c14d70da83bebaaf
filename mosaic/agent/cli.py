"""``mosaic rollout``: run the agent loop on a split and stream trajectories to JSONL.

Policies: ``expert`` (the scripted gold-chain solver, with noise knobs), ``local``
(a saved embedded model directory, or ``smollm2``) and ``openai`` (any
OpenAI-compatible server, token-in token-out). Each finished trajectory is
written to ``--out`` (overwritten if it exists) as soon as it ends (a crash loses at most the in-flight
ones); a summary table follows. Settings use the grammar of every verb (:mod:`mosaic.config.cliargs`):
``--preset`` (cpu, the default), ``--config YAML``, ``--help-config`` and trailing
``section.field=value`` overrides of the shared sections: ``harness.*`` (the agent loop, as in
``mosaic train``), ``data.*`` (the split's worlds), ``rollout.temperature`` / ``rollout.top_p``
(sampling), ``train.seed`` (the sampling seed); ``noise.<field>=rate`` sets the expert's
:class:`~mosaic.agent.expert.ExpertNoise`. The named flags (``--mode``, ``--context-budget``,
``--max-new-tokens``, ``--max-sessions``, ``--max-turns``, ``--temperature``, ``--top-p``) are
shortcuts applied over the sections. Older spellings still work with a deprecation line:
``--set key=value`` (``harness.key=value``), ``--seed N`` (``data.seed=N train.seed=N``),
``--cache-dir`` (``data.cache_dir``). Model-backed policies import torch inside the command, so
``mosaic --help`` stays fast.

Bad arguments (a count below its minimum, a non-finite or out-of-range number, an
unknown or ill-typed ``--set``, a missing model or tokenizer directory, an
``--out`` / ``--cache-dir`` / ``--save-tokenizer`` that cannot be created, a ``--device`` this
machine does not have under ``--policy local``) exit with status 2 and one line naming the flag, before any
work; never a traceback. ``--n-tasks`` must be >= 1 (leave it out for every task
of the split; ``0`` or a negative count is an error, not "all").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import Counter
from io import StringIO
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mosaic.agent.chat import ChatFormat, load_smollm2_tokenizer
from mosaic.config.harness import MODES, HarnessConfig
from mosaic.agent.expert import ExpertNoise, ExpertPolicy
from mosaic.agent.episode import make_env
from mosaic.agent.harness import Harness
from mosaic.agent.reset import reset_counts
from mosaic.agent.models import load_any
from mosaic.agent.models.corpus import build_project_tokenizer
from mosaic.agent.tokenizer import load_tokenizer, save_tokenizer
from mosaic.config.cliargs import add_config_args, deprecated, device_error, output_error, print_deprecations, resolve_config
from mosaic.config.values import ConfigError
from mosaic.agent.models.checkdir import ModelDirError, tokenizer_dir_error
from mosaic.envs.cache import resolve_cache_dir
from mosaic.envs.cli import EXIT_USAGE, ConfigExit, UsageError, parse_value
from mosaic.envs.splits import load_split
from mosaic.trace import JsonlWriter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout", help="roll out a policy on the tasks (deep search, or data.family=service), stream trajectories "
                        "to JSONL",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=("expert", "local", "openai"), default="expert")
    p.add_argument("--model", default=None,
                   help="local: a saved model directory or 'smollm2'; openai: the model id to request")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai: server root")
    p.add_argument("--tokenizer", default=None,
                   help="a saved tokenizer directory or 'smollm2' (default: the local model's; "
                        "for expert/openai without one, the project tokenizer is trained on the split)")
    p.add_argument("--save-tokenizer", default=None, metavar="DIR",
                   help="save the tokenizer used (e.g. the freshly trained project tokenizer)")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--seed", type=int, default=None, help="deprecated: data.seed=N train.seed=N")
    p.add_argument("--cache-dir", default=None, help="deprecated: data.cache_dir=DIR (default: $MOSAIC_CACHE "
                                                     "or ./.mosaic-cache, for every verb)")
    p.add_argument("--n-tasks", type=int, default=None,
                   help="first N tasks of the split, N >= 1 (default: all)")
    p.add_argument("--group-size", type=int, default=1, help="rollouts per task (G)")
    p.add_argument("--mode", default=None, choices=MODES,
                   help="shortcut for harness.mode")
    p.add_argument("--context-budget", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--max-sessions", type=int, default=None)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                   help="deprecated: harness.KEY=VALUE (noise.<field> still works here too)")
    p.add_argument("--noise", choices=("default", "off"), default="default", help="expert: noise preset")
    p.add_argument("--temperature", type=float, default=None, help="shortcut for rollout.temperature")
    p.add_argument("--top-p", type=float, default=None, help="shortcut for rollout.top_p")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="JSONL file, a trajectory per line as each ends (overwritten); required")
    p.add_argument("--no-progress", action="store_true")
    add_config_args(p)
    p.set_defaults(func=_guarded)


def _guarded(args: argparse.Namespace) -> int:
    """Run ``rollout``; a bad argument is one line on stderr and exit status 2."""
    try:
        code = _run(args)
        print_deprecations(args, "rollout")
        return code
    except (UsageError, ModelDirError) as exc:
        print(f"mosaic rollout: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:  # found once the harness is built (a reset budget that cannot hold a session)
        print(f"mosaic rollout: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigExit as done:
        return done.code


_HARNESS_FLAGS = ("context_budget", "max_new_tokens", "max_sessions", "max_turns")


def _configs(args: argparse.Namespace, base: HarnessConfig | None = None):
    """The harness config (``base``, the shared ``harness`` section, with the flags and ``--set``
    items over it) and expert noise; :class:`UsageError` naming the flag or item that is
    malformed, unknown or out of range."""
    base = base or HarnessConfig()
    h = {f.name: getattr(base, f.name) for f in dataclasses.fields(HarnessConfig)}
    given = {}
    if args.mode is not None:
        h["mode"], given["mode"] = args.mode, f"--mode {args.mode}"
    for flag in _HARNESS_FLAGS:
        if getattr(args, flag) is not None:
            h[flag] = getattr(args, flag)
            given[flag] = f"--{flag.replace('_', '-')} {getattr(args, flag)}"
    n = {}
    known = {f.name for f in dataclasses.fields(HarnessConfig)}
    noise_known = {f.name for f in dataclasses.fields(ExpertNoise)}
    if any(not item.startswith("noise.") for item in args.set_items):
        deprecated(args, "--set KEY=VALUE", "harness.KEY=VALUE (after the flags)")
    for item in args.set_items + [x for x in getattr(args, "noise_items", [])]:
        if "=" not in item:
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if key.startswith("noise."):
            field = key[len("noise."):]
            if field not in noise_known:
                raise UsageError(f"--set {item}: unknown noise field {field!r}; known: {sorted(noise_known)}")
            try:
                n[field] = float(value)
            except ValueError:
                raise UsageError(f"--set {item}: {key} must be a number (a rate in [0, 1])") from None
            if not math.isfinite(n[field]):
                raise UsageError(f"--set {item}: {key} must be finite")
        elif key not in known:
            raise UsageError(f"--set {item}: unknown harness field {key!r}; known: {sorted(known)}")
        else:
            h[key] = parse_value(value)
        given[key] = f"--set {item}"
    try:
        cfg = HarnessConfig(**h)
    except (TypeError, ValueError) as exc:
        # name the flag that set the field the message is about (HarnessConfig.<field>: ...)
        culprit = next((g for k, g in given.items() if f"HarnessConfig.{k}:" in str(exc)), None)
        if culprit is None:  # e.g. a comparison of an ill-typed value: name every flag given
            culprit = " ".join(g for k, g in given.items() if k != "mode")
        raise UsageError(f"{culprit}: bad value ({exc})") from None
    base = ExpertNoise.off() if args.noise == "off" else ExpertNoise()
    try:
        noise = dataclasses.replace(base, **n)
    except (TypeError, ValueError) as exc:
        culprit = next((g for k, g in given.items() if f"ExpertNoise.{k.removeprefix('noise.')}:" in str(exc)),
                       "--set noise.*")
        raise UsageError(f"{culprit}: {exc}") from None
    return cfg, noise


def _check_args(args: argparse.Namespace) -> None:
    """Counts, numbers and paths, checked before any work (see the module docstring)."""
    if not args.out:
        raise UsageError("the following arguments are required: --out")
    if args.n_tasks is not None and args.n_tasks < 1:
        raise UsageError(f"--n-tasks must be >= 1 (leave it out for all tasks), got {args.n_tasks}")
    if args.group_size < 1:
        raise UsageError(f"--group-size must be >= 1, got {args.group_size}")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_p is not None and not (0 < args.top_p <= 1):  # (NaN fails too)
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.policy == "local":
        if not args.model:
            raise UsageError("--policy local needs --model DIR (or 'smollm2')")
        if args.model != "smollm2" and not Path(args.model).is_dir():
            raise UsageError(f"--model {args.model}: neither 'smollm2' nor an existing directory")
    if args.policy == "openai" and not args.base_url.startswith(("http://", "https://")):
        raise UsageError(f"--base-url {args.base_url}: expected an http:// or https:// URL")
    if args.tokenizer and args.tokenizer != "smollm2" and not Path(args.tokenizer).is_dir():
        raise UsageError(f"--tokenizer {args.tokenizer}: neither 'smollm2' nor an existing directory")
    for flag, value, is_dir in (("--cache-dir", args.cache_dir, True), ("--save-tokenizer", args.save_tokenizer, True),
                                ("--out", args.out, False)):
        bad = output_error(flag, value, is_dir=is_dir) if value is not None else None
        if bad:
            raise UsageError(bad)
    if args.policy == "local":  # (the expert and openai policies do not use --device)
        bad = device_error("--device", args.device)
        if bad:
            raise UsageError(bad)


def _tokenizer(args, split, model_tok):
    if args.tokenizer == "smollm2":
        return load_smollm2_tokenizer()
    if args.tokenizer:
        bad = tokenizer_dir_error("--tokenizer", args.tokenizer)
        if bad:
            raise UsageError(bad)
        return load_tokenizer(args.tokenizer)
    if model_tok is not None:
        return model_tok
    print("training the project tokenizer on the split (pass --tokenizer to reuse one)", file=sys.stderr)
    return build_project_tokenizer([split])


def _shared(args: argparse.Namespace):
    """The shared config: trailing overrides (``noise.*`` set aside for the expert), older flags
    mapped onto their keys with a deprecation line."""
    args.noise_items = [x for x in args.overrides if x.startswith("noise.")]
    args.overrides = [x for x in args.overrides if not x.startswith("noise.")]
    aliases = []
    if args.seed is not None:
        deprecated(args, f"--seed {args.seed}", f"data.seed={args.seed} train.seed={args.seed}")
        aliases += [f"data.seed={args.seed}", f"train.seed={args.seed}"]
    if args.cache_dir is not None:
        deprecated(args, f"--cache-dir {args.cache_dir}", f"data.cache_dir={args.cache_dir}")
        aliases.append(f"data.cache_dir={args.cache_dir}")
    if args.mode is not None:  # in the shared config too: overrides that need it (reset_roles) are checked with it
        aliases.append(f"harness.mode={args.mode}")
    shared, code = resolve_config(args, "rollout", aliases=aliases, sections=("data", "harness", "rollout", "train"))
    if shared is None:
        raise ConfigExit(code)
    return shared


def _split(args: argparse.Namespace, shared, cfg):
    """The split to roll out: deep search's (its world cached under ``data.cache_dir``) or the service
    family's episodes (``data.family=service``); one line for what cannot run."""
    from mosaic.envs.cache import cache_dir_error
    from mosaic.envs.splits import split_config_for

    bad = cache_dir_error(shared.data.cache_dir)
    if shared.data.family == "service" and cfg.partner == "expert":
        bad = "config key 'harness.partner': expert: the scripted partner plays deep search only"
    if bad:
        raise UsageError(bad)
    if shared.data.family == "service":
        from mosaic.envs.service.splits import load_service_split_for

        return load_service_split_for(shared, args.split)
    return load_split(args.split, split_config_for(shared, args.split), resolve_cache_dir(shared.data.cache_dir))


def _run(args: argparse.Namespace) -> int:
    shared = _shared(args)  # first: --help-config / --print-config need nothing else
    _check_args(args)
    cfg, noise = _configs(args, shared.harness)
    from mosaic.config.loader import load_config  # (lazy, as before: rollout's --help stays light)

    idle = cfg.idle_reset_note(load_config(shared.preset).harness)
    if idle:  # said before any work, as mosaic train says it
        print(f"mosaic rollout: note: {idle}", file=sys.stderr)
    seed = shared.train.seed
    temperature = shared.rollout.temperature if args.temperature is None else args.temperature
    top_p = shared.rollout.top_p if args.top_p is None else args.top_p
    service = shared.data.family == "service"
    split = _split(args, shared, cfg)
    tasks = split.tasks if args.n_tasks is None else split.tasks[: args.n_tasks]
    model = model_tok = None
    if args.policy == "local":
        model, model_tok = load_any(args.model, device=args.device)
    tok = _tokenizer(args, split, model_tok)
    if args.save_tokenizer:
        save_tokenizer(tok, args.save_tokenizer)
    chat = ChatFormat(tok)
    if args.policy == "expert" and service:  # the revalidating service expert (its noise knobs do not apply)
        from mosaic.agent.service_expert import ServiceExpertPolicy

        policy = ServiceExpertPolicy(tok, tasks)
    elif args.policy == "expert":
        policy = ExpertPolicy(tok, tasks, noise, seed=seed)
    elif args.policy == "local":
        from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig  # lazy: torch; keeps --help fast

        policy = LocalPolicy(model, tok, LocalPolicyConfig(temperature=temperature, top_p=top_p,
                                                           seed=seed), device=args.device)
    else:
        from mosaic.agent.policies.openai import OpenAIPolicy, OpenAIPolicyConfig  # lazy: httpx; keeps --help fast

        policy = OpenAIPolicy(OpenAIPolicyConfig(base_url=args.base_url, model=args.model,
                                                 temperature=temperature, top_p=top_p,
                                                 stop_token_ids=(chat.im_end_id,)))
    partner = None
    if cfg.partner == "expert":  # reset mode's scripted partner; a frozen one is the policy itself here (no training)
        partner = ExpertPolicy(tok, tasks, ExpertNoise.off(), seed=seed)
    elif cfg.partner == "frozen":
        partner = policy
    harness = Harness(policy, chat, make_env(split), cfg, partner=partner)
    out = Path(args.out)
    if out.is_file() and out.stat().st_size:  # a second run appended to the first: duplicate trajectory ids
        print(f"mosaic rollout: --out {out} exists; overwriting it", file=sys.stderr)
        out.write_bytes(b"")
    try:
        with JsonlWriter(args.out) as writer:
            trajs = harness.run(tasks, group_size=args.group_size, seed=seed, on_trajectory=writer.write,
                                progress=not args.no_progress)
    finally:
        close = getattr(policy, "close", None)
        if callable(close):
            close()
    print(summary_table(trajs))
    print(f"wrote {len(trajs)} trajectories to {args.out}")
    return 0


def summarize(trajs) -> dict:
    """Aggregate metrics of a list of trajectories (what the summary table shows)."""
    n = max(len(trajs), 1)
    kinds: Counter = Counter()
    invalid: Counter = Counter()
    ends = Counter(t.end_reason for t in trajs)
    for t in trajs:
        kinds.update(s.kind for s in t.sessions)
        invalid.update(t.meta.get("invalid_actions", {}))
    return {
        "trajectories": len(trajs),
        "accuracy": sum(t.success for t in trajs) / n,
        "mean_reward": sum(t.reward for t in trajs) / n,
        "sessions_per_traj": sum(len(t.sessions) for t in trajs) / n,
        "sessions_by_kind": {k: v / n for k, v in sorted(kinds.items())},
        "compactions": sum(t.meta.get("compactions", 0) for t in trajs) / n,
        "forks": sum(t.meta.get("forks", 0) for t in trajs) / n,
        "invalid_actions": sum(invalid.values()) / n,
        "invalid_by_type": dict(invalid.most_common()),
        "end_reasons": dict(ends.most_common()),
        "tokens_sampled": sum(t.meta.get("tokens_sampled", 0) for t in trajs) / n,
        "tokens_inserted": sum(t.meta.get("tokens_inserted", 0) for t in trajs) / n,
        **service_summary(trajs),
        **{f"reset_{k}": v for k, v in reset_counts(trajs).items()},
    }


def service_summary(trajs) -> dict:
    """The service family's outcomes (``traj.meta["env"]``), as the training logs' ``env/*`` define them
    (:func:`~mosaic.envs.service.rewards.outcome_summary`); {} for deep search."""
    from mosaic.envs.service.rewards import outcome_summary

    return outcome_summary([t.meta["env"] for t in trajs if isinstance(t.meta.get("env"), dict)])


def summary_table(trajs) -> str:
    """A plain-text table (rich-rendered) of :func:`summarize`."""
    s = summarize(trajs)
    table = Table(title=f"rollout summary ({s['trajectories']} trajectories; per-trajectory means)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("accuracy", f"{s['accuracy']:.3f}")
    table.add_row("mean reward", f"{s['mean_reward']:.3f}")
    table.add_row("sessions / trajectory", f"{s['sessions_per_traj']:.2f}")
    for k, v in s["sessions_by_kind"].items():
        table.add_row(f"  {k} sessions", f"{v:.2f}")
    table.add_row("compactions", f"{s['compactions']:.2f}")
    table.add_row("forks", f"{s['forks']:.2f}")
    table.add_row("invalid actions", f"{s['invalid_actions']:.2f}")
    for k, v in s["invalid_by_type"].items():
        table.add_row(f"  {k} (total)", str(v))
    for k, v in s["end_reasons"].items():
        table.add_row(f"end: {k}", str(v))
    table.add_row("tokens sampled", f"{s['tokens_sampled']:.1f}")
    table.add_row("tokens inserted", f"{s['tokens_inserted']:.1f}")
    for k in ("resets", "notes_written", "workspace_full", "partner_sessions", "partner_tokens"):
        if f"reset_{k}" in s:  # (reset mode)
            table.add_row(k.replace("_", " "), f"{s[f'reset_{k}']:.2f}")
    if "actions" in s:  # the service family
        table.add_row("stale actions / actions", f"{s['stale_actions']:.2f} / {s['actions']:.2f}")
        table.add_row("stale-action rate", f"{s['stale_rate']:.3f}")
        table.add_row("visits handled right", f"{s['visits_correct']:.3f}")
        table.add_row("final account state right", f"{s['state_match']:.3f}")
    buf = StringIO()
    Console(file=buf, width=80, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()
