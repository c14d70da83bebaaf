"""Atomic checkpoints and resume.

A checkpoint is a directory ``<run_dir>/checkpoints/ckpt-<step>/`` holding
- ``model/``: weights as safetensors (``save_pretrained`` for HF models, a plain
  ``model.safetensors`` for other modules) and the tokenizer when given (saved so
  that ``AutoTokenizer`` loads it back to the same ids, checked on save);
- ``optimizer.pt``, ``scheduler.pt``: their ``state_dict`` s;
- ``rng.pt``: python, numpy, torch CPU and CUDA RNG states and every named
  generator passed in (``torch.Generator`` or ``numpy.random.Generator``);
- ``trainer_state.json``: step and free-form JSON state (data cursor, ...);
- ``COMPLETE``: a manifest (every file, its size and its sha256), written last.

Atomicity: everything is written into ``ckpt-<step>.tmp/``, each file fsynced,
the manifest written, the directory renamed to ``ckpt-<step>/`` (an atomic
rename on POSIX), the parent fsynced, and only then the ``latest`` pointer file
replaced atomically (write ``latest.tmp``, fsync, ``os.replace``). A kill at any
moment leaves either the old state or the new one: ``*.tmp`` directories and
directories whose manifest is missing or does not match the files on disk are
ignored by :func:`find_latest`, which falls back to the newest complete one.

Integrity: :func:`verify_checkpoint` checks the manifest against the files
(names, sizes, sha256 content hashes) and says what is wrong (missing file,
corrupt safetensors header, unreadable ``*.pt``, hash mismatch);
:func:`load_checkpoint` refuses a checkpoint that does not verify, and
``resume=auto`` falls back to the newest one that does, printing each one it
skipped and why. The ``latest`` pointer must name a ``ckpt-<step>`` directory
of the run itself: ``../..``, absolute paths and symlinks leading out of the
run directory are rejected. :func:`check_resume_config` lists, key by key, how
the resolved config of a resumed run differs from the one the run was started
with and refuses to go on unless forced (``train.resume_force=true``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml
from safetensors.torch import load_file, save_file

from mosaic.config.loader import config_diff
from mosaic.train.ckpt_files import (CKPT_NAME, MANIFEST, fsync_dir, fsync_file, inside, is_complete, manifest_sizes,
                                      sha256_file, verify_checkpoint, write_atomic)
from mosaic.train.rng import capture_rng, restore_rng

__all__ = ["CheckpointState", "CheckpointError", "save_checkpoint", "load_checkpoint", "find_latest",
           "list_checkpoints", "is_complete", "verify_checkpoint", "resolve_resume", "capture_rng", "restore_rng",
           "config_diff", "check_resume_config"]  # fmt: skip

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that does not verify, or a resume that must not go on; the message says why."""


@dataclass
class CheckpointState:
    """What :func:`load_checkpoint` returns besides restoring objects in place."""

    path: Path
    step: int
    state: dict[str, Any] = field(default_factory=dict)
    """The free-form JSON state saved with the checkpoint (data cursor, counters, ...)."""


# --------------------------------------------------------------------------------------
# Model weights.


def _save_model(model, tokenizer, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(d, safe_serialization=True)
    else:

        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    if tokenizer is not None:
        from mosaic.agent.tokenizer import save_tokenizer  # lazy: keeps checkpoint free of transformers until used

        save_tokenizer(tokenizer, d)  # loads back with AutoTokenizer to the same ids, or raises


def _load_model(model, d: Path) -> None:

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint model dir {d} has no .safetensors file")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied) if not isinstance(tied, dict) else set(tied)
    # Weights tied to another parameter are not saved by save_pretrained; nothing else may be missing.
    bad_missing = [k for k in missing if k not in tied]
    if bad_missing or unexpected:
        raise RuntimeError(f"checkpoint {d}: missing weights {bad_missing[:5]}, unexpected {list(unexpected)[:5]}")


# --------------------------------------------------------------------------------------
# Save / find / load.


def _ckpt_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (names and sizes match; see :func:`verify_checkpoint` for contents),
    ascending by step. Directories that are symlinks leading out of the run dir are not listed."""
    root = _ckpt_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = CKPT_NAME.match(d.name)
        if m and inside(d, root) and is_complete(d):
            out.append((int(m.group(1)), d))
    return sorted(out)


def _pointer(root: Path) -> tuple[Path | None, str | None]:
    """The checkpoint the ``latest`` pointer names, or (None, why it is refused); (None, None) if none."""
    ptr = root / LATEST
    if not ptr.exists() and not ptr.is_symlink():
        return None, None
    if ptr.is_symlink() and not inside(ptr, root):
        return None, f"{ptr} is a symlink out of the run directory (refused)"
    try:
        name = ptr.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{ptr} is unreadable ({exc})"
    if not CKPT_NAME.match(name):
        return None, f"{ptr} names {name!r}, not a ckpt-<step> of this run directory (refused)"
    d = root / name
    if d.is_symlink() and not inside(d, root):
        return None, f"{d} is a symlink out of the run directory (refused)"
    return d, None


def _candidates(run_dir: str | Path) -> tuple[list[Path], list[str]]:
    """Checkpoint dirs to try, best first (the pointer's, then newest step first), and pointer notes."""
    root = _ckpt_root(run_dir)
    if not root.is_dir():
        return [], []
    notes = []
    first, why = _pointer(root)
    if why:
        notes.append(why)
    out = [first] if first is not None and first.is_dir() else []
    dirs = sorted(((int(m.group(1)), d) for d in root.iterdir() if (m := CKPT_NAME.match(d.name)) and d.is_dir()),
                  reverse=True)  # fmt: skip
    for _, d in dirs:
        if d not in out and inside(d, root):
            out.append(d)
    return out, notes


def find_latest(run_dir: str | Path, *, verify: bool = False, skipped: list[str] | None = None) -> Path | None:
    """The newest complete checkpoint: the ``latest`` pointer if it names one of this run, else a scan.

    ``verify=True``: the newest one that passes :func:`verify_checkpoint` (content hashes); each one
    passed over is appended to ``skipped`` as ``"<dir>: <reason>"``, as is a refused pointer."""
    cands, notes = _candidates(run_dir)
    if skipped is not None:
        skipped.extend(notes)
    for d in cands:
        why = verify_checkpoint(d) if verify else (None if is_complete(d) else "incomplete")
        if why is None:
            return d
        if skipped is not None and verify:
            skipped.append(f"{d}: {why}")
    return None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model=None,
    tokenizer=None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    generators: Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write ``ckpt-<step>`` atomically, move ``latest`` to it, prune to ``keep_last`` complete ones."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = _ckpt_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("ckpt-*.tmp"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    name = f"ckpt-{int(step)}"
    tmp = root / f"{name}.tmp"
    tmp.mkdir()
    if model is not None:
        _save_model(model, tokenizer, tmp / "model")
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(capture_rng(generators), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": int(step), "state": dict(state or {})}, indent=1))
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_file(f)
    files = manifest_sizes(tmp)
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"step": int(step), "files": files, "sha256": {n: sha256_file(tmp / n) for n in files}}, f)
        f.flush()
        os.fsync(f.fileno())
    for d in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        fsync_dir(d)
    final = root / name
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        old = root / f"{name}.old.tmp"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    write_atomic(root / LATEST, name)
    for s, d in list_checkpoints(run_dir)[:-keep_last]:
        if d != final:
            shutil.rmtree(d, ignore_errors=True)
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model=None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    generators: Mapping[str, Any] | None = None,
    restore_rngs: bool = True,
    map_location: str | torch.device = "cpu",
) -> CheckpointState:
    """Restore the given objects in place from a complete checkpoint that verifies; return step and state.

    A directory that is not a complete checkpoint raises FileNotFoundError; one whose files do not
    verify (content hash, headers) raises :class:`CheckpointError` naming the file and the problem."""
    d = Path(path)
    if not is_complete(d):
        why = verify_checkpoint(d)
        raise FileNotFoundError(f"{d} is not a complete checkpoint ({why or 'no or mismatching ' + MANIFEST})")
    why = verify_checkpoint(d)
    if why is not None:
        raise CheckpointError(f"checkpoint {d} does not verify: {why}")
    if model is not None:
        _load_model(model, d / "model")
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location=map_location, weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=True))
    if restore_rngs:
        restore_rng(torch.load(d / "rng.pt", weights_only=True), generators)
    meta = json.loads((d / "trainer_state.json").read_text())
    return CheckpointState(path=d, step=int(meta["step"]), state=meta.get("state", {}))


def _skip_note(resume: str, skipped: list[str]) -> None:
    for why in skipped:
        print(f"[mosaic] train.resume={resume}: skipping {why}", file=sys.stderr, flush=True)


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``train.resume`` → the checkpoint to load: ``never`` → None; ``auto`` → the run dir's
    newest checkpoint that verifies (None if none; each one skipped is printed with its reason);
    otherwise a path that must be a checkpoint that verifies (or a run dir: its newest one that does)."""
    if resume == "never":
        return None
    skipped: list[str] = []
    if resume == "auto":
        found = find_latest(run_dir, verify=True, skipped=skipped)
        _skip_note(resume, skipped)
        return found
    p = Path(resume)
    if p.is_dir() and not CKPT_NAME.match(p.name):  # a run dir: its latest
        found = find_latest(p, verify=True, skipped=skipped)
        _skip_note(resume, skipped)
        if found is None:
            raise FileNotFoundError(f"train.resume={resume!r}: no complete checkpoint under that run dir")
        return found
    why = verify_checkpoint(p)
    if why is not None:
        raise FileNotFoundError(f"train.resume={resume!r} is not a usable checkpoint: {why}")
    return p


# --------------------------------------------------------------------------------------
# A changed config on resume.

_RESUME_FREE = ("train.resume", "train.resume_force", "train.run_dir", "train.logger", "train.project_name",
                "train.experiment_name", "train.tensorboard", "train.wandb", "train.log_every", "train.plot_every")
"""Keys that may change on resume without notice: where to resume from, the force switch itself, and
where metrics are shown (the run computes the same either way; a run started before ``train.logger``
existed resumes without it showing up as a change)."""


def check_resume_config(run_dir: str | Path, config_yaml: str, force: bool, *, state: Mapping[str, Any] | None = None
                        ) -> list[str]:  # fmt: skip
    """Compare the resolved config of a resumed run with the one it was started with.

    The saved config is ``<run_dir>/config.yaml`` (written at the start of every run); without it,
    the estimator stored in the checkpoint ``state``. Returns the changed keys (those of
    ``_RESUME_FREE`` ignored), printed one per line; raises :class:`CheckpointError` listing them
    unless ``force`` (``train.resume_force=true``)."""
    saved = Path(run_dir) / "config.yaml"
    if saved.is_file():
        changes = [ln for ln in config_diff(saved.read_text(), config_yaml)
                   if not ln.startswith(_RESUME_FREE) and not ln.endswith(" -> (absent)")]  # removed keys do nothing
    else:
        new = (yaml.safe_load(config_yaml) or {}).get("algo", {}).get("estimator")
        old = (state or {}).get("estimator")
        changes = [f"algo.estimator: {old!r} -> {new!r}"] if old is not None and old != new else []
    if any(c.startswith("train.steps:") for c in changes) and \
            (yaml.safe_load(config_yaml) or {}).get("optim", {}).get("lr_schedule", "constant") == "constant":
        # more (or fewer) steps: the steps run so far are the same, and a constant schedule does not
        # depend on the total; extending a finished run is what a user asks for with train.steps
        print(f"[mosaic] {next(c for c in changes if c.startswith('train.steps:'))} (the run goes on to the new "
              f"length)", file=sys.stderr, flush=True)  # fmt: skip
        changes = [c for c in changes if not c.startswith("train.steps:")]
    if not changes:
        return []
    listing = "\n".join(f"  {c}" for c in changes)
    if not force:
        raise CheckpointError(f"resuming {run_dir} with a changed config ({len(changes)} keys; saved -> now):\n"
                              f"{listing}\nset train.resume_force=true to resume anyway, or train.resume=never "
                              f"(or another train.run_dir) to start afresh")  # fmt: skip
    print(f"[mosaic] resuming with a changed config (train.resume_force=true):\n{listing}", file=sys.stderr,
          flush=True)  # fmt: skip
    return changes
