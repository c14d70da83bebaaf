"""The trainer config, --help-config, the verl plugin and the docs read the estimator knobs from the registry;
adding an estimator with a new knob needs nothing outside ``mosaic/core/estimators.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from mosaic.core.estimators import KNOBS, knob_table
from mosaic.config.loader import AlgoConfig, ConfigError, describe_config, field_docs, load_config

REPO = Path(__file__).resolve().parents[2]


def test_algo_has_one_field_per_knob_with_the_registry_type_default_and_doc():
    hints = typing.get_type_hints(AlgoConfig)
    by_name = {f.name: f for f in fields(AlgoConfig)}
    docs = field_docs(AlgoConfig)
    for k in KNOBS.values():
        assert hints[k.name] is k.type and by_name[k.name].default == k.default
        assert docs[k.name].startswith(k.doc)
    help_text = describe_config(load_config("cpu"), ["algo"])
    for k in KNOBS:
        assert f"  algo.{k} = " in help_text


@pytest.mark.parametrize("name", [k.name for k in KNOBS.values() if k.bounds])
def test_a_knob_out_of_range_names_its_dotted_key(name):
    bad = {"[0, 1)": 1.0, "[0, 1]": 1.5, "[0, inf)": -1.0, "(0, inf)": 0.0}[KNOBS[name].bounds]
    with pytest.raises(ConfigError, match=re.escape(f"config key 'algo.{name}': {KNOBS[name].check(bad)} (got ")):
        load_config("cpu", overrides=[f"algo.{name}={bad}"])


def test_the_other_spelling_is_accepted_with_one_note():
    c = load_config("cpu", overrides=["algo.estimator=mosaic_traj"])
    assert c.algo.estimator == "mosaic-traj" and c.algo.notes() == [
        "algo.estimator=mosaic_traj is another spelling; write algo.estimator=mosaic-traj"]
    assert load_config("cpu", overrides=["algo.estimator=mosaic-traj"]).algo.notes() == []
    r = subprocess.run([sys.executable, "-m", "mosaic.cli", "train", "--print-config", "algo.estimator=mosaic_traj"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "estimator: mosaic-traj" in r.stdout and r.stderr.count("another spelling") == 1


def test_the_docs_knob_table_is_the_registrys():
    doc = (REPO / "docs" / "knobs.md").read_text(encoding="utf-8")
    assert knob_table() in doc


THROWAWAY = textwrap.dedent('''
    import torch
    from mosaic.core import estimators as E

    # What a new estimator with a new knob adds to mosaic/core/estimators.py, and nothing else.
    E.add_knob(E.Knob("tau", float, 0.5, "Scale of the throwaway estimator", "[0, 1]"))

    def _scaled(b, p):
        return E.adv.broadcast(E._outcome(b, p), b.session_traj) * p.tau

    E.register(E.Estimator("scaled-grpo", _scaled, "A_i times tau, broadcast", knobs=("tau", "norm_by_std", "eps")))

    # Everything below reads it without being edited.
    from mosaic.integrations.verl import estimator_names
    from mosaic.integrations.verl.rows import VerlParams
    from mosaic.train.batch import compute_advantages
    from mosaic.config.loader import ConfigError, describe_config, load_config
    from tests.train.trajs import compaction_chain
    import random

    c = load_config("cpu", overrides=["algo.estimator=scaled_grpo", "algo.tau=0.25"])
    assert (c.algo.estimator, c.algo.tau, c.algo.notes()[0].startswith("algo.estimator=scaled_grpo")) == \\
        ("scaled-grpo", 0.25, True)
    try:
        load_config("cpu", overrides=["algo.tau=2"])
        raise AssertionError("algo.tau=2 was accepted")
    except ConfigError as exc:
        assert str(exc) == "config key 'algo.tau': must be in [0, 1] (got 2.0)", exc
    text = describe_config(c, ["algo"])
    assert "  algo.tau = 0.25\\n      Scale of the throwaway estimator; in [0, 1] (read by scaled-grpo)." in text
    assert "``scaled-grpo``: A_i times tau, broadcast" in text
    names = estimator_names()
    assert names["scaled-grpo"] == names["scaled_grpo"] == "scaled-grpo"
    assert "tau" in VerlParams.keys() and VerlParams.from_config({"mosaic": {"tau": 0.3}}).tau == 0.3
    rng = random.Random(0)
    trajs = [compaction_chain(rng, 1, tid="a", reward=1.0), compaction_chain(rng, 0, tid="b", reward=0.0)]
    adv, _ = compute_advantages(trajs, c)
    full, _ = compute_advantages(trajs, load_config("cpu", overrides=["algo.estimator=scaled-grpo", "algo.tau=1.0"]))
    torch.testing.assert_close(adv, full * 0.25)
    assert "| `tau` | float | `0.5` | [0, 1] | `scaled-grpo` |" in E.knob_table()
    print("throwaway estimator picked up")
''')


def test_a_new_estimator_with_a_new_knob_reaches_config_help_verl_and_docs_from_one_file():
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", THROWAWAY], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "throwaway estimator picked up" in r.stdout
