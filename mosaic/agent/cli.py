"""``mosaic rollout``: run the agent loop on a split and stream trajectories to JSONL.

Policies: ``expert`` (the scripted gold-chain solver, with noise knobs), ``local``
(a saved embedded model directory, or ``smollm2``) and ``openai`` (any
OpenAI-compatible server, token-in token-out). Each finished trajectory is
appended to ``--out`` as soon as it ends (a crash loses at most the in-flight
ones); a summary table follows. Harness fields: the named flags or
``--set key=value`` for any :class:`~mosaic.agent.harness.HarnessConfig` field;
``--set noise.<field>=rate`` for the expert's :class:`~mosaic.agent.expert.ExpertNoise`.
Model-backed policies import torch inside the command, so ``mosaic --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from io import StringIO

from rich.console import Console
from rich.table import Table

from mosaic.agent.chat import ChatFormat, load_smollm2_tokenizer
from mosaic.agent.config import HarnessConfig
from mosaic.agent.expert import ExpertNoise, ExpertPolicy
from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.agent.models import load_any
from mosaic.agent.models.corpus import build_project_tokenizer
from mosaic.agent.tokenizer import load_tokenizer, save_tokenizer
from mosaic.envs.cli import parse_value
from mosaic.envs.splits import load_split, split_config
from mosaic.trace import JsonlWriter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout", help="roll out a policy on deep-search tasks, stream trajectories to JSONL",
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
    p.add_argument("--preset", default="paper", choices=("paper", "cpu"))
    p.add_argument("--seed", type=int, default=0, help="data seed (split worlds) and rollout seed")
    p.add_argument("--cache-dir", default=None, help="split cache (default: $MOSAIC_CACHE or ~/.cache/mosaic)")
    p.add_argument("--n-tasks", type=int, default=None, help="first N tasks of the split (default: all)")
    p.add_argument("--group-size", type=int, default=1, help="rollouts per task (G)")
    p.add_argument("--mode", default="compaction", choices=("single", "compaction", "fork", "compaction+fork"))
    p.add_argument("--context-budget", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--max-sessions", type=int, default=None)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any HarnessConfig field, or noise.<field> for the expert")
    p.add_argument("--noise", choices=("default", "off"), default="default", help="expert: noise preset")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="JSONL file (appended)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _configs(args: argparse.Namespace):
    h = {"mode": args.mode}
    for flag in ("context_budget", "max_new_tokens", "max_sessions", "max_turns"):
        if getattr(args, flag) is not None:
            h[flag] = getattr(args, flag)
    n = {}
    for item in args.overrides:
        if "=" not in item:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if key.startswith("noise."):
            n[key[len("noise."):]] = float(value)
        else:
            h[key] = parse_value(value)
    known = {f.name for f in dataclasses.fields(HarnessConfig)}
    bad = sorted(set(h) - known)
    if bad:
        raise SystemExit(f"unknown harness field(s) {bad}; known: {sorted(known)}")
    try:
        cfg = HarnessConfig(**h)
        base = ExpertNoise.off() if args.noise == "off" else ExpertNoise()
        noise = dataclasses.replace(base, **n)
    except (TypeError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    return cfg, noise


def _tokenizer(args, split, model_tok):
    if args.tokenizer == "smollm2":
        return load_smollm2_tokenizer()
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if model_tok is not None:
        return model_tok
    print("training the project tokenizer on the split (pass --tokenizer to reuse one)", file=sys.stderr)
    return build_project_tokenizer([split])


def _run(args: argparse.Namespace) -> int:
    cfg, noise = _configs(args)
    split = load_split(args.split, split_config(args.split, args.preset, seed=args.seed), args.cache_dir)
    tasks = split.tasks[: args.n_tasks] if args.n_tasks else split.tasks
    model = model_tok = None
    if args.policy == "local":
        if not args.model:
            raise SystemExit("--policy local needs --model DIR (or 'smollm2')")
        model, model_tok = load_any(args.model, device=args.device)
    tok = _tokenizer(args, split, model_tok)
    if args.save_tokenizer:
        save_tokenizer(tok, args.save_tokenizer)
    chat = ChatFormat(tok)
    if args.policy == "expert":
        policy = ExpertPolicy(tok, tasks, noise, seed=args.seed)
    elif args.policy == "local":
        from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig  # lazy: torch; keeps --help fast

        policy = LocalPolicy(model, tok, LocalPolicyConfig(temperature=args.temperature, top_p=args.top_p,
                                                           seed=args.seed), device=args.device)
    else:
        from mosaic.agent.policies.openai import OpenAIPolicy, OpenAIPolicyConfig  # lazy: httpx; keeps --help fast

        policy = OpenAIPolicy(OpenAIPolicyConfig(base_url=args.base_url, model=args.model,
                                                 temperature=args.temperature, top_p=args.top_p,
                                                 stop_token_ids=(chat.im_end_id,)))
    harness = Harness(policy, chat, DeepSearchEnv(split), cfg)
    try:
        with JsonlWriter(args.out) as writer:
            trajs = harness.run(tasks, group_size=args.group_size, seed=args.seed, on_trajectory=writer.write,
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
    }


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
    buf = StringIO()
    Console(file=buf, width=80, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()
