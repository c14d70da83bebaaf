"""``mosaic proxy``: record an agent harness's model calls and export its session graphs.

    mosaic proxy serve --upstream http://127.0.0.1:8000 --out runs/capture
    mosaic proxy --upstream URL --out DIR            # same as ``serve``
    mosaic proxy export --records runs/capture --out sessions.parquet [--force] [--tokenizer DIR] [rules.k=v ...]
    mosaic proxy scripted-upstream --port 8001       # the deterministic test upstream (mosaic.capture.scripted)

The servers import FastAPI inside their commands, so ``mosaic --help`` stays fast.

Bad arguments (a port outside [0, 65535] or one that cannot be bound, a
non-positive or non-finite ``--timeout`` / ``--max-body-mb``, ``--retries -1``, an
upstream that is not an http(s) URL, a missing ``--records`` or ``--tokenizer``,
an ``--out`` that cannot be created, an export ``--out`` that exists without
``--force``, a bad ``--rule``, an unset ``--api-key-env``, a
``--log-level`` uvicorn does not know; for ``scripted-upstream`` the port, ``--tokenizer``,
``--delay`` and ``--slots``) exit with status 2 and one line naming the flag, before any work. ``export``
skips a record with a bad field (and the rest of its rollout) with a warning
naming ``file:line`` and the field, and counts it (``bad_records``); every rollout
it leaves out is counted by reason (``dropped``) and named in one warning line,
the same report offline replay prints; a records
file it cannot read at all (a broken line, a foreign schema) is one line and
status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import warnings
from dataclasses import MISSING, fields
from pathlib import Path

from mosaic.agent.models.checkdir import tokenizer_dir_error
from mosaic.agent.tokenizer import load_tokenizer
from mosaic.capture.reconstruct import ReconstructionRules, reconstruct
from mosaic.capture.records import RecordError, read_records
from mosaic.capture.wire import retokenize
from mosaic.config.cliargs import output_error
from mosaic.envs.cli import EXIT_USAGE, UsageError
from mosaic.trace.graph import TraceError, validate
from mosaic.trace.storage import write_jsonl, write_parquet


# uvicorn's log levels (uvicorn.config.LOG_LEVELS; not imported here, to keep `mosaic --help` fast)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _add_serve_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--upstream", required=required, help="base URL of the model server (vLLM, SGLang, ...)")
    p.add_argument("--out", help="directory for records.jsonl (required with --upstream)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the bearer token clients must send")
    p.add_argument("--upstream-api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the bearer token sent to the upstream")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="overall deadline per call, seconds (connects, retries, generation, stream)")
    p.add_argument("--retries", type=int, default=2,
                   help="bounded retries when the upstream cannot be connected to (a sent request is never re-sent)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="model tokenizer, used when the upstream returns no token ids (records get retokenized)")
    p.add_argument("--no-token-ids-flag", action="store_true",
                   help="do not add return_token_ids to forwarded requests (for upstreams that reject it)")
    p.add_argument("--fsync", action="store_true", help="fsync every record (durable against power loss)")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="uvicorn's log level")


def _guarded(fn):
    """Run a ``proxy`` command; a bad argument is one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def cmd(args) -> int:
        try:
            return fn(args)
        except UsageError as exc:
            name = getattr(args, "proxy_command", None) or "serve"
            print(f"mosaic proxy {name}: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return cmd


def _check_serve_args(args) -> None:
    from mosaic.serving import address_error  # lazy: uvicorn

    if not args.upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream {args.upstream}: expected an http:// or https:// URL")
    if not args.out:
        raise UsageError("--out DIR is required")
    bad = output_error("--out", args.out, is_dir=True)
    if bad:
        raise UsageError(bad)
    for flag, value in (("--max-body-mb", args.max_body_mb), ("--timeout", args.timeout)):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a finite number > 0, got {value}")
    if args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")
    if args.tokenizer is not None and (bad := tokenizer_dir_error("--tokenizer", args.tokenizer)):
        raise UsageError(bad)
    bad = address_error(args.host, args.port)
    if bad:
        raise UsageError(bad)


def _check_export_args(args) -> None:
    records = Path(args.records)
    if not records.exists():
        raise UsageError(f"--records {records}: no such file or directory")
    if records.is_dir() and not any(records.glob("*.jsonl")):
        raise UsageError(f"--records {records}: no *.jsonl record files in this directory")
    out = Path(args.out)
    if out.suffix not in (".jsonl", ".parquet"):
        raise UsageError(f"--out {args.out}: use a .jsonl or .parquet file")
    bad = output_error("--out", args.out, is_dir=False)
    if bad:
        raise UsageError(bad)
    if out.exists() and not args.force:
        raise UsageError(f"--out {args.out}: the file exists; pass --force to replace it")
    if args.tokenizer is not None and (bad := tokenizer_dir_error("--tokenizer", args.tokenizer)):
        raise UsageError(bad)


def register(subparsers) -> None:
    p = subparsers.add_parser("proxy", help="recording OpenAI-compatible proxy: capture any harness's sessions",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_args(p, required=False)
    p.set_defaults(func=_guarded(_cmd_proxy), _proxy_parser=p)
    sub = p.add_subparsers(dest="proxy_command", metavar="SUBCOMMAND")

    s = sub.add_parser("serve", help="run the recording proxy in front of an upstream")
    _add_serve_args(s, required=True)
    s.set_defaults(func=_guarded(_cmd_serve))

    e = sub.add_parser("export", help="rebuild session graphs from records and write trajectories")
    e.add_argument("--records", help="records directory (or a records .jsonl file); required")
    e.add_argument("--out", help="output file: .jsonl or .parquet (written whole, then renamed); required")
    e.add_argument("--help-config", action="store_true",
                   help="print every rules.KEY with its default and meaning, then exit")
    e.add_argument("--force", action="store_true", help="replace --out if it exists (else: exit 2)")
    e.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="re-tokenize calls recorded without token ids (marked retokenized)")
    e.add_argument("--rule", action="append", default=[], metavar="KEY=VALUE",
                   help="older spelling of rules.KEY=VALUE")
    e.add_argument("overrides", nargs="*", metavar="rules.FIELD=VALUE",
                   help="override a ReconstructionRules field (YAML value, as every verb's overrides)")
    e.set_defaults(func=_guarded(_cmd_export))

    u = sub.add_parser("scripted-upstream", help="run the deterministic scripted OpenAI-compatible test server")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8001)
    u.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer dir (default: build the test one)")
    u.add_argument("--delay", type=float, default=0.0, help="simulated generation time per request, seconds")
    u.add_argument("--slots", type=int, default=0,
                   help="requests generated at once (like vLLM max_num_seqs); 0 = unlimited")
    u.add_argument("--no-token-ids", action="store_true", help="behave like a server that returns no ids")
    u.set_defaults(func=_guarded(_cmd_scripted))


def _cmd_proxy(args) -> int:
    if not args.upstream:
        args._proxy_parser.print_help()
        return 0
    return _cmd_serve(args)


def _env(var: str | None, flag: str) -> str | None:
    if var is None:
        return None
    val = os.environ.get(var)
    if not val:
        raise UsageError(f"{flag} {var}: environment variable {var} is not set")
    return val


def _cmd_serve(args) -> int:
    _check_serve_args(args)
    api_key = _env(args.api_key_env, "--api-key-env")
    upstream_key = _env(args.upstream_api_key_env, "--upstream-api-key-env")
    from mosaic.capture.proxy import ProxyConfig, serve  # lazy: FastAPI, httpx

    cfg = ProxyConfig(
        upstream=args.upstream, out_dir=args.out, host=args.host, port=args.port,
        api_key=api_key, upstream_api_key=upstream_key,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024), timeout_s=args.timeout, retries=args.retries,
        tokenizer=args.tokenizer, request_token_ids=not args.no_token_ids_flag, fsync=args.fsync,
    )
    serve(cfg, log_level=args.log_level)
    return 0


def parse_rules(pairs: list[str]) -> ReconstructionRules:
    """``ReconstructionRules`` from ``KEY=VALUE`` / ``rules.KEY=VALUE`` items; values parsed as YAML
    (the grammar of every verb's overrides; JSON values read the same), else kept as strings."""
    import yaml

    import typing

    from mosaic.config.values import ConfigError, coerce

    names = {f.name for f in fields(ReconstructionRules)} - {"render_prefix"}  # (a function: --tokenizer sets it)
    hints = typing.get_type_hints(ReconstructionRules)
    kw = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise UsageError(f"--rule {pair!r}: expected KEY=VALUE")
        key = key.removeprefix("rules.")
        if key not in names:
            raise UsageError(f"--rule {key!r}: unknown rule (known: {', '.join(sorted(names))})")
        try:
            val = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            val = raw
        try:  # typed as every config key is: "maybe" for a bool, NaN for a threshold are refused here
            kw[key] = coerce(val, hints[key], f"rules.{key}")
        except ConfigError as exc:
            raise UsageError(str(exc).replace("config key ", "rule ", 1)) from None
    try:
        return ReconstructionRules(**kw)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--rule {' '.join(pairs)}: {exc}") from None


def _with_renderer(rules, tok):
    """``rules`` whose ``render_prefix`` renders with ``tok`` (compactions' history tails into their parents,
    docs/capture.md), unless they have one."""
    from dataclasses import replace

    from mosaic.agent.server.textops import prefix_renderer

    if rules is not None and rules.render_prefix is not None:
        return rules
    return replace(rules or ReconstructionRules(), render_prefix=prefix_renderer(tok))


def export(records: str, out: str, *, tokenizer: str | None = None, rules=None, force: bool = False) -> dict:
    """Records → trajectories file; returns a summary dict (rollouts, sessions by kind, skipped).

    The file is written whole under a temporary name and renamed over ``out``, so readers never see
    a partial file and an export never appends to an earlier one; an existing ``out`` raises
    :class:`FileExistsError` unless ``force``.

    A record with a bad field is skipped with its rollout and a warning naming ``file:line`` and the
    field (``bad_records`` counts them); a rebuilt rollout that is not a valid trajectory is skipped
    with a warning naming it (``invalid_rollouts``), so nothing is written that the readers reject.
    """
    if not (out.endswith(".parquet") or out.endswith(".jsonl")):
        raise UsageError(f"--out {out!r}: use a .jsonl or .parquet file")
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out}: exists (pass force=True, or --force, to replace it)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls, rewards, report = read_records(records)
        for rid, msg in report.bad_records:
            warnings.warn(f"{msg} (skipped with rollout {rid!r})", stacklevel=2)
        fixed = 0
        if tokenizer:  # the recorded model's own: no template is guessed
            tok = load_tokenizer(tokenizer, fallback_template=None)
            for c in calls:
                if c.error and c.error.startswith("no token ids"):
                    retokenize(c, tok)
                    fixed += 1
            rules = _with_renderer(rules, tok)
        trajs, invalid = [], 0
        for t in reconstruct(calls, rewards, rules, report=report):
            try:
                trajs.append(validate(t))
            except TraceError as exc:
                invalid += 1
                report.drop(t.id, "invalid", str(exc)[:500])
                warnings.warn(f"rollout {t.id!r}: not a valid trajectory, skipped ({exc})", stacklevel=2)
        if report.dropped or report.sanitized_text:
            warnings.warn(f"{records}: dropped {report.summary()}", stacklevel=2)
    dest = Path(out)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp{dest.suffix}")
    try:
        tmp.unlink(missing_ok=True)
        (write_parquet if out.endswith(".parquet") else write_jsonl)(tmp, trajs)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    kinds: dict[str, int] = {}
    for t in trajs:
        for k, n in t.count_kinds().items():
            kinds[k] = kinds.get(k, 0) + n
    return {"calls": len(calls), "rollouts": len(trajs), "sessions": kinds, "retokenized_now": fixed,
            "bad_records": len(report.bad_records), "invalid_rollouts": invalid,
            "dropped": dict(report.counts()), "sanitized_text": report.sanitized_text,
            "drift_repairs": sum(len(s.detached) for t in trajs for s in t.sessions),
            "drift_detached_tokens": sum(sum(x.loss_mask) for t in trajs for s in t.sessions for x in s.detached),
            "warnings": [str(w.message) for w in caught], "out": out}


def rules_help() -> str:
    """Every ``rules.KEY`` with its default and its line of :class:`ReconstructionRules`' docstring."""
    import re

    doc = ReconstructionRules.__doc__ or ""
    out = []
    for f in fields(ReconstructionRules):
        if f.name == "render_prefix":  # (not a setting: --tokenizer gives it)
            continue
        m = re.search(rf"^\s+{f.name}: (.*?)(?=^\s+\w+: |\Z)", doc, re.S | re.M)
        text = " ".join(m.group(1).split()) if m else ""
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append(f"rules.{f.name} = {list(default) if isinstance(default, tuple) else default!r}\n    {text}")
    return "\n".join(out)


def _cmd_export(args) -> int:
    if args.help_config:
        print(rules_help())
        return 0
    missing = [flag for flag, v in (("--records", args.records), ("--out", args.out)) if not v]
    if missing:
        raise UsageError(f"the following arguments are required: {', '.join(missing)}")
    _check_export_args(args)
    rules = parse_rules(args.rule + args.overrides)
    try:
        summary = export(args.records, args.out, tokenizer=args.tokenizer, rules=rules, force=args.force)
    except RecordError as exc:  # a file that cannot be read at all: a broken line, a foreign schema
        raise UsageError(f"--records {args.records}: {exc}") from None
    for w in summary.pop("warnings"):
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def _cmd_scripted(args) -> int:
    from mosaic.serving import address_error, run_server  # lazy, like the next line: uvicorn, FastAPI
    from mosaic.capture.scripted import build_tokenizer
    from mosaic.capture.scripted_server import ScriptedConfig, create_scripted_app

    bad = address_error(args.host, args.port)
    if bad:
        raise UsageError(bad)
    if args.tokenizer is not None and (bad := tokenizer_dir_error("--tokenizer", args.tokenizer)):
        raise UsageError(bad)
    if not (math.isfinite(args.delay) and args.delay >= 0):
        raise UsageError(f"--delay must be a finite number >= 0, got {args.delay}")
    if args.slots < 0:
        raise UsageError(f"--slots must be >= 0 (0: unlimited), got {args.slots}")
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else build_tokenizer()
    app = create_scripted_app(tok, ScriptedConfig(token_ids=not args.no_token_ids, delay_s=args.delay, slots=args.slots))
    run_server(app, host=args.host, port=args.port, announce="mosaic proxy scripted-upstream: listening on {url}")
    return 0
