"""The estimator knob table (mosaic.core.estimators.KNOBS): declared once, read by the core functions,
the estimators and their names' other spellings."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import re

import pytest
import torch

from mosaic.core import advantages as adv
from mosaic.core.estimators import (ESTIMATORS, KNOBS, Estimator, EstimatorParams, Knob, add_knob, alias_note,
                                    aliases, get_estimator, knob_table, register, resolve_name)  # fmt: skip


def test_every_knob_is_declared_once_with_a_valid_default_and_read_by_an_estimator():
    for k in KNOBS.values():
        assert type(k.default) is k.type and k.check(k.default) is None and k.doc
        assert any(k.name in e.knobs for e in ESTIMATORS.values()), k.name
    for e in ESTIMATORS.values():
        assert set(e.knobs) <= set(KNOBS), e.name
    assert EstimatorParams().as_dict() == {k.name: k.default for k in KNOBS.values()}


def test_no_core_function_redeclares_a_knob_default():
    for name in adv.__all__:
        sig = inspect.signature(getattr(adv, name))  # follows the wrapper to the declared signature
        for p in sig.parameters.values():
            if p.name in KNOBS:
                assert p.kind is p.KEYWORD_ONLY and p.default is p.empty, f"{name}({p.name}=...)"


def test_core_defaults_come_from_the_table(monkeypatch):
    r, g = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long)
    n, ok = torch.tensor([3, 5, 1, 1]), r == 1
    explicit = adv.session_aware(r, g, n, ok, rho=0.5, delta=0.1, norm_by_std=True, eps=1e-6)
    assert not torch.allclose(adv.session_aware(r, g, n, ok), explicit)
    monkeypatch.setitem(KNOBS, "rho", dataclasses.replace(KNOBS["rho"], default=0.5))
    torch.testing.assert_close(adv.session_aware(r, g, n, ok), explicit)  # the default moved with the table


@pytest.mark.parametrize("name, value, why", [
    ("rho", 1.0, "must be in [0, 1) so the multiplier stays positive"), ("rho", -0.1, "must be in [0, 1)"),
    ("delta", -1.0, "must be >= 0"), ("eps", 0.0, "must be > 0"), ("gamma", 1.5, "must be in [0, 1]"),
])  # fmt: skip
def test_knob_ranges_say_why(name, value, why):
    assert KNOBS[name].check(value).startswith(why)
    with pytest.raises(ValueError, match=re.escape(f"estimator knob '{name}': {why}")):
        EstimatorParams(**{name: value})


def test_params_are_immutable_and_refuse_unknown_knobs():
    p = EstimatorParams(rho=0.3)
    assert (p.rho, p.lam) == (0.3, KNOBS["lam"].default) and p.replace(lam=0.5).lam == 0.5 and p.lam != 0.5
    assert p == EstimatorParams(rho=0.3) and hash(p) == hash(EstimatorParams(rho=0.3)) and p != EstimatorParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.rho = 0.1
    assert copy.deepcopy(p) == p and pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(TypeError, match="unknown estimator knobs \\['rhoo'\\]"):
        EstimatorParams(rhoo=0.1)
    with pytest.raises(AttributeError, match="no estimator knob 'rhoo'"):
        _ = p.rhoo


def test_a_knob_is_declared_once():
    assert add_knob(KNOBS["rho"]) is KNOBS["rho"]  # the same declaration again: fine
    with pytest.raises(ValueError, match="already declared differently"):
        add_knob(dataclasses.replace(KNOBS["rho"], default=0.3))
    with pytest.raises(ValueError, match="not a valid float"):
        add_knob(Knob("zeta", float, 2.0, "bad default", "[0, 1]"))
    assert "zeta" not in KNOBS


def test_one_spelling_per_estimator_and_the_others_are_aliases():
    for name, e in ESTIMATORS.items():
        assert "_" not in name  # the one spelling: hyphens
        for other in e.spellings():
            assert resolve_name(other) == name and get_estimator(other) is e
            assert alias_note(other) == f"{other} is another spelling of {name}; write {name}"
    assert aliases()["mosaic_traj"] == "mosaic-traj" and aliases()["mosaic_broadcast"] == "broadcast"
    assert alias_note("mosaic-traj") is None
    with pytest.raises(ValueError, match="unknown advantage estimator 'mosaic-trajj'"):
        resolve_name("mosaic-trajj")


def test_register_refuses_taken_names_and_undeclared_knobs():
    fn = ESTIMATORS["broadcast"].fn
    with pytest.raises(ValueError, match="'mosaic_traj' is already taken"):
        register(Estimator("mosaic_traj", fn, "clash with a spelling"))
    with pytest.raises(ValueError, match="undeclared knobs \\['tau'\\]"):
        register(Estimator("new-one", fn, "reads an undeclared knob", knobs=("tau",)))
    assert "new-one" not in ESTIMATORS and "mosaic_traj" not in ESTIMATORS


def test_knob_table_lists_every_knob_and_its_readers():
    table = knob_table().splitlines()
    assert len(table) == 2 + len(KNOBS)
    assert "| `rho` | float | `0.2` | [0, 1) | `mosaic-traj`, `mosaic`, `mosaic-dag` |" in table[2]
