"""The run directory: resolved config, metrics, samples, plots, summary.

Layout of ``<run_dir>/``::

    config.yaml        the resolved config (dump_config), written at start
    metrics.jsonl      one JSON line per step: {"step": N, "<name>": value, ...}, flushed
    samples.jsonl      a few rollouts per step, token ids + credit (mosaic.train.samples; `mosaic view`)
    vocab.json         the text of every token id, for reading samples.jsonl
    tb/                TensorBoard event files (``tensorboard`` in ``train.logger``)
    wandb/             wandb's files (``wandb`` in ``train.logger``; online or offline)
    plots/*.png        reward, held-out accuracy, sessions per trajectory, positive-gain share
    summary.md         short human summary, rewritten with the plots
    checkpoints/       see mosaic.train.checkpoint

Sinks are verl's ``trainer.logger`` names (``train.logger``): ``console`` is a tqdm
progress bar plus, every ``log_every`` steps, a line ``step:N - key:value - ...``
(verl's format; names in :mod:`mosaic.train.metrics`) printed with ``tqdm.write``
so it does not break the bar; ``tensorboard``; ``wandb``, under ``train.project_name``
and ``train.experiment_name``, online when it has an API key and its server answers,
offline otherwise. ``metrics.jsonl`` is always written.

On resume from step k, lines of steps > k in ``metrics.jsonl`` / ``samples.jsonl``
(written after the checkpoint by the interrupted run) are dropped, so the
curves never hold a step twice.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tqdm import tqdm

from mosaic.train.metrics import CONSOLE_ORDER, ci_keys, upgrade_names

__all__ = ["RunLogger", "format_console_line", "read_metrics", "make_plots", "write_summary"]

PLOTS = {
    "reward": ("critic/score/mean", "mean outcome reward"),
    "heldout_accuracy": ("val-core/", "held-out accuracy"),
    "sessions_per_traj": ("session/per_traj", "sessions per trajectory"),
    "pos_gain_share": ("session/pos_gain_share/", "share of sessions with positive gain"),
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4f}".rstrip("0").rstrip(".") if not v.is_integer() else str(int(v))
    return str(v)


def init_wandb(run_dir: Path, *, mode: str, project: str, name: str, config_yaml: str | None = None):
    """A wandb run under ``run_dir``; None when wandb is not installed and ``mode`` is the deprecated
    ``offline`` switch (a warning; ``auto`` raises instead: the user listed wandb in ``train.logger``).

    ``auto``: ``$WANDB_MODE`` when set; else online when an API key is configured, falling back to
    offline (with a warning) when the server cannot be reached; offline without a key.
    """
    try:
        import wandb as _wandb  # optional, never a dependency
    except ImportError:
        if mode == "auto":
            raise RuntimeError("train.logger lists wandb but the wandb package is not installed "
                               "(pip install wandb, or drop wandb from train.logger)") from None
        warnings.warn("train.wandb=offline but wandb is not installed; skipping wandb", stacklevel=3)
        return None
    import yaml

    kw = dict(dir=str(run_dir), project=project, name=name, resume="allow",
              config=yaml.safe_load(config_yaml) if config_yaml else None)
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_api_key(_wandb) else "offline")
    if mode == "online":
        try:
            return _wandb.init(mode="online", **kw)
        except Exception as exc:  # unreachable server, bad key: the run goes on, logged offline
            warnings.warn(f"wandb online failed ({type(exc).__name__}: {exc}); logging offline under "
                          f"{run_dir}/wandb (wandb sync uploads it later)", stacklevel=3)
    return _wandb.init(mode="offline", **kw)


def _wandb_api_key(wandb_module) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb_module.api.api_key)
    except Exception:  # no settings / netrc: no key
        return False


def format_console_line(step: int, metrics: Mapping[str, Any]) -> str:
    """``step:N - key:value - ...``: the keys of CONSOLE_ORDER first, then the rest sorted."""
    keys = [k for k in CONSOLE_ORDER if k in metrics] + sorted(k for k in metrics if k not in CONSOLE_ORDER)
    return " - ".join([f"step:{step}"] + [f"{k}:{_fmt(metrics[k])}" for k in keys])


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every step's metrics of ``run_dir``, pre-verl names renamed (:func:`~mosaic.train.metrics.upgrade_names`).

    A line that is not a JSON object (cut by a kill, not UTF-8, edited) is skipped; how many and the first
    are said once on stderr, naming the file."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    out, bad = [], []
    for n, raw in enumerate(p.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            rec = None
        if isinstance(rec, dict):
            out.append(upgrade_names(rec))
        else:
            bad.append(n)
    if bad:
        print(f"[mosaic] {p}: {len(bad)} line(s) that are not JSON objects skipped (the first: line {bad[0]})",
              file=sys.stderr, flush=True)
    return out


def _truncate_jsonl(p: Path, keep_upto: int) -> None:
    if not p.is_file():
        return
    kept = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step", 0), (int, float)) and rec.get("step", 0) <= keep_upto:
            kept.append(line)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, p)


_MISSING_SAID: set[str] = set()


def _optional(package: str, what: str) -> bool:
    """Whether an optional package (the ``lab`` extra) is installed; the first time it is not, one line
    says what is skipped and how to get it."""
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        return True
    if package not in _MISSING_SAID:
        _MISSING_SAID.add(package)
        print(f"[mosaic] {package} is not installed: no {what} (pip install 'mosaic-rl[lab]')", file=sys.stderr,
              flush=True)
    return False


def make_plots(run_dir: str | Path) -> list[Path]:
    """Regenerate ``plots/*.png`` from ``metrics.jsonl`` (matplotlib, Agg backend); none, said once, when
    matplotlib is not installed (it comes with the ``lab`` extra)."""
    if not _optional("matplotlib", "plots/*.png"):
        return []
    import matplotlib  # here, not at module level: the Agg backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (key, title) in PLOTS.items():
        series: dict[str, tuple[list, list]] = {}
        for r in rows:
            for k, v in r.items():
                if (k == key or (key.endswith("/") and k.startswith(key))) and isinstance(v, (int, float)) \
                        and math.isfinite(v):  # fmt: skip
                    xs, ys = series.setdefault(k, ([], []))
                    xs.append(r["step"])
                    ys.append(v)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        for k, (xs, ys) in sorted(series.items()):
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=k.removeprefix(key) or k)
            lo_k, hi_k = ci_keys(k) or (f"{k}_lo", f"{k}_hi")
            band = [(r["step"], r[lo_k], r[hi_k]) for r in rows if lo_k in r and hi_k in r]
            if band:
                ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"{name}.png"
        fig.savefig(p)
        plt.close(fig)
        written.append(p)
    return written


def write_summary(run_dir: str | Path, *, title: str = "", extra: Mapping[str, Any] | None = None) -> Path:
    """A short ``summary.md``: last values of the key metrics, best held-out accuracy, plots."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    lines = [f"# {title or run_dir.name}", ""]
    if rows:
        last = rows[-1]
        lines += [f"Steps logged: {len(rows)} (last step {last['step']}).", ""]
        lines += ["| metric | last |", "| --- | --- |"]
        for k in CONSOLE_ORDER:
            if k in last:
                lines.append(f"| `{k}` | {_fmt(last[k])} |")
        acc_keys = sorted({k for r in rows for k in r if ci_keys(k)})
        for key in acc_keys:  # one per samples-per-question setting (verl's mean@n)
            best = max((r for r in rows if key in r), key=lambda r: r[key])
            lo_k, hi_k = ci_keys(key)
            ci = f" (95% CI {_fmt(best[lo_k])}-{_fmt(best[hi_k])})" if lo_k in best and hi_k in best else ""
            lines += ["", f"Best held-out accuracy ({key}): {_fmt(best[key])}{ci} at step {best['step']}."]
    else:
        lines.append("No steps logged yet.")
    for k, v in (extra or {}).items():
        lines.append(f"- {k}: {v}")
    plots = sorted((run_dir / "plots").glob("*.png")) if (run_dir / "plots").is_dir() else []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots]
    p = run_dir / "summary.md"
    p.write_text("\n".join(lines) + "\n")
    return p


class RunLogger:
    """Writes one run's metrics everywhere; cheap to call every step.

    Args:
        run_dir: created if missing.
        config_yaml: the resolved config text (``dump_config(cfg)``), written to ``config.yaml``.
        total_steps: length of the progress bar.
        start_step: the step a resumed run continues after (later lines are dropped).
        logger: the sinks, verl's ``trainer.logger`` names (``console``, ``tensorboard``, ``wandb``); None:
            the older switches ``console`` / ``tensorboard`` / ``wandb`` (``offline``: wandb offline when
            installed, a warning otherwise).
        project_name / experiment_name: the wandb project and run name (empty: the run dir's name).
    """

    def __init__(self, run_dir: str | Path, *, config_yaml: str | None = None, total_steps: int | None = None,
                 start_step: int = 0, tensorboard: bool = True, wandb: str = "off", console: bool = True,
                 log_every: int = 1, plot_every: int = 10, title: str = "", logger: Sequence[str] | None = None,
                 project_name: str = "mosaic", experiment_name: str = "") -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_every, self.plot_every, self.title = log_every, plot_every, title
        if logger is not None:
            console, tensorboard = "console" in logger, "tensorboard" in logger
            wandb = "auto" if "wandb" in logger else "off"
        if config_yaml is not None:
            (self.run_dir / "config.yaml").write_text(config_yaml)
        self._metrics_path = self.run_dir / "metrics.jsonl"
        self._samples_path = self.run_dir / "samples.jsonl"
        if start_step or self._metrics_path.exists():
            _truncate_jsonl(self._metrics_path, start_step)
            _truncate_jsonl(self._samples_path, start_step)
        self._metrics = open(self._metrics_path, "a")
        self._samples = open(self._samples_path, "a")
        self._tb = None
        if tensorboard and _optional("tensorboard", "TensorBoard event files (tb/)"):
            from torch.utils.tensorboard import SummaryWriter  # heavy (loads tensorboard): only when enabled

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self._wandb = None
        if wandb != "off":
            self._wandb = init_wandb(self.run_dir, mode=wandb, project=project_name,
                                     name=experiment_name or self.run_dir.name, config_yaml=config_yaml)
        self._bar, self._console = None, console
        if console:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr)

    def write(self, text: str) -> None:
        """A console line that keeps the progress bar intact."""
        if self._bar is not None:
            tqdm.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def log(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> None:
        """Record one step's metrics (JSONL line flushed, TensorBoard, wandb, console, plots)."""
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                 for k, v in metrics.items()}  # fmt: skip
        self._metrics.write(json.dumps({"step": int(step), **clean}, allow_nan=True) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(clean), step=step)
        if self._bar is not None and advance:
            self._bar.update(1)
            if "critic/score/mean" in clean:
                self._bar.set_postfix(score=f"{clean['critic/score/mean']:.3f}")
        if self._console and self.log_every and step % self.log_every == 0:
            self.write(format_console_line(step, clean))
        if self.plot_every and step % self.plot_every == 0:
            self.plot()

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """A held-out evaluation outside the training steps (the warm start at step 0, the final model at
        the last step): to TensorBoard, wandb and the console, not ``metrics.jsonl`` (one line per
        training step; the evaluations have their own files, ``eval_*.json`` and ``result.json``)."""
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(clean), step=step)
        if self._console:
            self.write(format_console_line(step, clean))

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        """Append rollout records (any JSON-able dicts; the trainer's are :mod:`mosaic.train.samples`) to
        ``samples.jsonl``."""
        for s in samples:
            self._samples.write(json.dumps({"step": int(step), **s}, default=str) + "\n")
        self._samples.flush()

    def plot(self) -> list[Path]:
        paths = make_plots(self.run_dir)
        write_summary(self.run_dir, title=self.title)
        return paths

    def close(self, extra: Mapping[str, Any] | None = None) -> None:
        """Final plots and summary; close every sink."""
        self._metrics.close()
        self._samples.close()
        make_plots(self.run_dir)
        write_summary(self.run_dir, title=self.title, extra=extra)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
