"""The grid file of ``mosaic experiment``: arms × settings × seeds, and the held-out evaluations.

```yaml
name: compaction                  # the grid's name (report title)
preset: cpu                       # base preset of every run
common: [harness.mode=compaction] # overrides every run gets
arms:                             # arm name -> overrides (the estimator, the harness mode it needs)
  broadcast: [algo.estimator=broadcast]
  mosaic: [algo.estimator=mosaic]
  fold: {overrides: [algo.estimator=fold], seeds: [0, 1, 2]}   # an arm with its own seeds
settings:                         # optional: setting name -> overrides (e.g. a learning-rate sweep)
  base: []
  lr2e-4: {overrides: [optim.lr=2e-4], seeds: [0, 1, 2]}    # a setting with its own seeds
  lr5e-5: [optim.lr=5e-5]
seeds: [0, 1, 2, 3, 4]            # train.seed of each run
reuse: [reports/explore/work]     # optional: other grids' work dirs whose finished runs of the same
                                  # config (same key, final checkpoint present) are copied, not retrained
baseline: base                    # optional: a setting every other setting is compared with, arm by arm
contrasts: [[lr2e-4, lr5e-5]]     # optional: more pairs of settings compared with each other, arm by arm
evals:                            # every run's final model, and the warm start once, on each
  - {name: test, split: test, data_seed: 0, n_tasks: 128, samples: 4, temperature: 0.5}
```

Everything is checked by :func:`load_grid` before any work: unknown fields, wrong
types, duplicate names, and every run's config (resolved with
``mosaic.config.loader.load_config``) — a bad grid fails naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mosaic.config.loader import Config, ConfigError, config_tree, load_config

__all__ = ["GridError", "EvalSpec", "Grid", "RunSpec", "load_grid", "parse_grid", "QUICK_GRID"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RUN_KEYS_SET_BY_RUNNER = ("train.run_dir", "train.heldout_split")


class GridError(ValueError):
    """An invalid grid file; the message names the field."""


@dataclass(frozen=True)
class EvalSpec:
    """One held-out evaluation: a split of the worlds of ``data_seed``."""

    name: str
    split: str = "test"
    """``test`` (held out; look once per final arm) or ``validation`` (for choosing settings)."""
    data_seed: int = 0
    """World seed: other seeds are other worlds (their test names are still held out)."""
    n_tasks: int = 128
    samples: int = 4
    temperature: float = 0.5
    seed: int = 0
    """Sampling seed: the same for every arm, so arms see the same questions and sample streams."""

    def overrides(self) -> list[str]:
        return [f"data.seed={self.data_seed}", f"data.n_eval_tasks={self.n_tasks}"]

    def key(self) -> str:
        blob = f"{self.split}|{self.data_seed}|{self.n_tasks}|{self.samples}|{self.temperature}|{self.seed}"
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class RunSpec:
    """One ``mosaic train`` run of the grid."""

    arm: str
    setting: str
    seed: int
    config: Config
    key: str
    """Hash of the resolved config (run dir excluded): the run's identity."""

    @property
    def name(self) -> str:
        return f"{self.arm}-{self.setting}-s{self.seed}-{self.key[:8]}"


@dataclass(frozen=True)
class Grid:
    name: str
    preset: str
    common: tuple[str, ...]
    arms: dict[str, tuple[str, ...]]
    settings: dict[str, tuple[str, ...]]
    seeds: tuple[int, ...]
    evals: tuple[EvalSpec, ...]
    path: Path | None = None
    arm_seeds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Arms with their own seed list (``arms: {name: {overrides: [...], seeds: [...]}}``)."""
    reuse: tuple[Path, ...] = ()
    """Other grids' work dirs: a finished run there with the same config key is copied, not retrained."""
    setting_seeds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Settings with their own seed list (same form). A run's seeds are its arm's own list, its setting's own
    list, both (intersected) or, when neither has one, the grid's ``seeds``."""
    baseline: str | None = None
    """A setting the report compares every other setting with, within each arm (an ablation table)."""
    contrasts: tuple[tuple[str, str], ...] = ()
    """More pairs of settings ``(A, B)`` the report compares, A − B within each arm (e.g. two agents
    alternating against one context)."""
    runs: tuple[RunSpec, ...] = field(default=())

    def eval_overrides(self, setting: str) -> list[str]:
        """Overrides of the evaluation config of a setting: every arm (and the warm start) is evaluated
        with the same harness and sampling — the grid's common and setting overrides, no arm's."""
        return [*self.common, *self.settings[setting], "train.heldout_split=none"]


def _need(cond: bool, where: str, why: str) -> None:
    if not cond:
        raise GridError(f"grid field '{where}': {why}")


def _overrides(v: Any, where: str) -> tuple[str, ...]:
    if v is None:
        return ()
    _need(isinstance(v, list) and all(isinstance(x, str) for x in v), where,
          "must be a list of 'section.field=value' strings")  # fmt: skip
    for x in v:
        _need("=" in x, where, f"{x!r} must look like section.field=value")
        _need(not x.split("=", 1)[0].strip().startswith(RUN_KEYS_SET_BY_RUNNER), where,
              f"{x.split('=', 1)[0]} is set by the runner")  # fmt: skip
    return tuple(v)


def _named(v: Any, where: str, *, seeds: bool = False) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[int, ...]]]:
    """name -> overrides; with ``seeds``, an entry may also be ``{overrides: [...], seeds: [...]}``."""
    _need(isinstance(v, dict) and len(v) > 0, where, "must be a non-empty mapping of name -> list of overrides")
    out, own_seeds = {}, {}
    for k, ov in v.items():
        _need(isinstance(k, str) and bool(_NAME.match(k)), f"{where}.{k}", "names use letters, digits, '_', '.', '-'")
        if seeds and isinstance(ov, dict):
            extra = set(ov) - {"overrides", "seeds"}
            _need(not extra, f"{where}.{k}.{sorted(extra)[0] if extra else ''}", "unknown field (known: overrides, seeds)")
            if "seeds" in ov:
                own_seeds[k] = _seeds(ov["seeds"], f"{where}.{k}.seeds")
            ov = ov.get("overrides")
        out[k] = _overrides(ov, f"{where}.{k}")
    return out, own_seeds


def _seeds(v: Any, where: str) -> tuple[int, ...]:
    _need(isinstance(v, list) and len(v) > 0 and all(isinstance(s, int) and not isinstance(s, bool) for s in v),
          where, "must be a list of integers")  # fmt: skip
    _need(len(set(v)) == len(v), where, "must not repeat")
    return tuple(v)


def _eval(v: Any, i: int) -> EvalSpec:
    where = f"evals[{i}]"
    _need(isinstance(v, dict), where, "must be a mapping")
    known = set(EvalSpec.__dataclass_fields__)
    for k in v:
        _need(k in known, f"{where}.{k}", f"unknown field (known: {', '.join(sorted(known))})")
    _need(isinstance(v.get("name"), str) and bool(_NAME.match(v["name"])), f"{where}.name", "a name is required")
    for k in ("data_seed", "n_tasks", "samples", "seed"):
        if k in v:
            _need(isinstance(v[k], int) and not isinstance(v[k], bool), f"{where}.{k}", "must be an integer")
    _need(v.get("split", "test") in ("test", "validation"), f"{where}.split", "must be 'test' or 'validation'")
    _need(v.get("n_tasks", 1) > 0 and v.get("samples", 1) > 0, where, "n_tasks and samples must be > 0")
    t = v.get("temperature", 0.5)
    _need(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 100, f"{where}.temperature",
          "must be a number >= 0")  # fmt: skip
    return EvalSpec(**v)


def config_key(cfg: Config) -> str:
    """A run's identity: hash of its resolved config, leaving out the run dir and every field equal to its
    class default (so adding a new field with a neutral default keeps finished runs finished; a changed
    default is caught by the runner comparing each finished run's saved ``config.yaml``)."""
    plain, default = config_tree(cfg), config_tree(Config())
    plain["train"].pop("run_dir", None)

    def diff(a, b):
        if isinstance(a, dict):
            return {k: d for k, v in a.items() if (d := diff(v, b.get(k) if isinstance(b, dict) else None)) is not _SAME}
        return _SAME if a == b else a

    text = json.dumps(diff(plain, default), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_SAME = object()


def parse_grid(doc: Any, path: Path | None = None) -> Grid:
    """A validated :class:`Grid` from a parsed YAML document (every run config resolved)."""
    _need(isinstance(doc, dict), "(top)", "the grid file must hold a mapping")
    known = {"name", "preset", "common", "arms", "settings", "seeds", "evals", "reuse", "baseline", "contrasts"}
    for k in doc:
        _need(k in known, str(k), f"unknown field (known: {', '.join(sorted(known))})")
    name = doc.get("name", path.stem if path else "grid")
    _need(isinstance(name, str) and bool(_NAME.match(name)), "name", "must be a simple name")
    preset = doc.get("preset", "cpu")
    _need(isinstance(preset, str), "preset", "must be a string")
    seeds = _seeds(doc.get("seeds", [0]), "seeds")
    evals = doc.get("evals")
    _need(isinstance(evals, list) and len(evals) > 0, "evals", "must list at least one evaluation")
    ev = tuple(_eval(e, i) for i, e in enumerate(evals))
    _need(len({e.name for e in ev}) == len(ev), "evals", "names must be unique")
    arms, arm_seeds = _named(doc.get("arms"), "arms", seeds=True)
    reuse = doc.get("reuse") or []
    _need(isinstance(reuse, list) and all(isinstance(x, str) and x for x in reuse), "reuse",
          "must be a list of work-dir paths")  # fmt: skip
    settings, setting_seeds = _named(doc.get("settings") or {"base": []}, "settings", seeds=True)
    baseline = doc.get("baseline")
    _need(baseline is None or (isinstance(baseline, str) and baseline in settings), "baseline",
          f"must name one of the settings ({', '.join(settings)})")
    contrasts = doc.get("contrasts") or []
    _need(isinstance(contrasts, list) and all(isinstance(c, list) and len(c) == 2 and c[0] != c[1]
                                              and all(isinstance(x, str) and x in settings for x in c)
                                              for c in contrasts), "contrasts",
          f"must be a list of [SETTING, SETTING] pairs of two different settings ({', '.join(settings)})")
    _need(len({frozenset(c) for c in contrasts}) == len(contrasts), "contrasts",
          "pairs must be unique (a pair and its reverse are one comparison)")
    _need(not any(baseline in c for c in contrasts), "contrasts",
          f"a pair with the baseline setting ({baseline}) is already in the baseline table")
    g = Grid(name=name, preset=preset, common=_overrides(doc.get("common"), "common"), arms=arms,
             settings=settings, seeds=seeds, evals=ev, path=path, arm_seeds=arm_seeds,
             setting_seeds=setting_seeds, reuse=tuple(Path(x) for x in reuse), baseline=baseline,
             contrasts=tuple((a, b) for a, b in contrasts))  # fmt: skip
    runs = []
    all_seeds = set(seeds).union(*arm_seeds.values(), *setting_seeds.values())
    for seed in sorted(all_seeds):  # seed-major: a half-done grid has every arm
        for setting, set_ov in g.settings.items():
            for arm, arm_ov in g.arms.items():
                own = [x for x in (arm_seeds.get(arm), setting_seeds.get(setting)) if x is not None]
                if not all(seed in x for x in own) or (not own and seed not in seeds):
                    continue
                ov = [*g.common, *set_ov, *arm_ov, f"train.seed={seed}", "train.heldout_split=none"]
                try:
                    cfg = load_config(preset, overrides=ov)
                except ConfigError as exc:
                    raise GridError(f"grid field 'arms.{arm}' / 'settings.{setting}': {exc}") from None
                runs.append(RunSpec(arm, setting, seed, cfg, config_key(cfg)))
    return Grid(**{**g.__dict__, "runs": tuple(runs)})


QUICK_GRID = {
    "name": "quick",
    "preset": "cpu",
    "common": ["train.steps=2", "train.batch_tasks=2", "train.group_size=2", "train.save_every=1",
               "train.tensorboard=false", "train.plot_every=0", "train.rollout_samples=0", "harness.max_turns=4",
               "harness.max_sessions=3", "harness.max_total_turns=6"],
    "arms": {"broadcast": ["algo.estimator=broadcast"], "mosaic": ["algo.estimator=mosaic"]},
    "seeds": [0, 1],
    "evals": [{"name": "val", "split": "validation", "n_tasks": 4, "samples": 1, "temperature": 0.5},
              {"name": "test", "split": "test", "n_tasks": 4, "samples": 1, "temperature": 0.5},
              {"name": "test-d1", "split": "test", "data_seed": 1, "n_tasks": 4, "samples": 1, "temperature": 0.5}],
}
"""``mosaic experiment --quick``: 2 arms x 2 seeds, 2 steps of 2 x 2 rollouts (a smoke test of the
runner, the statistics and the report, not an experiment)."""


def load_grid(path: str | Path) -> Grid:
    p = Path(path)
    if not p.is_file():
        raise GridError(f"grid file {str(p)!r} " + ("is a directory" if p.is_dir() else "does not exist"))
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise GridError(f"grid file {str(p)!r} is not UTF-8 text (byte {exc.start}); a grid is a YAML file") from None
    except OSError as exc:
        raise GridError(f"grid file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:  # one line: the problem and where (PyYAML's message spans lines)
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise GridError(f"grid file {str(p)!r} is not valid YAML: {what}{where}") from None
    return parse_grid(doc, p)
