"""Shared argument checks of the ``mosaic`` verbs (issue 11): one line naming the flag, exit 2.

* :class:`OneLineParser`: argparse errors (``--port abc``, a missing required flag) as one line,
  ``mosaic <verb>: <message>``, and exit status 2, instead of the usage block.
* :func:`output_error`: can an output file or directory be created at this path? Checked before
  any work by every verb that writes one (``--out``, ``--cache-dir``, ``--save-tokenizer``).
* :func:`device_error`: is ``--device`` a torch device that exists here? Checked before a model loads.

Nothing heavy is imported at module level, so ``mosaic --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``<prog>: <message>``, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        if "invalid choice: '" in message and "=" in message.split("invalid choice: '", 1)[1].split("'")[0]:
            # `mosaic data data.seed=3`: overrides belong to a sub-command
            item = message.split("invalid choice: '", 1)[1].split("'")[0]
            verb = "data generate" if self.prog.endswith(" data") else "train"
            message += (f"; section.field=value overrides go after the sub-command "
                        f"(e.g. {self.prog.split()[0]} {verb} {item})")
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(ns, "_extras_prog"):  # the innermost (sub)parser left them over
            ns._extras_prog = self.prog
        return ns, extras

    def parse_args(self, args=None, namespace=None):
        """Like argparse's, but unrecognized arguments are named with the verb that got them
        (``mosaic rollout: unrecognized arguments: ...``), not with the top-level ``mosaic``."""
        ns, extras = self.parse_known_args(args, namespace)
        prog = ns.__dict__.pop("_extras_prog", self.prog)
        if extras and isinstance(getattr(ns, "overrides", None), list):
            # section.field=value items after a flag that followed earlier ones (argparse takes one run
            # of positionals): still overrides, in command-line order
            kv = [x for x in extras if "=" in x and not x.startswith("-")]
            ns.overrides = ns.overrides + kv
            extras = [x for x in extras if x not in kv]
        if extras:
            hint = ""
            if "--set" in extras or any(x.startswith("--set=") for x in extras):
                hint = ("; --set KEY=VALUE is gone from this verb: write section.field=value (YAML values) after "
                        "the flags, e.g. harness.context_budget=600 (--help-config lists every key)")
            elif "--seed" in extras or any(x.startswith("--seed=") for x in extras):
                hint = ("; seeds are config keys here: train.seed=N (training) or data.seed=N (which world), "
                        "after the flags (--help-config lists every key)")
            print(f"{prog}: unrecognized arguments: {' '.join(extras)}{hint}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        return ns


def _probe_dir(d: Path) -> str | None:
    """Why no entry can be created in the existing directory ``d`` (a trial directory is made and
    removed at once), or None."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mosaic-probe-", dir=d))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def output_error(flag: str, path: str | os.PathLike, *, is_dir: bool) -> str | None:
    """Why the output ``path`` (a directory if ``is_dir``, else a file) cannot be created or written,
    as one line naming ``flag``, or None. Nothing is left behind.

    Catches: the path exists as the other kind; an existing ancestor is not a directory; the nearest
    existing directory refuses new entries (read-only, no permission, a pseudo file system such as
    ``/proc``); an existing file that cannot be opened for writing.
    """
    p = Path(path)
    what = "not a directory" if is_dir else "cannot write a file there"
    if p.exists():
        if p.is_dir() != is_dir:
            return f"{flag} {path}: {what}" + ("" if is_dir else " (it is a directory)")
        if is_dir:
            why = _probe_dir(p)
            return f"{flag} {path}: directory takes no new entries ({why})" if why else None
        try:
            with open(p, "ab"):
                pass
        except OSError as exc:
            return f"{flag} {path}: {what} ({exc.strerror or exc})"
        return None
    ancestor = next((a for a in p.parents if a.exists()), None)
    if ancestor is None:
        return None
    if not ancestor.is_dir():
        return f"{flag} {path}: {what} ({ancestor} is not a directory)"
    why = _probe_dir(ancestor)
    if why:
        kind = "cannot create the directory" if is_dir else "cannot write a file there"
        return f"{flag} {path}: {kind} ({ancestor} takes no new entries: {why})"
    return None


def device_error(flag: str, device: str) -> str | None:
    """Why ``device`` is not a torch device usable here (unknown, or a CUDA / MPS device this machine
    does not have; other device types are left to torch), as one line naming ``flag``, or None. Imports torch (seconds)."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"{flag} {device!r}: not a torch device ({str(exc).splitlines()[0][:120]})"
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            return f"{flag} {device!r}: no CUDA device is available"
        if d.index is not None and d.index >= n:
            return f"{flag} {device!r}: no such CUDA device (this machine has {n}: cuda:0..cuda:{n - 1})"
    elif d.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return f"{flag} {device!r}: MPS is not available"
    return None


# --------------------------------------------------------------------------------------
# One config grammar for every verb.

CONFIG_GRAMMAR = ("the config sections of `mosaic train` (model, data, harness, rollout, algo, optim, train, sft), "
                  "set as section.field=value (YAML values) after the flags")


def add_config_args(p: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    """``--config YAML``, ``--preset NAME``, ``--print-config``, ``--help-config`` and trailing
    ``section.field=value`` overrides: the same on ``train``, ``sft``, ``eval``, ``pretrain``,
    ``data`` and ``rollout``."""
    p.add_argument("--config", metavar="YAML", help="YAML file of config sections (merged over the preset)")
    p.add_argument("--preset", help="base preset: cpu (default), cpu-service, smollm2, paper")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true",
                   help="print every config key with its value under the preset and its docstring, then exit")
    if overrides:
        p.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                       help="dotted overrides with YAML values, e.g. algo.lam=0.2 data.n_eval_tasks=50 "
                            "train.logger=[console,tensorboard]")


def resolve_config(args: argparse.Namespace, verb: str, *, aliases: list[str] | tuple[str, ...] = (),
                   sections: tuple[str, ...] | None = None):
    """``(config, None)``, or ``(None, exit status)`` after printing a config error (status 2) or the
    ``--help-config`` / ``--print-config`` text (status 0).

    ``aliases``: overrides an older flag stands for (``--seed 3`` → ``data.seed=3``), applied before
    the command line's own, which win. ``sections``: what ``--help-config`` lists (None: all).
    """
    from mosaic.config.loader import ConfigError, describe_config, dump_config, load_config  # lazy: torch

    try:
        cfg = load_config(preset=args.preset, yaml_path=args.config,
                          overrides=[*aliases, *getattr(args, "overrides", [])])
    except ConfigError as exc:
        print(f"mosaic {verb}: config error: {exc}", file=sys.stderr)
        return None, EXIT_USAGE
    for line in cfg.algo.notes():  # a value in another spelling (algo.estimator=mosaic_traj): said once
        print(f"mosaic {verb}: {line}", file=sys.stderr)
    if args.help_config:
        print(describe_config(cfg, sections))
        return None, 0
    if args.print_config:
        print(dump_config(cfg), end="")
        return None, 0
    return cfg, None


def deprecated(args: argparse.Namespace, old: str, new: str) -> None:
    """Note that ``old`` still works and ``new`` is how to write it now; printed by
    :func:`print_deprecations` once the command has done its work (a bad argument stays one line)."""
    notes = args.__dict__.setdefault("deprecations", [])
    line = f"{old} is deprecated; write {new}"
    if line not in notes:
        notes.append(line)


def print_deprecations(args: argparse.Namespace, verb: str) -> None:
    for line in args.__dict__.pop("deprecations", []):
        print(f"mosaic {verb}: {line}", file=sys.stderr)
