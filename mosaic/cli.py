"""The ``mosaic`` command line.

Each area of the package contributes its sub-commands through a module with a
``register(subparsers)`` function; this file only wires them together so that
``mosaic --help`` stays fast (heavy imports happen inside the commands).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute sub-commands, in the order they appear in --help.
COMMAND_MODULES = (
    "mosaic.envs.cli",
    "mosaic.agent.cli",
    "mosaic.agent.serve_cli",
    "mosaic.train.cli",
    "mosaic.capture.cli",
    "mosaic.experiment.cli",
    "mosaic.view.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from mosaic import __version__

    from mosaic.config.cliargs import OneLineParser

    parser = OneLineParser(
        prog="mosaic",
        description="Multi-session agentic RL: harness, Mosaic credit assignment, trainer.",
    )
    parser.add_argument("--version", action="version", version=f"mosaic {__version__}")
    # every verb's parser (and its own sub-commands') reports a bad argument in one line, exit 2
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``mosaic data show ... | head``): stop quietly, as a pipe does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush does not raise again)
        return 141


if __name__ == "__main__":
    sys.exit(main())
