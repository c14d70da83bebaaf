"""``mosaic experiment``: the quick grid end to end (runner, statistics, report), skipping finished
work, resuming a killed run, and bad grid files failing before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from mosaic.cli import main
from mosaic.experiment.spec import QUICK_GRID, GridError, load_grid, parse_grid


def _mosaic(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mosaic.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    work = tmp_path_factory.mktemp("quick")
    r = _mosaic("experiment", "--quick", "--jobs", "2", "--work", str(work), "--report", str(work / "report"))
    assert r.returncode == 0, r.stdout + r.stderr
    return work, r.stdout


def test_quick_grid_runs_end_to_end_and_reports(quick):
    work, out = quick
    assert "2 arms x 1 settings x 2 seeds = 4 runs" in out and "estimated cost" in out
    rep = work / "report"
    md = (rep / "report.md").read_text()
    assert "4 of 4 runs finished" in md
    assert "pooled over test, test-d1 (headline)" in md  # the two test worlds pooled
    assert "| broadcast | base | 2 | 8 |" in md and "| mosaic | base | 2 | 8 |" in md
    assert "broadcast/base − mosaic/base" in md and "seed permutation p (Holm)" in md
    assert "sign test on questions, conditional p (Holm)" in md
    assert "the smallest difference detectable at 80 % power" in md
    assert "### Policy health" in md and "| warm start | base | 1 |" in md
    health = {(r["arm"], r["setting"]): r for r in json.loads((rep / "results.json").read_text())["health"]}
    assert set(health) == {("warm start", "base"), ("broadcast", "base"), ("mosaic", "base")}
    assert all(0 <= r["answered"] <= 1 and 0 <= r["exact_name"] <= 1 for r in health.values())
    assert health[("mosaic", "base")]["entropy_end"] > 0
    res = json.loads((rep / "results.json").read_text())
    head = res["tables"][0]
    assert head["evals"] == ["test", "test-d1"] and set(head["arms"]) == {"broadcast/base", "mosaic/base"}
    arm = head["arms"]["mosaic/base"]
    assert arm["seeds"] == 2 and arm["questions"] == 8 and 0 <= arm["lo"] <= arm["accuracy"] <= arm["hi"] <= 1
    assert "warm_start" in arm and arm["step_s"] > 0 and "main" in arm["sessions"]
    (pair,) = head["pairs"]
    assert 0 <= pair["p_sign"] <= 1 and 0 < pair["p_seeds"] <= 1 and pair["p_sign_holm"] >= pair["p_sign"]
    for name in ("learning_curves", "accuracy", "sessions", "pos_gain_share", "mechanism"):
        png = rep / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    # every arm and the warm start saw the same questions
    qsets = {tuple(sorted(json.loads(line)["question_id"] for line in p.read_text().splitlines()))
             for p in work.glob("**/evals/test.jsonl")}
    assert len(qsets) == 1 and len(list(work.glob("**/evals/test.jsonl"))) == 5


def test_rerun_skips_finished_work(quick):
    work, _ = quick
    t0 = time.perf_counter()
    r = _mosaic("experiment", "--quick", "--work", str(work))
    assert r.returncode == 0, r.stderr
    assert "everything is done" in r.stdout and r.stdout.count(" done ") >= 5
    assert time.perf_counter() - t0 < 60


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path):
    grid = dict(QUICK_GRID, name="kill", seeds=[0], arms={"mosaic": ["algo.estimator=mosaic"]},
                evals=[QUICK_GRID["evals"][0]])
    path = tmp_path / "kill.yaml"
    path.write_text(yaml.safe_dump(grid))
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "mosaic.cli", "experiment", str(path), "--work", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        found = list(work.glob("runs/*/checkpoints/ckpt-1"))
        if found:
            run = found[0].parent.parent
            break
        time.sleep(0.2)
    assert run is not None, "the run never wrote its first checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "done.json").exists()
    r = _mosaic("experiment", str(path), "--work", str(work), "--dry-run")
    assert "(resumes)" in r.stdout
    r = _mosaic("experiment", str(path), "--work", str(work))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # step 1 from before the kill, step 2 after the resume, none twice
    assert "resumed from" in (run / "job.log").read_text()
    assert (run / "done.json").exists() and (run / "evals" / "val.json").exists()


@pytest.mark.parametrize("change, field", [
    ({"arms": {}}, "arms"),
    ({"arms": {"x": "algo.estimator=mosaic"}}, "arms.x"),
    ({"arms": {"x": ["algo.estimator=ppo"]}}, "algo.estimator"),
    ({"arms": {"x": ["train.run_dir=/tmp/x"]}}, "is set by the runner"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"seeds": "0"}, "seeds"),
    ({"evals": []}, "evals"),
    ({"evals": [{"name": "v", "split": "train"}]}, "evals[0].split"),
    ({"evals": [{"name": "v", "samples": 0}]}, "evals[0]"),
    ({"evals": [{"name": "v", "data_seed": "one"}]}, "evals[0].data_seed"),
    ({"evals": [{"name": "v", "sample": 2}]}, "evals[0].sample"),
    ({"settings": {"bad name": []}}, "settings.bad name"),
    ({"common": ["optim.lr=.inf", "optim.lrr=1"]}, "optim.lrr"),
    ({"learning_rate": 1}, "learning_rate"),
])
def test_bad_grid_fails_before_any_work_naming_the_field(tmp_path, capsys, change, field):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**QUICK_GRID, **change}))
    with pytest.raises(GridError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_grid(path)
    work = tmp_path / "work"
    assert main(["experiment", str(path), "--work", str(work)]) == 2
    assert field in capsys.readouterr().err
    assert not work.exists()


def test_grid_file_errors_and_cli_usage(tmp_path, capsys):
    assert main(["experiment", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "x.yaml").write_text("arms: [1, 2\n")
    assert main(["experiment", str(tmp_path / "x.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["experiment", "--quick", "--jobs", "0"]) == 2
    assert main(["experiment"]) == 2
    assert main(["experiment", "report", str(tmp_path)]) == 2
    assert "not a grid work dir" in capsys.readouterr().err
    assert main(["experiment", "--quick", "--work", "/proc/nope"]) == 2
    assert "--work /proc/nope" in capsys.readouterr().err


def test_runs_are_keyed_by_their_resolved_config():
    g = parse_grid(QUICK_GRID)
    assert len({r.key for r in g.runs}) == 4 and len({r.name for r in g.runs}) == 4
    again = parse_grid(QUICK_GRID)
    assert [r.key for r in again.runs] == [r.key for r in g.runs]
    other = parse_grid({**QUICK_GRID, "common": [*QUICK_GRID["common"], "optim.lr=3e-4"]})
    assert not {r.key for r in other.runs} & {r.key for r in g.runs}
    assert [r.seed for r in g.runs] == [0, 0, 1, 1]  # seed-major: a half-finished grid has every arm


def test_an_arm_can_have_its_own_seeds():
    g = parse_grid({**QUICK_GRID, "arms": {"mosaic": ["algo.estimator=mosaic"],
                                           "fold": {"overrides": ["algo.estimator=fold"], "seeds": [1]}}})
    assert [(r.arm, r.seed) for r in g.runs] == [("mosaic", 0), ("mosaic", 1), ("fold", 1)]
    with pytest.raises(GridError, match="arms.fold.seed"):
        parse_grid({**QUICK_GRID, "arms": {"fold": {"overrides": [], "seed": [1]}}})


def test_a_setting_can_have_its_own_seeds():
    g = parse_grid({**QUICK_GRID, "arms": {"mosaic": ["algo.estimator=mosaic"],
                                           "fold": {"overrides": ["algo.estimator=fold"], "seeds": [1, 2]}},
                    "settings": {"base": [], "lr2": {"overrides": ["optim.lr=2e-4"], "seeds": [1]}}})
    got = [(r.arm, r.setting, r.seed) for r in g.runs]
    assert got == [("mosaic", "base", 0), ("mosaic", "base", 1), ("fold", "base", 1), ("mosaic", "lr2", 1),
                   ("fold", "lr2", 1), ("fold", "base", 2)]
    assert {r.config.optim.lr for r in g.runs if r.setting == "lr2"} == {2e-4}
    with pytest.raises(GridError, match="settings.lr2.seeds"):
        parse_grid({**QUICK_GRID, "settings": {"lr2": {"overrides": [], "seeds": [1, 1]}}})


def test_a_run_made_under_an_older_key_is_taken_over(tmp_path):
    from mosaic.experiment.runner import DONE, plan, run_dir
    from mosaic.config.loader import dump_config

    g = parse_grid(QUICK_GRID)
    r = g.runs[0]
    old = tmp_path / "runs" / f"{r.arm}-{r.setting}-s{r.seed}-00000000"
    old.mkdir(parents=True)
    saved = yaml.safe_load(dump_config(r.config))
    del saved["train"]["resume_force"]  # a field added after the run finished
    saved["train"]["run_dir"] = str(old)
    (old / "config.yaml").write_text(yaml.safe_dump(saved))
    (old / DONE).write_text("{}")
    (old / "checkpoints/ckpt-2/model").mkdir(parents=True)  # its weights are here: evaluate, not retrain
    units = {u.name: u for u in plan(g, tmp_path)}
    assert not units[r.name].train and units[r.name].dir == old  # reported, not renamed, in a plan
    plan(g, tmp_path, rename=True)
    assert run_dir(tmp_path, r).is_dir() and not old.exists()
    # a run whose saved config differs in a real value is not taken over
    other = g.runs[1]
    odd = tmp_path / "runs" / f"{other.arm}-{other.setting}-s{other.seed}-11111111"
    odd.mkdir(parents=True)
    changed = yaml.safe_load(dump_config(other.config))
    changed["optim"]["lr"] = 0.5
    (odd / "config.yaml").write_text(yaml.safe_dump(changed))
    plan(g, tmp_path, rename=True)
    assert odd.exists() and not run_dir(tmp_path, other).exists()


def test_a_run_finished_in_another_grid_is_copied_not_retrained(tmp_path, capsys):
    from mosaic.experiment.runner import DONE, REUSED, plan, print_plan, run_dir
    from mosaic.config.loader import dump_config

    first = tmp_path / "first"
    g = parse_grid(QUICK_GRID)
    with_ckpt, without = g.runs[0], g.runs[1]
    for r, ckpt in ((with_ckpt, True), (without, False)):  # finished in the first grid; only one kept its model
        d = run_dir(first, r)
        (d / ("checkpoints/ckpt-2/model" if ckpt else "evals")).mkdir(parents=True)
        (d / "config.yaml").write_text(dump_config(r.config))
        (d / DONE).write_text('{"step_s": 1.0, "rollouts_per_step": 4}')
    second = parse_grid({**QUICK_GRID, "reuse": [str(first)], "settings": {"other-name": []},
                         "evals": [{"name": "test-d7", "split": "test", "data_seed": 7, "n_tasks": 4, "samples": 1}]})
    work = tmp_path / "second"
    units = {u.run.seed if u.run else None: u for u in plan(second, work) if u.run and u.run.arm == with_ckpt.arm}
    assert units[with_ckpt.seed].reuse_from == run_dir(first, with_ckpt) and not units[with_ckpt.seed].train
    print_plan(second, plan(second, work), work, 1)
    out = capsys.readouterr().out
    assert "copied, not retrained" in out
    # the run without weights is trained again, and the plan says why (a fresh clone has no checkpoints)
    assert "1 run(s) to train here finished in" in out and "without their weights" in out
    gone = parse_grid({**QUICK_GRID, "reuse": [str(tmp_path / "nowhere")]})
    print_plan(gone, plan(gone, work), work, 1)
    assert f"reuse: {tmp_path / 'nowhere'} does not exist here" in capsys.readouterr().out
    assert not work.exists()  # a plan copies nothing
    by_key = {u.run.key: u for u in plan(second, work, rename=True) if u.run}
    got = by_key[with_ckpt.key]
    assert got.dir.name.startswith(f"{with_ckpt.arm}-other-name-") and (got.dir / DONE).exists()
    assert json.loads((got.dir / REUSED).read_text())["from"] == str(run_dir(first, with_ckpt))
    assert not got.train and [e.name for e in got.evals] == ["test-d7"]
    assert by_key[without.key].train and by_key[without.key].reuse_from is None  # no model to evaluate: retrain
    # a different config is never taken for this one
    other = parse_grid({**QUICK_GRID, "reuse": [str(first)], "common": [*QUICK_GRID["common"], "optim.lr=3e-4"]})
    assert all(u.reuse_from is None for u in plan(other, tmp_path / "third"))
    with pytest.raises(GridError, match="reuse"):
        parse_grid({**QUICK_GRID, "reuse": "somewhere"})


def test_a_run_without_weights_is_reused_when_it_has_every_evaluation_this_grid_asks_for(tmp_path, capsys):
    """Checkpoints are not committed, so a run finished in another grid has no weights on a fresh clone; when
    it holds every evaluation this grid asks for, under this grid's evaluation config, nothing is left to do
    with the weights: its results are copied, not trained again. One evaluation missing (or made under another
    config) and it is trained again, as before."""
    from mosaic.experiment.runner import DONE, REUSED, plan, print_plan, run_dir
    from mosaic.config.loader import dump_config, load_config

    first = tmp_path / "first"
    g = parse_grid(QUICK_GRID)
    ours = dump_config(load_config(g.preset, overrides=g.eval_overrides("base")))
    full, partial = g.runs[0], g.runs[1]
    for r, evals in ((full, g.evals), (partial, g.evals[:1])):  # finished, no weights; all / one evaluation
        d = run_dir(first, r)
        (d / "evals").mkdir(parents=True)
        (d / "config.yaml").write_text(dump_config(r.config))
        (d / DONE).write_text('{"step_s": 1.0, "rollouts_per_step": 4}')
        for e in evals:
            (d / "evals" / f"{e.name}.json").write_text(json.dumps({"key": e.key(), "eval_config": ours}))
            (d / "evals" / f"{e.name}.jsonl").write_text("")
    second = parse_grid({**QUICK_GRID, "reuse": [str(first)]})
    planned = {u.run.key: u for u in plan(second, tmp_path / "second") if u.run}
    assert planned[full.key].reuse_from is not None and planned[full.key].evals == []  # a plan says the copy's
    print_plan(second, plan(second, tmp_path / "second"), tmp_path / "second", 1)
    assert "1 run(s) to train here finished in" in capsys.readouterr().out  # the partial one only
    by_key = {u.run.key: u for u in plan(second, tmp_path / "second", rename=True) if u.run}
    got = by_key[full.key]
    assert got.reuse_from == run_dir(first, full) and not got.train and not got.retrain and got.evals == []
    assert json.loads((got.dir / REUSED).read_text())["evals_dropped"] == []
    assert by_key[partial.key].train and by_key[partial.key].reuse_from is None
    # an evaluation made under another harness is not this grid's: trained again
    theirs = dump_config(load_config(g.preset, overrides=[*g.eval_overrides("base"), "harness.mode=single"]))
    e = g.evals[-1]
    (run_dir(first, full) / "evals" / f"{e.name}.json").write_text(json.dumps({"key": e.key(), "eval_config": theirs}))
    again = {u.run.key: u for u in plan(second, tmp_path / "third") if u.run}
    assert again[full.key].reuse_from is None and again[full.key].train
    # and one that recorded no config (made before evaluations recorded theirs) is not taken on trust either
    (run_dir(first, full) / "evals" / f"{e.name}.json").write_text(json.dumps({"key": e.key()}))
    again = {u.run.key: u for u in plan(second, tmp_path / "fourth") if u.run}
    assert again[full.key].reuse_from is None and again[full.key].train


def test_a_copied_run_keeps_only_evaluations_made_under_this_grids_evaluation_config(tmp_path):
    """Two grids can share a run (an arm that sets its own harness, e.g. single-session GRPO) yet evaluate
    under different harnesses (the grid's common one): the copy keeps an evaluation only when it recorded
    this grid's evaluation config; one under another harness, or too old to say, is run again."""
    from mosaic.experiment.runner import DONE, REUSED, _eval_done, plan, run_dir
    from mosaic.config.loader import dump_config, load_config

    first = tmp_path / "first"
    g = parse_grid(QUICK_GRID)
    r = g.runs[0]
    d = run_dir(first, r)
    (d / "checkpoints/ckpt-2/model").mkdir(parents=True)
    (d / "config.yaml").write_text(dump_config(r.config))
    (d / DONE).write_text('{"step_s": 1.0, "rollouts_per_step": 4}')
    ours = dump_config(load_config(g.preset, overrides=g.eval_overrides("base")))
    theirs = dump_config(load_config(g.preset, overrides=[*g.eval_overrides("base"), "harness.mode=single"]))
    (d / "evals").mkdir()
    for e, cfg in zip(g.evals, (ours, theirs)):  # val: this grid's config; test: another harness; test-d1: none
        (d / "evals" / f"{e.name}.json").write_text(json.dumps({"key": e.key(), "eval_config": cfg}))
        (d / "evals" / f"{e.name}.jsonl").write_text("")
    assert _eval_done(d, g.evals[0], ours) and not _eval_done(d, g.evals[1], ours)
    assert _eval_done(d, g.evals[1]) and _eval_done(d, g.evals[1], theirs)  # no config to check against: by key
    second = parse_grid({**QUICK_GRID, "reuse": [str(first)]})
    (got,) = [u for u in plan(second, tmp_path / "second", rename=True) if u.run and u.run.key == r.key]
    assert not got.train and [e.name for e in got.evals] == ["test", "test-d1"]
    assert not (got.dir / "evals" / "test.jsonl").exists() and (got.dir / "evals" / "val.json").exists()
    assert json.loads((got.dir / REUSED).read_text())["evals_dropped"] == ["test"]
    # an evaluation that recorded no config (made before configs were recorded) is not taken on trust
    (d / "evals" / "val.json").write_text(json.dumps({"key": g.evals[0].key()}))
    (got,) = [u for u in plan(second, tmp_path / "third", rename=True) if u.run and u.run.key == r.key]
    assert [e.name for e in got.evals] == ["val", "test", "test-d1"]


def test_a_finished_run_without_its_weights_is_retrained_when_evaluations_are_missing(tmp_path, capsys):
    """Checkpoints are not committed: in a fresh clone a finished run with evaluations still to do has no
    model to evaluate, so it is trained again and all its evaluations are redone on the new weights."""
    from mosaic.experiment.job import _clear_lost_run
    from mosaic.experiment.runner import DONE, plan, print_plan, run_dir
    from mosaic.config.loader import dump_config

    g = parse_grid(QUICK_GRID)
    lost, complete, kept = g.runs[0], g.runs[1], g.runs[2]
    for r in (lost, complete, kept):
        d = run_dir(tmp_path, r)
        (d / "evals").mkdir(parents=True)
        (d / "config.yaml").write_text(dump_config(r.config))
        (d / DONE).write_text('{"step_s": 1.0, "rollouts_per_step": 4}')
        (d / "metrics.jsonl").write_text('{"step": 1}\n')
    for r in (complete,):  # every evaluation done: nothing to do although its weights are gone
        for e in g.evals:  # (a finished evaluation: its summary and its per-question records)
            (run_dir(tmp_path, r) / "evals" / f"{e.name}.json").write_text(json.dumps({"key": e.key()}))
            (run_dir(tmp_path, r) / "evals" / f"{e.name}.jsonl").write_text("")
    first = g.evals[0]
    (run_dir(tmp_path, lost) / "evals" / f"{first.name}.json").write_text(json.dumps({"key": first.key()}))
    (run_dir(tmp_path, lost) / "evals" / f"{first.name}.jsonl").write_text("")
    (run_dir(tmp_path, kept) / "checkpoints/ckpt-3/model").mkdir(parents=True)  # weights here: evaluate only
    units = {u.run.key: u for u in plan(g, tmp_path) if u.run}
    assert units[lost.key].train and units[lost.key].retrain
    assert [e.name for e in units[lost.key].evals] == [e.name for e in g.evals]  # the done one is redone too
    assert not units[complete.key].todo
    assert not units[kept.key].train and not units[kept.key].retrain and units[kept.key].evals
    print_plan(g, list(units.values()), tmp_path, 1)
    out = capsys.readouterr().out
    assert f"retrain+{len(g.evals)} evals" in out and "trained again" in out
    d = run_dir(tmp_path, lost)
    _clear_lost_run(d)
    assert not (d / DONE).exists() and not (d / "metrics.jsonl").exists() and not (d / "evals").exists()
    assert (d / "config.yaml").exists()


def test_arms_runs_part_of_a_grid_first(tmp_path):
    from mosaic.experiment.runner import plan

    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(QUICK_GRID))
    g = load_grid(path)
    keep = sorted(g.arms)[0]
    units = plan(g, tmp_path / "work", arms=[keep])
    assert {u.run.arm for u in units if u.run} == {keep} and any(u.run is None for u in units)
    r = _mosaic("experiment", str(path), "--work", str(tmp_path / "work"), "--dry-run", "--arms", keep)
    assert r.returncode == 0 and f"{keep}-base-s0" in r.stdout
    assert all(f"{a}-base-s" not in r.stdout for a in g.arms if a != keep)
    r = _mosaic("experiment", str(path), "--work", str(tmp_path / "work"), "--dry-run", "--arms", "nope")
    assert r.returncode == 2 and "no arm 'nope'" in r.stderr


def test_a_baseline_setting_is_compared_with_every_other_setting_arm_by_arm():
    """``baseline: SETTING`` adds, per arm, each setting − the baseline (the ablation table), Holm-corrected
    with the other pairs; a baseline that is not a setting fails naming the field."""
    import numpy as np

    from mosaic.experiment.report import _md_table, _table

    doc = {**QUICK_GRID, "settings": {"base": [], "kl": ["algo.kl_coef=0.05"], "hot": ["rollout.temperature=0.7"]},
           "baseline": "base"}
    grid = parse_grid(doc)
    rng = np.random.default_rng(0)
    qs = [f"q{i}" for i in range(40)]

    def seed(p):
        return {"evals": {"val": ({q: float(rng.random() < p) for q in qs}, {"metrics": {}})}, "step_s": 1.0}

    data = {"groups": {f"{a}/{s}": {"arm": a, "setting": s, "seeds": {k: seed(p) for k in (0, 1)}}
                       for a in ("broadcast", "mosaic") for s, p in (("base", 0.3), ("kl", 0.6), ("hot", 0.3))},
            "warm": {s: {"val": ({q: 0.0 for q in qs}, {})} for s in ("base", "kl", "hot")}}
    t = _table(grid, data, ["val"], "val")
    vs = {(p["a"], p["b"]) for p in t["ablations"]}
    assert vs == {(f"{a}/{s}", f"{a}/base") for a in ("broadcast", "mosaic") for s in ("kl", "hot")}
    assert len(t["pairs"]) == 3  # broadcast − mosaic in each setting; the ablations are their own family
    kl = next(p for p in t["ablations"] if p["a"] == "mosaic/kl")
    assert kl["diff"] > 0.15 and kl["p_sign"] < 0.05 and kl["p_sign_holm"] >= kl["p_sign"]
    from mosaic.train.stats import holm

    assert [p["p_sign_holm"] for p in t["pairs"]] == pytest.approx(holm([p["p_sign"] for p in t["pairs"]]))
    md = "\n".join(_md_table(t))
    assert md.index("Each setting against the baseline") < md.index("| mosaic/kl − mosaic/base |")
    assert parse_grid({**QUICK_GRID}).baseline is None
    with pytest.raises(GridError, match="baseline"):
        parse_grid({**doc, "baseline": "nope"})


def test_a_baseline_grid_reports_whether_an_arms_lead_changes_with_the_setting():
    """Issue 30 item 5: with a baseline setting and two arms, the report gives (A - B under a setting) - (A - B
    under the baseline) with the seed as the unit: a planted interaction is found with its sign, a setting
    where the arms differ alike is not, and the A/A check of the test is printed; reset sessions get a column."""
    import numpy as np

    from mosaic.experiment.report import _md_table, _table

    doc = {**QUICK_GRID, "settings": {"compaction": [], "reset": ["harness.mode=reset"], "single": ["harness.mode=single"]},
           "baseline": "compaction", "contrasts": [["reset", "single"]]}
    grid = parse_grid(doc)
    rng = np.random.default_rng(0)
    qs = [f"q{i}" for i in range(200)]

    def seed(p, resets):
        return {"evals": {"val": ({q: float(rng.random() < p) for q in qs},
                                  {"metrics": {"session/count/main": 1.0, "session/count/reset": resets}})},
                "step_s": 1.0}

    acc = {("broadcast", "compaction"): 0.3, ("mosaic", "compaction"): 0.3, ("broadcast", "reset"): 0.3,
           ("mosaic", "reset"): 0.6, ("broadcast", "single"): 0.2, ("mosaic", "single"): 0.2}
    data = {"groups": {f"{a}/{s}": {"arm": a, "setting": s, "seeds": {k: seed(acc[a, s], 2.5 * (s == "reset"))
                                                                        for k in range(4)}}
                       for a, s in acc},
            "warm": {}}
    t = _table(grid, data, ["val"], "val")
    rows = {r["setting"]: r for r in t["interactions"]["rows"]}
    assert set(rows) == {"reset", "single"} and all(r["baseline"] == "compaction" for r in rows.values())
    assert rows["reset"]["diff"] == pytest.approx(-0.3, abs=0.05) and rows["reset"]["p_welch"] < 0.001
    assert rows["reset"]["hi"] < 0 and rows["reset"]["seeds"] == (4, 4, 4, 4)
    assert rows["single"]["lo"] <= 0 <= rows["single"]["hi"] or rows["single"]["p_welch"] > 0.01
    assert rows["reset"]["p_welch_holm"] >= rows["reset"]["p_welch"]
    assert set(t["interactions"]["aa"]) == {f"{a}: {s} vs compaction" for a in ("broadcast", "mosaic")
                                            for s in ("reset", "single")}
    md = "\n".join(_md_table(t))
    assert "(A − B under the setting) − (A − B under the baseline)" in md and "A/A check of the test" in md
    assert "| broadcast − mosaic | reset vs compaction | 4, 4; 4, 4 |" in md
    assert "subagent, reset) |" in md and ", 2.50 |" in md  # reset sessions per trajectory
    # the grid's own pair of settings, arm by arm: reset - single (mosaic +40 points, broadcast +10)
    got = {(c["a"], c["b"]): c for c in t["contrasts"]}
    assert set(got) == {("broadcast/reset", "broadcast/single"), ("mosaic/reset", "mosaic/single")}
    assert got["mosaic/reset", "mosaic/single"]["diff"] == pytest.approx(0.4, abs=0.06)
    assert all(c["p_seeds_holm"] >= c["p_seeds"] for c in t["contrasts"])
    assert md.index("The grid's pairs of settings (`contrasts`)") < md.index("| mosaic/reset − mosaic/single |")
    for bad in ([["reset"]], [["reset", "reset"]], [["reset", "nope"]], [["reset", "single"], ["reset", "single"]],
                [["reset", "single"], ["single", "reset"]], [["reset", "compaction"]], "reset-single"):
        with pytest.raises(GridError, match="contrasts"):
            parse_grid({**doc, "contrasts": bad})
    assert parse_grid({**doc, "baseline": None}).baseline is None
    t0 = _table(parse_grid({**doc, "baseline": None}), data, ["val"], "val")
    assert t0["interactions"] is None and "A − B under the setting" not in "\n".join(_md_table(t0))


def test_the_report_tests_seeds_and_prints_an_aa_calibration():
    """Pairs carry the seed-level tests (permutation, Welch), the power for the paper's +3.5 and the
    conditional sign test; every arm with >= 4 seeds gets an A/A row; arms with fewer get none."""
    import numpy as np

    from mosaic.experiment.report import _md_table, _table

    grid = parse_grid({**QUICK_GRID})
    rng = np.random.default_rng(1)
    qs = [f"q{i}" for i in range(50)]

    def seed(p):
        return {"evals": {"val": ({q: float(rng.random() < p) for q in qs}, {"metrics": {}})}, "step_s": 1.0}

    data = {"groups": {"broadcast/base": {"arm": "broadcast", "setting": "base", "seeds": {k: seed(0.3) for k in range(4)}},
                       "mosaic/base": {"arm": "mosaic", "setting": "base", "seeds": {k: seed(0.35) for k in range(3)}}},
            "warm": {"base": {"val": ({q: 0.0 for q in qs}, {})}}}
    t = _table(grid, data, ["val"], "val")
    (pair,) = t["pairs"]
    assert pair["seeds_a"] == 4 and pair["seeds_b"] == 3 and 0 < pair["p_seeds"] <= 1 and 0 <= pair["p_welch"] <= 1
    assert pair["min_p_seeds"] == pytest.approx(1 / 35) and 0 <= pair["power"] <= 1 and pair["effect"] == 0.035
    assert set(t["aa"]) == {"broadcast/base"} and t["aa"]["broadcast/base"]["splits"] == 3
    assert "p_seeds" in t["arms"]["broadcast/base"]["vs_warm_start"]
    md = "\n".join(_md_table(t))
    assert "**The unit is the training seed**" in md and "conditional on the trained models" in md
    assert "| broadcast/base | 4 | 3 (2 v 2) |" in md and "A/A calibration" in md


def test_service_arms_get_a_stale_action_column_deep_search_arms_none():
    """Evaluations that log the service family's outcome (``env/*``) put the stale-action rate and the visits
    handled right in the arm table; a deep-search grid's table keeps its columns."""
    import numpy as np

    from mosaic.experiment.report import _md_table, _table

    grid = parse_grid({**QUICK_GRID})
    rng = np.random.default_rng(2)
    qs = [f"q{i}" for i in range(20)]

    def seed(p, stale):
        metrics = {"env/stale_rate": stale, "env/visits_correct": 0.5} if stale is not None else {}
        return {"evals": {"val": ({q: float(rng.random() < p) for q in qs}, {"metrics": metrics})}, "step_s": 1.0}

    def data(stale_b, stale_m):
        return {"groups": {"broadcast/base": {"arm": "broadcast", "setting": "base",
                                              "seeds": {k: seed(0.3, stale_b[k]) for k in range(2)}},
                           "mosaic/base": {"arm": "mosaic", "setting": "base",
                                           "seeds": {k: seed(0.3, stale_m[k]) for k in range(2)}}},
                "warm": {}}

    t = _table(grid, data([0.1, 0.3], [0.05, 0.05]), ["val"], "val")
    assert t["arms"]["broadcast/base"]["env"]["stale_rate"] == pytest.approx(0.2)
    md = "\n".join(_md_table(t))
    assert "stale-action rate % (visits handled right %)" in md and "| seeds | episodes |" in md
    assert "| 20.0 (50.0) |" in md and "| 5.0 (50.0) |" in md
    plain = "\n".join(_md_table(_table(grid, data([None, None], [None, None]), ["val"], "val")))
    assert "stale-action" not in plain and "The family's outcomes" not in plain and "| seeds | questions |" in plain


def test_health_table_of_a_service_grid_has_no_entity_names_and_does_not_crash():
    """The service family has no world of entity names: the report's health table gives the answer rate and
    '–' for the exact-name share (it crashed on ``ServiceSplit.world`` before)."""
    from mosaic.experiment.report import _md_health, health_table

    grid = parse_grid({**QUICK_GRID, "preset": "cpu-service", "common": ["data.n_eval_tasks=4"],
                       "evals": [{"name": "val", "split": "validation", "n_tasks": 4, "samples": 1}]})
    seeds = {k: {"answers": {"val": ["shipped", None, "gold", "x"]}, "entropy": (0.5, 0.4)} for k in range(2)}
    data = {"groups": {"broadcast/base": {"arm": "broadcast", "setting": "base", "seeds": seeds}},
            "warm_answers": {"base": ("warm", {"val": ["a", None]})}}
    rows = health_table(grid, data)
    assert [r["answered"] for r in rows] == [0.5, 0.75]
    assert all(r["exact_name"] != r["exact_name"] for r in rows)  # NaN: not measured
    md = "\n".join(_md_health(rows))
    assert "| broadcast | base | 2 | 75.0 | – (–) | 0.500 → 0.400 |" in md


def test_service_outcomes_are_compared_arm_against_arm_with_the_seed_as_the_unit():
    """The stale-action rate and visits handled right, per seed (mean over the evaluations, an evaluation with
    no mutating action left out of the rate), arm against arm: difference, bootstrap interval over seeds, exact
    permutation p over seeds, Holm."""

    from mosaic.experiment.outcomes import outcome_pairs, per_seed
    from mosaic.experiment.report import _md_table, _table

    grid = parse_grid({**QUICK_GRID})
    qs = [f"q{i}" for i in range(20)]

    def seed(stale, actions=2.0):
        m = {"env/stale_rate": stale, "env/visits_correct": 0.5, "env/actions": actions}
        return {"evals": {"val": ({q: 0.0 for q in qs}, {"metrics": m}),
                          "val2": ({q: 1.0 for q in qs}, {"metrics": {**m, "env/stale_rate": 0.0, "env/actions": 0.0}})},
                "step_s": 1.0}

    groups = {"broadcast/base": {"arm": "broadcast", "setting": "base",
                                 "seeds": {k: seed(v) for k, v in enumerate([0.30, 0.32, 0.28, 0.31, 0.29])}},
              "mosaic/base": {"arm": "mosaic", "setting": "base",
                              "seeds": {k: seed(v) for k, v in enumerate([0.10, 0.12, 0.09, 0.11, 0.10])}}}
    # the second evaluation changed nothing on the accounts: its 0.0 is no rate and is left out
    assert per_seed(groups["mosaic/base"]["seeds"], ["val", "val2"], "env/stale_rate") == pytest.approx(
        [0.10, 0.12, 0.09, 0.11, 0.10])
    rows = outcome_pairs(groups, [("broadcast/base", "mosaic/base")], ["val", "val2"])
    stale = next(r for r in rows if r["metric"] == "env/stale_rate")
    assert stale["diff"] == pytest.approx(0.196) and stale["lo"] > 0.15 and stale["hi"] < 0.25
    assert stale["p_seeds"] == pytest.approx(2 / 252) and stale["seeds_a"] == stale["seeds_b"] == 5
    visits = next(r for r in rows if r["metric"] == "env/visits_correct")
    assert visits["diff"] == 0.0 and visits["p_seeds"] == 1.0
    assert [r["p_seeds_holm"] for r in rows] == pytest.approx([min(1, 2 * stale["p_seeds"]), 1.0])
    t = _table(grid, {"groups": groups, "warm": {}}, ["val", "val2"], "pooled")
    md = "\n".join(_md_table(t))
    assert "| broadcast/base − mosaic/base | stale-action rate | 5 + 5 | +19.6 [" in md


def test_the_cost_estimate_uses_each_arms_own_finished_runs(tmp_path):
    """A costly arm (CAPO's two backward passes) is estimated from its own finished runs, not the grid's
    median; an arm with none yet takes the median of every run; a damaged done.json is skipped."""
    from mosaic.experiment.runner import DONE, measured_costs, plan, run_dir, unit_cost

    g = parse_grid(QUICK_GRID)
    work = tmp_path / "w"
    slow, fast = (next(r for r in g.runs if r.arm == a and r.seed == g.seeds[0]) for a in ("mosaic", "broadcast"))
    for r, s in ((slow, 40.0), (fast, 10.0)):
        run_dir(work, r).mkdir(parents=True)
        (run_dir(work, r) / DONE).write_text(json.dumps({"step_s": s, "rollouts_per_step": 4}))
    bad = run_dir(work, next(r for r in g.runs if r not in (slow, fast)))
    bad.mkdir(parents=True)
    (bad / DONE).write_text('["not", "a", "mapping"]')
    costs = measured_costs(work)
    assert costs["measured_runs"] == 2 and costs["step_s_per_rollout"] == 25.0 / 4
    units = {u.name: u for u in plan(g, work) if u.run is not None}
    other_mosaic = next(u for u in units.values() if u.run.arm == "mosaic" and u.run.seed != g.seeds[0])
    other_broadcast = next(u for u in units.values() if u.run.arm == "broadcast" and u.run.seed != g.seeds[0])
    t = other_mosaic.run.config.train
    rollouts = (t.steps or 20) * t.batch_tasks * t.group_size
    evals = sum(e.n_tasks * e.samples for e in other_mosaic.evals) * costs["eval_s_per_traj"]
    assert unit_cost(other_mosaic, costs) == pytest.approx(evals + rollouts * 10.0)
    assert unit_cost(other_broadcast, costs) == pytest.approx(evals + rollouts * 2.5)


def test_the_cost_estimate_takes_a_settings_runs_under_another_arm(tmp_path):
    """A setting with finished runs under one arm only (reset runs cost several times compaction's, under any
    estimator) is estimated from those, training and evaluation alike, not from the grid's medians."""
    from mosaic.experiment.runner import DONE, measured_costs, plan, run_dir, unit_cost

    g = parse_grid(dict(QUICK_GRID, settings={"cheap": ["harness.mode=compaction"], "dear": ["harness.mode=single"]}))
    work = tmp_path / "w"
    for setting, step_s, eval_s in (("cheap", 4.0, 0.4), ("dear", 40.0, 8.0)):
        r = next(r for r in g.runs if r.arm == "broadcast" and r.setting == setting and r.seed == g.seeds[0])
        (run_dir(work, r) / "evals").mkdir(parents=True)
        (run_dir(work, r) / DONE).write_text(json.dumps({"step_s": step_s, "rollouts_per_step": 4}))
        (run_dir(work, r) / "evals" / "val.json").write_text(json.dumps({"seconds": eval_s, "trajectories": 4}))
    costs = measured_costs(work)
    assert costs["eval_by_group"] == {"broadcast-cheap": 0.1, "broadcast-dear": 2.0}
    u = next(u for u in plan(g, work) if u.run is not None and u.run.arm == "mosaic" and u.run.setting == "dear")
    t = u.run.config.train
    rollouts = (t.steps or 20) * t.batch_tasks * t.group_size
    assert unit_cost(u, costs) == pytest.approx(sum(e.n_tasks * e.samples for e in u.evals) * 2.0 + rollouts * 10.0)
