"""``mosaic view`` in a real browser: headless Chromium (Debian's package, installed here if missing)
opens the page of a real ``mosaic train`` run dir (the CPU preset's main job, one small step), and the
rendered DOM is checked: sessions drawn, a transcript opened by a real mouse click, the filters.

Part of ``make test`` (CI): one small training step (seconds on an idle 2-core machine) and a
browser start; skipped only where Chromium is missing and cannot be installed (no root ``apt-get``).
``MOSAIC_VIEW_RUN_DIR=DIR`` checks an existing run dir instead (e.g. the main job's ``runs/cpu``;
it is only read); ``MOSAIC_VIEW_SCREENSHOTS=DIR`` keeps the screenshots there.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from mosaic.cli import main
from mosaic.view.browser import Browser


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run dir written by ``mosaic train`` with the CPU preset (the main job), one small step."""
    from mosaic.train import entrypoints
    from mosaic.config.loader import load_config

    if os.environ.get("MOSAIC_VIEW_RUN_DIR"):
        return Path(os.environ["MOSAIC_VIEW_RUN_DIR"])
    d = tmp_path_factory.mktemp("view") / "run"
    cfg = load_config("cpu", overrides=[
        f"data.cache_dir={tmp_path_factory.mktemp('cache')}", "data.n_train_tasks=8", "train.steps=1",
        "train.batch_tasks=2", "train.group_size=2", "train.heldout_split=none", "train.tensorboard=false",
        "train.rollout_samples=4", f"train.run_dir={d}",
    ])  # fmt: skip
    assert entrypoints.run_train(cfg) == 0
    return d


def _shot(b: Browser, tmp_path: Path, name: str) -> Path:
    p = b.screenshot(tmp_path / name)
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    keep = os.environ.get("MOSAIC_VIEW_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, Path(keep) / name)
    return p


def _prompt_len(rec: dict, k: int) -> int:
    s = rec["sessions"][k]
    return (s["prefix"][1] if "prefix" in s else 0) + len(s["prompt"])


def _set(b: Browser, select_id: str, value: str) -> None:
    b.eval(f"(() => {{ const s = document.getElementById({json.dumps(select_id)}); s.value = {json.dumps(value)};"
           f" s.dispatchEvent(new Event('change')); }})()")  # fmt: skip


def test_the_main_jobs_run_renders_and_a_click_opens_a_transcript(chromium, run_dir, tmp_path):
    page = tmp_path / "view.html"
    assert main(["view", str(run_dir), "-o", str(page)]) == 0
    everything = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    last = max(r["step"] for r in everything)
    first = next(i for i, r in enumerate(everything) if r["step"] == last)
    recs = [r for r in everything if r["step"] == last]  # the page opens on the latest step
    assert 0 < len(recs) <= 40  # one page of cards
    with Browser(chromium) as b:
        b.open(page)
        assert b.page_errors() == []
        # one card per trajectory of the step, one node per session, one edge per parent link
        assert b.eval("document.querySelectorAll('article.traj').length") == len(recs)
        assert b.eval("document.querySelectorAll('svg.graph g.node').length") == sum(len(r["sessions"]) for r in recs)
        edges = sum(s["parent"] is not None for r in recs for s in r["sessions"])
        assert b.eval("document.querySelectorAll('svg.graph path.edge').length") == edges
        assert b.eval("document.querySelectorAll('#charts figure.chart').length") >= 3  # the step's plots
        # every registered estimator has its row in each advantage table
        assert b.eval("document.querySelectorAll('article.traj')[0].querySelectorAll('table.adv tr').length") == \
            1 + len(recs[0]["unavailable"]) + len(recs[0]["sessions"][0]["adv"]) + len(recs[0]["sessions"][0]["turn_adv"]) + 1
        # a real click on a session (a compaction one when the rollout has one) opens its transcript
        ti, k = next(((i, s["id"]) for i, r in enumerate(recs) for s in r["sessions"] if s["kind"] == "compaction"),
                     (0, 0))  # fmt: skip
        assert b.eval("document.getElementById('transcript').hidden") is True
        b.click(f"article[data-traj='{first + ti}'] g.node[data-s='{k}']")
        b.wait_for("!document.getElementById('transcript').hidden")
        s = recs[ti]["sessions"][k]
        assert b.eval("document.querySelectorAll('#transcript .tbody .t[data-i]').length") == \
            _prompt_len(recs[ti], k) + len(s["completion"])
        sampled = sum(s["mask"][1::2])
        assert b.eval("document.querySelectorAll('#transcript .tbody .t.z3').length") == sampled
        header = b.eval("document.querySelector('#transcript header').innerText")
        assert f"session {k}" in header and s["kind"] in header
        if s["kind"] == "compaction":
            assert "summary, handed off to session" in b.eval("document.getElementById('transcript').innerText")
        _shot(b, tmp_path, "view_run.png")
        # colour by advantage: every trained token gets a colour
        _set(b, "f-colour", "advantage")
        assert b.eval("[...document.querySelectorAll('#transcript .tbody .t.z3')].every(e => e.style.background)") is True
        # filters: outcome and kind
        _set(b, "f-outcome", "failure")
        assert b.eval("document.querySelectorAll('article.traj').length") == sum(not r["success"] for r in recs)
        _set(b, "f-outcome", "all")
        _set(b, "f-kind", "compaction")
        assert b.eval("document.querySelectorAll('article.traj').length") == \
            sum(any(s["kind"] == "compaction" for s in r["sessions"]) for r in recs)
        assert b.page_errors() == []


def test_forks_are_drawn_as_edges_to_subagents(chromium, tmp_path):
    from mosaic.trace import write_jsonl
    from tests.train.trajs import compaction_chain, fork

    rng = random.Random(1)
    trajs = [fork(rng, tid=f"f{i}") for i in range(3)] + [compaction_chain(rng, 1, tid="c")]
    write_jsonl(tmp_path / "rollouts.jsonl", trajs)
    (tmp_path / "vocab.json").write_text(json.dumps({"pieces": [f"w{i} " for i in range(400)]}))
    assert main(["view", str(tmp_path / "rollouts.jsonl")]) == 0
    with Browser(chromium) as b:
        b.open(tmp_path / "rollouts.html")
        assert b.eval("document.querySelectorAll('g.node').length") == sum(len(t.sessions) for t in trajs)
        assert b.eval("document.querySelectorAll('path.edge.forks').length") == 3
        assert b.eval("document.querySelectorAll('path.edge.continues').length") == 2
        b.click("article[data-traj='0'] g.node[data-s='1']")
        b.wait_for("!document.getElementById('transcript').hidden")
        header = b.eval("document.querySelector('#transcript header').innerText")
        # issue 33: a fork says which turn of its parent it left from (the delegate call is turn 3)
        assert "forks from session 0 at its turn 3" in header
        labels = "[...document.querySelectorAll('article[data-traj=\"0\"] text.elabel')].map(e => e.textContent)"
        assert b.eval(labels) == ["from turn 3"]
        # column heads say what they are; gains carry their unit
        heads = b.eval("[...document.querySelectorAll('article[data-traj=\"0\"] table.adv th')].map(e => e.innerText)")
        assert heads[:2] == ["advantage by estimator", "whole trajectory (token mean)"]
        assert heads[2:] == ["session 0\nmain", "session 1\nsubagent"]
        assert "information gain (nats per answer token)" in b.eval("document.querySelector('tr.gain').innerText")
        _shot(b, tmp_path, "view_forks.png")
        assert b.page_errors() == []


def test_downstream_credit_is_shown_beside_the_immediate_gain(chromium, tmp_path):
    """Issue 32: a ``mosaic-dag`` run's page shows each session's downstream credit next to its gain, and
    marks the sessions where the two disagree in sign."""
    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    d = tmp_path / "run"
    cfg = load_config("cpu", overrides=[
        f"data.cache_dir={tmp_path / 'cache'}", "data.n_train_tasks=8", "train.steps=1", "harness.mode=fork",
        "algo.estimator=mosaic-dag", "train.batch_tasks=2", "train.group_size=4", "train.heldout_split=none",
        "train.tensorboard=false", "train.rollout_samples=8", f"train.run_dir={d}",
    ])  # fmt: skip
    assert entrypoints.run_train(cfg) == 0
    recs = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
    subs = [(i, k, s) for i, r in enumerate(recs) for k, s in enumerate(r["sessions"]) if s["kind"] == "subagent"]
    assert subs and all(isinstance(s["downstream"], float) and s["downstream_how"] == "direct" for *_, s in subs)
    disagree = sum(1 for *_, s in subs if s["gain"] * s["downstream"] < 0)
    assert main(["view", str(d)]) == 0
    with Browser(chromium) as b:
        b.open(d / "view.html")
        rows = b.eval("[...document.querySelectorAll('tr.gain')].map(e => e.innerText)")
        assert any(r.startswith("downstream credit (nats per answer token)") for r in rows), rows
        assert b.eval("document.querySelectorAll('td.disagree').length") == disagree
        i, k, s = subs[0]
        node = f"article[data-traj='{i}'] g.node[data-s='{k}']"
        assert " · D " in b.eval(f"document.querySelector(\"{node} text.sub\").textContent")
        b.click(node)
        b.wait_for("!document.getElementById('transcript').hidden")
        assert "downstream credit" in b.eval("document.querySelector('#transcript header').innerText")
        assert b.page_errors() == []


def test_reset_sessions_show_their_role_and_workspace(chromium, tmp_path):
    """Issue 30: a ``harness.mode=reset`` run with two roles (the second played by a frozen partner) shows
    each reset session's role on its node and in its transcript, with the workspace notes it started from."""
    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    d = tmp_path / "run"
    cfg = load_config("cpu", overrides=[
        f"data.cache_dir={tmp_path / 'cache'}", "data.n_train_tasks=8", "train.steps=1", "harness.mode=reset",
        "harness.reset_k=2", 'harness.reset_roles=["searcher: note what you find", "solver: answer"]',
        "harness.partner=frozen", "train.batch_tasks=2", "train.group_size=2", "train.heldout_split=none",
        "train.tensorboard=false", "train.rollout_samples=4", f"train.run_dir={d}",
    ])  # fmt: skip
    assert entrypoints.run_train(cfg) == 0
    recs = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
    two = [(i, r) for i, r in enumerate(recs) if len(r["sessions"]) >= 2]
    assert two, "no trajectory reset: nothing to show"
    i, r = two[0]
    assert [s["role"]["index"] for s in r["sessions"][:2]] == [0, 1]
    assert r["sessions"][1]["role"] == {"index": 1, "text": "solver: answer", "partner": "frozen"}
    assert main(["view", str(d)]) == 0
    with Browser(chromium) as b:
        b.open(d / "view.html")
        node = f"article[data-traj='{i}'] g.node[data-s='1']"
        assert b.eval(f"document.querySelector(\"{node} text\").textContent").endswith("reset r2*")
        b.click(node)
        b.wait_for("!document.getElementById('transcript').hidden")
        head = b.eval("document.querySelector('#transcript header').innerText")
        assert "role 2 (solver: answer), played by the frozen partner (not trained)" in head, head
        assert "workspace notes:" in head
        assert b.page_errors() == []
