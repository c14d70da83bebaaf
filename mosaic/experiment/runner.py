"""Run a grid: every (arm, setting, seed) ``mosaic train`` run, then every held-out evaluation.

Work directory layout (``runs/experiments/<grid>`` by default)::

    grid.yaml                       the grid file as run
    runs/<arm>-<setting>-s<seed>-<key>/   a ``mosaic train`` run dir (config hash in the name)
        done.json                   written when training finished
        evals/<eval>.jsonl|.json    per-question outcomes and metrics of the final model
    warmstart/eval-<hash>/evals/<eval>.jsonl|.json   the warm start, once per evaluation config

A unit of work (one run's training and its evaluations, or one warm-start
evaluation) runs in its own process (``python -m mosaic.experiment.job``), so
``--jobs N`` runs N at once with ``cores / N`` threads each (the cores this process may use). A rerun skips what
is done: finished runs (``done.json``), finished evaluations, and resumes a
killed training run from its last checkpoint (``train.resume=auto``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import yaml

from mosaic.experiment.spec import EvalSpec, Grid, RunSpec, config_key
from mosaic.config.loader import Config, config_diff, dump_config, load_config

__all__ = ["Unit", "plan", "run_grid", "print_plan", "DONE", "run_dir", "warm_dir"]

DONE = "done.json"
_GROUP = re.compile(r"-s\d+-[0-9a-f]{8}$")
"""A run dir's seed and key (``<arm>-<setting>-s<seed>-<key>``): removed, the arm and setting remain."""
PRIOR_STEP_S_PER_ROLLOUT = 12.4 / 32
"""Prior cost before anything ran here: the CPU preset's measured RL step (12.4 s for 4 x 8 rollouts)."""
PRIOR_EVAL_S_PER_TRAJ = 0.18
"""Prior cost of one evaluation trajectory (128 x 4 in about 90 s on 2 cores)."""


def run_dir(work: Path, r: RunSpec) -> Path:
    return work / "runs" / r.name


def warm_dir(work: Path, grid: Grid, setting: str) -> Path:
    """Where the warm start's evaluations under ``setting`` go: keyed by the evaluation config's hash."""
    ecfg = load_config(grid.preset, overrides=grid.eval_overrides(setting))
    shaping = Config(model=ecfg.model, data=ecfg.data, harness=ecfg.harness)  # what shapes a warm-start evaluation
    return work / "warmstart" / f"eval-{config_key(shaping)[:10]}"


@dataclass
class Unit:
    """One process's work: a run's training (unless done) and its missing evaluations, or a warm-start evaluation."""

    name: str
    dir: Path
    train: bool
    evals: list[EvalSpec]
    config_yaml: str
    """Training config (runs) or evaluation config (warm start)."""
    eval_config_yaml: str
    run: RunSpec | None = None
    drift: tuple[str, ...] = ()
    """For a finished run: keys whose value in the run's saved ``config.yaml`` differs from today's resolution."""
    reuse_from: Path | None = None
    """A finished run of the same config in another grid's work dir (``reuse:``), copied instead of trained."""
    retrain: bool = False
    """A finished run whose weights are gone (checkpoints are not committed) but which still has evaluations
    to do: it is trained again from scratch and every evaluation is redone on the new weights."""

    @property
    def todo(self) -> bool:
        return self.train or bool(self.evals)


def _read_eval(meta: Path) -> dict | None:
    """An evaluation's meta file, or None when it is missing or unreadable."""
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def _same_eval_config(m: dict, eval_yaml: str) -> bool | None:
    """Whether evaluation ``m`` ran under ``eval_yaml`` (harness, sampling; up to fields added since);
    None when it did not record its config (made before evaluations recorded one)."""
    saved = m.get("eval_config")
    return not _drift(saved, eval_yaml) if isinstance(saved, str) else None


def _eval_done(d: Path, e: EvalSpec, eval_yaml: str | None = None) -> bool:
    """``e`` was run in ``d`` (its summary and its per-question records both there): same key and, when
    ``eval_yaml`` is given, not under another evaluation config (one that recorded none counts as done in its
    own grid)."""
    m = _read_eval(d / "evals" / f"{e.name}.json")
    if m is None or m.get("key") != e.key() or not (d / "evals" / f"{e.name}.jsonl").exists():
        return False
    return eval_yaml is None or _same_eval_config(m, eval_yaml) is not False


def _drop_foreign_evals(d: Path, eval_yaml: str) -> list[str]:
    """Remove from a run copied from another grid the evaluations not known to have run under this
    grid's evaluation config (another harness or sampling, or one too old to say): a grid evaluates
    every arm the same way, and an evaluation with the same name and questions under another harness
    is not one of its results. Returns the names removed."""
    gone = []
    for meta in sorted((d / "evals").glob("*.json")):
        m = _read_eval(meta)
        if m is None or not _same_eval_config(m, eval_yaml):
            meta.unlink()
            meta.with_suffix(".jsonl").unlink(missing_ok=True)
            gone.append(meta.stem)
    return gone


def _drift(saved: str, text: str) -> list[str]:
    """Keys whose saved value differs from today's, leaving out the run dir, fields the saved config lacks
    (added since, at a default that keeps the old behaviour) and fields that no longer exist."""
    return [x for x in config_diff(saved, text)
            if not x.startswith("train.run_dir:") and ": (absent) -> " not in x and not x.endswith(" -> (absent)")]


def adopt(work: Path, r: RunSpec, text: str, *, rename: bool) -> Path:
    """The run dir of ``r``; a dir of the same arm, setting and seed made under an older key (before a
    config field was added) is taken over — renamed when ``rename`` — if its saved config differs only by
    fields it lacks."""
    d = run_dir(work, r)
    if d.exists():
        return d
    for old in sorted((work / "runs").glob(f"{r.arm}-{r.setting}-s{r.seed}-*")):
        saved = old / "config.yaml"
        if old == d or not saved.exists():
            continue
        if not _drift(saved.read_text(), text):
            if not rename:
                return old
            old.rename(d)
            return d
    return d


REUSED = "reused.json"


def _kept(d: Path, e: EvalSpec, eval_yaml: str) -> bool:
    """Evaluation ``e`` in another grid's run dir ``d`` is one this grid keeps when copying it: done, and
    known to have run under ``eval_yaml`` (:func:`_drop_foreign_evals` removes the others)."""
    return _eval_done(d, e) and bool(_same_eval_config(_read_eval(d / "evals" / f"{e.name}.json") or {}, eval_yaml))


def _evaluated(d: Path, grid: Grid, eval_yaml: str) -> bool:
    """Every evaluation of ``grid`` is in run dir ``d``, each known to have run under ``eval_yaml``."""
    return all(_kept(d, e, eval_yaml) for e in grid.evals)


def _finished_as(d: Path, text: str) -> bool:
    """Run dir ``d`` finished training the config ``text`` (its saved config, no drift)."""
    saved = d / "config.yaml"
    return (d / DONE).exists() and saved.exists() and not _drift(saved.read_text(), text)


def _has_weights(d: Path) -> bool:
    """Run dir ``d`` still holds a checkpoint's model (checkpoints are not committed)."""
    return any(d.glob("checkpoints/ckpt-*/model"))


def reusable(grid: Grid, r: RunSpec, text: str, eval_yaml: str | None = None) -> Path | None:
    """A finished run of ``r``'s config (same key, no drift) in a ``reuse`` work dir that has its weights (a
    final checkpoint) or, without them (checkpoints are not committed), every evaluation this grid asks for,
    run under ``eval_yaml``: nothing is left to do with the weights, so its results are reused as they are."""
    for w in grid.reuse:
        for cand in sorted((w / "runs").glob(f"*-{r.key[:8]}")):
            if _finished_as(cand, text) and (
                    _has_weights(cand) or (eval_yaml is not None and _evaluated(cand, grid, eval_yaml))):
                return cand
    return None


def _bare(c: Path, grid: Grid, u: Unit) -> bool:
    """Run dir ``c`` of another grid finished ``u``'s config (no drift) but is not reusable: its weights are
    gone and some evaluation this grid asks for is missing there."""
    return _finished_as(c, u.config_yaml) and not _has_weights(c) and not _evaluated(c, grid, u.eval_config_yaml)


def reuse_notes(grid: Grid, units: list[Unit]) -> list[str]:
    """Why ``reuse:`` copies less than it could: a work dir that does not exist, and runs to train although a
    finished run of the same config lies in a reuse dir without its weights and without some evaluation this
    grid asks for (checkpoints are not committed: on a fresh clone such a run is trained again)."""
    out = [f"reuse: {w} does not exist here (nothing is reused from it)" for w in grid.reuse if not (w / "runs").is_dir()]
    for w in (w for w in grid.reuse if (w / "runs").is_dir()):
        bare = [u.name for u in units if u.train and u.run is not None
                and any(_bare(c, grid, u) for c in (w / "runs").glob(f"*-{u.run.key[:8]}"))]
        if bare:
            out.append(f"reuse: {len(bare)} run(s) to train here finished in {w} with the same config but without "
                       f"their weights (checkpoints are not committed): trained again, e.g. {bare[0]}")
    return out


def plan(grid: Grid, work: Path, *, rename: bool = False, arms: Sequence[str] | None = None) -> list[Unit]:
    """Every unit of the grid with what is left to do (warm-start evaluations first); ``rename`` takes
    over run dirs made under an older key (:func:`adopt`), else they are only reported. ``arms`` keeps
    only those arms' runs (and the warm start), to finish part of a grid first."""
    units, seen = [], set()
    eval_yaml = {s: dump_config(load_config(grid.preset, overrides=grid.eval_overrides(s))) for s in grid.settings}
    for setting in grid.settings:
        d = warm_dir(work, grid, setting)
        if d in seen:  # settings that differ only in training share the warm start's evaluation
            continue
        seen.add(d)
        todo = [e for e in grid.evals if not _eval_done(d, e, eval_yaml[setting])]
        units.append(Unit(f"warmstart/{d.name}", d, False, todo, eval_yaml[setting], eval_yaml[setting]))
    for r in grid.runs:
        d = adopt(work, r, dump_config(r.config), rename=rename)
        cfg = dataclasses.replace(r.config, train=dataclasses.replace(r.config.train, run_dir=str(d)))
        done, text = (d / DONE).exists(), dump_config(cfg)
        src = None if done or any(d.glob("checkpoints/ckpt-*")) else reusable(grid, r, text, eval_yaml[r.setting])
        if src is not None and rename:  # copy the other grid's run (checkpoints, metrics, evals) and say so
            if d.exists():
                shutil.rmtree(d)
            shutil.copytree(src, d)
            dropped = _drop_foreign_evals(d, eval_yaml[r.setting])
            (d / REUSED).write_text(json.dumps({"from": str(src), "evals_dropped": dropped}, indent=1))
            done = True
        drift = tuple(_drift((d / "config.yaml").read_text(), text)) if done and (d / "config.yaml").exists() else ()
        if src is not None and not rename:  # a plan only: what the copy will hold
            evals = [e for e in grid.evals if not _kept(src, e, eval_yaml[r.setting])]
        else:
            evals = [e for e in grid.evals if not _eval_done(d, e, eval_yaml[r.setting])]
        retrain = done and bool(evals) and not _has_weights(d)
        if retrain:  # old evaluations belong to the lost weights: redo them all on the retrained ones
            evals, drift = list(grid.evals), ()
        units.append(Unit(r.name, d, (not done and src is None) or retrain, evals, text, eval_yaml[r.setting], r,
                          drift, src, retrain))  # fmt: skip
    if arms is not None:
        units = [u for u in units if u.run is None or u.run.arm in arms]
    return units


# ----------------------------------------------------------------------------- cost


def measured_costs(work: Path, *more: Path) -> dict[str, float]:
    """Seconds per rollout of a training step and per evaluation trajectory, from what ran in ``work``
    (and in ``more`` work dirs, e.g. the grids a grid reuses runs from): pooled medians, and per run group
    (``<arm>-<setting>``) in ``by_group`` / ``eval_by_group``."""
    step, per_traj, by_group, eval_by_group = [], [], {}, {}
    for done in (d for w in (work, *more) for d in (w / "runs").glob(f"*/{DONE}")):
        try:
            d = json.loads(done.read_text())
            step.append(d["step_s"] / max(1, d["rollouts_per_step"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        by_group.setdefault(_GROUP.sub("", done.parent.name), []).append(step[-1])
    for meta in (m for w in (work, *more) for m in w.glob("**/evals/*.json")):
        try:
            d = json.loads(meta.read_text())
            per_traj.append(d["seconds"] / max(1, d["trajectories"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if meta.parent.parent.parent.name == "runs":  # a run's evaluation (the warm start's count pooled only)
            eval_by_group.setdefault(_GROUP.sub("", meta.parent.parent.name), []).append(per_traj[-1])
    return {"step_s_per_rollout": median(step) if step else PRIOR_STEP_S_PER_ROLLOUT,
            "eval_s_per_traj": median(per_traj) if per_traj else PRIOR_EVAL_S_PER_TRAJ,
            "measured_runs": len(step), "measured_evals": len(per_traj),
            "by_group": {k: median(v) for k, v in by_group.items()},
            "eval_by_group": {k: median(v) for k, v in eval_by_group.items()}}  # fmt: skip


def _rate(u: Unit, by_group: dict[str, float], pooled: float) -> float:
    """A run's measured rate: its own arm and setting's finished runs, else its setting's under any arm (a
    reset setting costs more per step than compaction under every estimator), else the grid's median."""
    group = _GROUP.sub("", u.run.name)
    if group in by_group:
        return by_group[group]
    same = [v for k, v in by_group.items() if k.endswith(f"-{u.run.setting}")]
    return median(same) if same else pooled


def unit_cost(u: Unit, costs: dict[str, float]) -> float:
    per_traj = costs["eval_s_per_traj"]
    if u.run is not None:
        per_traj = _rate(u, costs.get("eval_by_group", {}), per_traj)
    s = sum(e.n_tasks * e.samples for e in u.evals) * per_traj
    if u.train and u.run is not None:
        t = u.run.config.train
        steps = t.steps or 20
        per = _rate(u, costs.get("by_group", {}), costs["step_s_per_rollout"])
        s += steps * t.batch_tasks * t.group_size * per  # (an arm's own runs when some finished: CAPO costs more)
    return s


def print_plan(grid: Grid, units: list[Unit], work: Path, jobs: int, out=None) -> float:
    out = out or sys.stdout
    costs = measured_costs(work, *grid.reuse)
    src = (f"measured {'here and in the reused grids' if grid.reuse else 'here'} ({costs['measured_runs']} runs, {costs['measured_evals']} evaluations)"
           if costs["measured_runs"] or costs["measured_evals"] else "prior (CPU preset figures, 2 cores)")  # fmt: skip
    print(f"grid {grid.name}: {len(grid.arms)} arms x {len(grid.settings)} settings x {len(grid.seeds)} seeds = "
          f"{len(grid.runs)} runs; {len(grid.evals)} evaluations each ({', '.join(e.name for e in grid.evals)})",
          file=out)  # fmt: skip
    print(f"work dir: {work}", file=out)
    total = 0.0
    for u in units:
        c = unit_cost(u, costs)
        total += c
        state = "done" if not u.todo and u.reuse_from is None else ("train+" if u.train else "") + f"{len(u.evals)} evals"
        if u.retrain:
            state = f"retrain+{len(u.evals)} evals"
        elif u.train and (u.dir / "checkpoints").is_dir():
            state += " (resumes)"
        if u.reuse_from is not None:
            state = f"copy+{len(u.evals)} evals"
        print(f"  {u.name:<48} {state:<22} ~{c / 60:5.1f} min", file=out)
        if u.reuse_from is not None:
            print(f"    trained already in {u.reuse_from} (same config): copied, not retrained", file=out)
        if u.retrain:
            print("    finished before, but its checkpoints are not here and evaluations are missing: trained again",
                  file=out)  # fmt: skip
        if u.drift:
            print(f"    warning: finished under another resolved config (a default changed?): {'; '.join(u.drift)}",
                  file=out)  # fmt: skip
    for note in reuse_notes(grid, units):
        print(f"  note: {note}", file=out)
    print(f"estimated cost: {total / 60:.1f} CPU-job minutes, about {total / 60 / max(1, min(jobs, sum(u.todo for u in units))):.1f} min wall with "
          f"--jobs {jobs} (per-rollout step {costs['step_s_per_rollout']:.2f} s, per eval trajectory "
          f"{costs['eval_s_per_traj']:.3f} s; {src})", file=out, flush=True)  # fmt: skip
    return total


# ----------------------------------------------------------------------------- execution


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (``taskset``, a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity API on this platform)
        return os.cpu_count() or 1


def _launch(u: Unit, threads: int) -> tuple[Unit, int, float]:
    u.dir.mkdir(parents=True, exist_ok=True)
    job = {"name": u.name, "dir": str(u.dir), "train": u.train, "config_yaml": u.config_yaml,
           "eval_config_yaml": u.eval_config_yaml, "evals": [asdict(e) | {"key": e.key()} for e in u.evals],
           "warm_start": u.run is None, "retrain": u.retrain}  # fmt: skip
    (u.dir / "job.json").write_text(json.dumps(job, indent=1))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), MOSAIC_THREADS=str(threads))
    t0 = time.perf_counter()
    with open(u.dir / "job.log", "a") as log:
        rc = subprocess.call([sys.executable, "-m", "mosaic.experiment.job", str(u.dir / "job.json")],
                             stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    return u, rc, time.perf_counter() - t0


def run_grid(grid: Grid, work: Path, *, jobs: int = 1, out=None, arms: Sequence[str] | None = None) -> int:
    """Run every unit left to do (of ``arms`` only, when given), ``jobs`` at once; returns the number of
    failed units."""
    out = out or sys.stdout
    work.mkdir(parents=True, exist_ok=True)
    if grid.path is not None:
        shutil.copyfile(grid.path, work / "grid.yaml")
    else:
        (work / "grid.yaml").write_text(yaml.safe_dump({"name": grid.name}))
    units = [u for u in plan(grid, work, rename=True, arms=arms) if u.todo]
    if not units:
        print(f"grid {grid.name}: everything is done", file=out)
        return 0
    threads = max(1, usable_cores() // min(jobs, len(units)))  # (fewer units than jobs: more threads each)
    failed = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_launch, u, threads) for u in units]
        for i, f in enumerate(as_completed(futures), 1):
            u, rc, secs = f.result()
            status = "ok" if rc == 0 else f"FAILED (exit {rc}; see {u.dir / 'job.log'})"
            failed += rc != 0
            print(f"[{i}/{len(units)}] {u.name}: {status} in {secs / 60:.1f} min "
                  f"(elapsed {(time.perf_counter() - t0) / 60:.1f} min)", file=out, flush=True)  # fmt: skip
    return failed
