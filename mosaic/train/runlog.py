"""The run directory: resolved config, metrics, samples, plots, summary.

Layout of ``<run_dir>/``::

    config.yaml        the resolved config (dump_config), written at start
    metrics.jsonl      one JSON line per step: {"step": N, "<name>": value, ...}, flushed
    samples.jsonl      a few rollouts per step, token ids + credit (mosaic.train.samples; `mosaic view`)
    vocab.json         the text of every token id, for reading samples.jsonl
    tb/                TensorBoard event files (torch.utils.tensorboard)
    wandb/             wandb offline run, only when asked for and installed
    plots/*.png        reward, held-out accuracy, sessions per trajectory, positive-gain share
    summary.md         short human summary, rewritten with the plots
    checkpoints/       see mosaic.train.checkpoint

Console: a tqdm progress bar plus, every ``log_every`` steps, a line
``step:N - key:value - ...`` (verl's format; names in :mod:`mosaic.train.metrics`)
printed with ``tqdm.write`` so it does not break the bar.

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
from typing import Any, Iterable, Mapping

from tqdm import tqdm

from mosaic.train.metrics import CONSOLE_ORDER

__all__ = ["RunLogger", "format_console_line", "read_metrics", "make_plots", "write_summary"]

PLOTS = {
    "reward": ("critic/score/mean", "mean outcome reward"),
    "heldout_accuracy": ("val/accuracy", "held-out accuracy"),
    "sessions_per_traj": ("session/per_traj", "sessions per trajectory"),
    "pos_gain_share": ("session/pos_gain_share/", "share of sessions with positive gain"),
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4f}".rstrip("0").rstrip(".") if not v.is_integer() else str(int(v))
    return str(v)


def format_console_line(step: int, metrics: Mapping[str, Any]) -> str:
    """``step:N - key:value - ...``: the keys of CONSOLE_ORDER first, then the rest sorted."""
    keys = [k for k in CONSOLE_ORDER if k in metrics] + sorted(k for k in metrics if k not in CONSOLE_ORDER)
    return " - ".join([f"step:{step}"] + [f"{k}:{_fmt(metrics[k])}" for k in keys])


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: skip it
                continue
    return out


def _truncate_jsonl(p: Path, keep_upto: int) -> None:
    if not p.is_file():
        return
    kept = []
    for line in p.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= keep_upto:
                kept.append(line)
        except json.JSONDecodeError:
            continue
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, p)


def make_plots(run_dir: str | Path) -> list[Path]:
    """Regenerate ``plots/*.png`` from ``metrics.jsonl`` (matplotlib, Agg backend)."""
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
            lo_k, hi_k = f"{k}_lo", f"{k}_hi"
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
        evals = [r for r in rows if "val/accuracy" in r]
        if evals:
            best = max(evals, key=lambda r: r["val/accuracy"])
            ci = f" (95% CI {_fmt(best['val/accuracy_lo'])}-{_fmt(best['val/accuracy_hi'])})" \
                if "val/accuracy_lo" in best else ""  # fmt: skip
            lines += ["", f"Best held-out accuracy: {_fmt(best['val/accuracy'])}{ci} at step {best['step']}."]
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
        tensorboard / wandb: sinks; wandb ``offline`` is used only if importable (a warning otherwise).
        console: print the progress bar and the metric lines.
    """

    def __init__(self, run_dir: str | Path, *, config_yaml: str | None = None, total_steps: int | None = None,
                 start_step: int = 0, tensorboard: bool = True, wandb: str = "off", console: bool = True,
                 log_every: int = 1, plot_every: int = 10, title: str = "") -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_every, self.plot_every, self.title = log_every, plot_every, title
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
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy (loads tensorboard): only when enabled

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self._wandb = None
        if wandb == "offline":
            try:
                import wandb as _wandb  # optional, never required

                self._wandb = _wandb.init(mode="offline", dir=str(self.run_dir), project="mosaic",
                                          name=title or self.run_dir.name, resume="allow")  # fmt: skip
            except ImportError:
                warnings.warn("train.wandb=offline but wandb is not installed; skipping wandb", stacklevel=2)
        self._bar = None
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
        if self.log_every and step % self.log_every == 0:
            self.write(format_console_line(step, clean))
        if self.plot_every and step % self.plot_every == 0:
            self.plot()

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
