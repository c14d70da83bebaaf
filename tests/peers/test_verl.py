"""Mosaic's core math against the real verl 0.9.1, run in its own virtualenv.

The venv (``<repo>/.venv-verl``) is built on first use by ``bench/_peers.py``
(~2-3 min) and reused afterwards. If it cannot be built, these tests FAIL when
the ``CI`` environment variable is set and skip with the reason otherwise.

Convention differences found by reading verl's code (asserted below):
- singleton group: verl's ``compute_grpo_outcome_advantage`` uses mean 0 and
  std 1, so the advantage is the raw score ``r / (1 + eps)``; Mosaic gives 0
  (docs/algorithm.md §4.1 choice). Compared only on groups of size >= 2, plus one test that
  pins the difference.
- verl returns (B, L) token matrices (score * response_mask); Mosaic returns one
  value per trajectory / session. verl reads the outcome as the sum of
  token-level rewards.
- verl's v1 multi-output advantage takes the reward of each agent loop's *last*
  output and keys rows by ``{uid}_{session_id}_{index}`` strings; Mosaic takes an
  explicit per-trajectory reward and a ``session_traj`` index.
- verl's vanilla PPO loss always applies dual-clip (``clip_ratio_c = 3``) for
  negative advantages; Mosaic makes it optional (off by default) and passes
  ``clip_ratio_c=3.0`` here to compare.
- verl's ``seq-mean-token-mean`` equals Mosaic's ``session-token-mean``;
  verl has no trajectory-level mode.
- metrics: verl averages clipfrac / ppo_kl as plain token means per call; Mosaic
  weights them like the loss (identical under ``token-mean``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mosaic.core.advantages import broadcast, grpo
from mosaic.core.loss import policy_loss, token_weights

pytestmark = pytest.mark.peer

RUNNER = Path(__file__).with_name("verl_runner.py")


def _run_runner(py: Path, cases: dict[str, dict]) -> dict[str, dict]:
    flat = {f"{c}:{k}": np.asarray(v) for c, fields in cases.items() for k, v in fields.items()}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(src, **flat)
        res = subprocess.run([str(py), str(RUNNER), str(src), str(dst)], capture_output=True, text=True)
        assert res.returncode == 0, f"verl runner failed:\n{res.stderr[-4000:]}"
        out: dict[str, dict] = {}
        with np.load(dst) as data:
            for key in data.files:
                case, field = key.split(":", 1)
                out.setdefault(case, {})[field] = data[key]
    return out


# --------------------------------------------------------------------------- cases
# Deterministic builders; every case goes to verl in ONE subprocess (importing verl takes seconds).


def _random_groups(rng: np.random.Generator, n_groups: int, *, min_size: int) -> np.ndarray:
    sizes = rng.integers(min_size, 9, size=n_groups)
    ids = rng.choice(10_000, size=n_groups, replace=False)  # arbitrary id values
    g = np.repeat(ids, sizes)
    return g[rng.permutation(g.size)]  # groups interleaved


def grpo_cases() -> dict[str, dict]:
    rng = np.random.default_rng(0)
    cases = {}
    for i in range(12):
        g = _random_groups(rng, int(rng.integers(1, 20)), min_size=2)
        binary = i % 2 == 0
        r = (rng.integers(0, 2, g.size) if binary else rng.random(g.size)).astype(np.float32)
        if i == 4:  # a constant-reward group
            r[g == g[0]] = 1.0
        width = 7
        cases[f"grpo{i}"] = dict(op="grpo", rewards=r, index=g, lengths=rng.integers(1, width + 1, g.size),
                                 width=width, eps=1e-6, norm_by_std=i % 3 != 2)  # fmt: skip
    cases["singleton"] = dict(op="grpo", rewards=np.array([0.7, 1.0, 0.0], dtype=np.float32),
                              index=np.array([5, 9, 9]), lengths=np.array([2, 2, 2]), width=2, eps=1e-6,
                              norm_by_std=True)  # fmt: skip
    return cases


def multi_cases() -> dict[str, dict]:
    """verl's multi-output rows plus, under ``ours:``, our per-trajectory view of the same batch."""
    rng = np.random.default_rng(1)
    cases = {}
    for i in range(6):
        g = _random_groups(rng, int(rng.integers(1, 10)), min_size=2)  # (T,) group of each trajectory
        t = g.size
        r = (rng.integers(0, 2, t) if i % 2 else rng.random(t)).astype(np.float32)
        n_sess = rng.integers(1, 6, t)
        session_traj = np.repeat(np.arange(t), n_sess)  # (S,)
        position = np.concatenate([np.arange(n) for n in n_sess])  # session order inside its trajectory
        perm = rng.permutation(session_traj.size)  # rows in any order
        session_traj, position = session_traj[perm], position[perm]
        # verl reads the reward of each trajectory's last output; others carry noise it must ignore.
        is_last = position == n_sess[session_traj] - 1
        row_reward = np.where(is_last, r[session_traj], rng.random(session_traj.size)).astype(np.float32)
        width = 5
        cases[f"multi{i}"] = dict(op="multi_traj", rewards=row_reward, group=g[session_traj], traj=session_traj,
                                  position=position, lengths=rng.integers(1, width + 1, session_traj.size),
                                  width=width, norm_by_std=i != 3, ours_rewards=r, ours_groups=g)  # fmt: skip
    return cases


LOSS_MODES = {"token-mean": "token-mean", "session-token-mean": "seq-mean-token-mean"}


def loss_cases() -> dict[str, dict]:
    rng = np.random.default_rng(2)
    b, l = 6, 9
    mask = rng.random((b, l)) < 0.7
    mask[:, 0] = True
    mask[3] = False  # a row without trainable tokens
    old = rng.normal(-1.5, 0.5, (b, l)).astype(np.float32)
    new = (old + rng.normal(0, 0.4, (b, l))).astype(np.float32)  # ratios well outside [0.8, 1.28]
    ref = (old + rng.normal(0, 0.2, (b, l))).astype(np.float32)
    adv_row = rng.normal(0, 1, b).astype(np.float32)
    return {
        f"loss-{ours}": dict(op="policy_loss", log_prob=new, old_log_prob=old, ref_log_prob=ref, mask=mask,
                             advantages=np.repeat(adv_row[:, None], l, axis=1), adv_row=adv_row, mode=theirs,
                             clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, kl_coef=0.05)  # fmt: skip
        for ours, theirs in LOSS_MODES.items()
    }


@pytest.fixture(scope="session")
def verl_out(peers):
    """verl's outputs for every case above, from one run of verl_runner.py in the verl venv."""
    try:
        py = peers.ensure_verl_venv()
    except Exception as exc:  # noqa: BLE001 - any build failure is reported the same way
        msg = f"verl peer venv unavailable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    cases = {**grpo_cases(), **multi_cases(), **loss_cases()}
    return _run_runner(py, {name: {k: v for k, v in c.items() if not k.startswith("ours")}
                            for name, c in cases.items()})  # fmt: skip


# --------------------------------------------------------------------------- tests


def test_grpo_matches_verl_on_groups_of_two_or_more(verl_out):
    for name, case in grpo_cases().items():
        if name == "singleton":
            continue
        ours = grpo(torch.from_numpy(case["rewards"]), torch.from_numpy(case["index"]), norm_by_std=case["norm_by_std"],
                    eps=case["eps"]).numpy()  # fmt: skip
        mask = np.arange(case["width"])[None, :] < case["lengths"][:, None]
        ref = verl_out[name]["advantages"]  # (B, L)
        np.testing.assert_allclose(ours[:, None] * mask, ref, rtol=1e-5, atol=1e-5, err_msg=name)
        assert np.abs(ours).max() > 0.1 or name == "grpo4"  # not a vacuous comparison


def test_singleton_group_convention_differs_from_verl(verl_out):
    """docs/algorithm.md §4.1 choice: a singleton gets 0; verl returns the raw score (mean 0, std 1)."""
    case = grpo_cases()["singleton"]
    ref = verl_out["singleton"]["scalar"]
    ours = grpo(torch.from_numpy(case["rewards"]), torch.from_numpy(case["index"])).numpy()
    np.testing.assert_allclose(ref[0], 0.7 / (1 + 1e-6), rtol=1e-6)
    assert ours[0] == 0.0
    np.testing.assert_allclose(ours[1:], ref[1:], rtol=1e-5)


def test_broadcast_matches_verl_multi_trajectory_advantage(verl_out):
    for name, case in multi_cases().items():
        a = grpo(torch.from_numpy(case["ours_rewards"]), torch.from_numpy(case["ours_groups"]),
                 norm_by_std=case["norm_by_std"])  # fmt: skip
        ours = broadcast(a, torch.from_numpy(case["traj"])).numpy()  # (S,)
        mask = np.arange(case["width"])[None, :] < case["lengths"][:, None]
        np.testing.assert_allclose(ours[:, None] * mask, verl_out[name]["advantages"], rtol=1e-5, atol=1e-5,
                                   err_msg=name)  # fmt: skip


@pytest.mark.parametrize("ours_mode", list(LOSS_MODES))
def test_policy_loss_matches_verl(verl_out, ours_mode):
    c = loss_cases()[f"loss-{ours_mode}"]
    out = verl_out[f"loss-{ours_mode}"]
    logp = torch.from_numpy(c["log_prob"]).requires_grad_(True)
    m = torch.from_numpy(c["mask"])
    w = token_weights(m.sum(-1), torch.arange(m.shape[0]), mode=ours_mode)
    res = policy_loss(logp, torch.from_numpy(c["old_log_prob"]), torch.from_numpy(c["adv_row"]), m, w,
                      clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, ref_logprobs=torch.from_numpy(c["ref_log_prob"]),
                      kl_coef=c["kl_coef"])  # fmt: skip
    res.loss.backward()
    np.testing.assert_allclose(res.pg_loss.item(), out["pg_loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.kl_loss.item(), out["kl_loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logp.grad.numpy(), out["grad"], rtol=1e-4, atol=1e-6)
    assert 0.0 < float(out["clipfrac"]) < 1.0  # clipping really happened on some tokens
    if ours_mode == "token-mean":  # metrics are token means only in this mode
        np.testing.assert_allclose(res.metrics["actor/pg_clipfrac"], out["clipfrac"], rtol=1e-5)
        np.testing.assert_allclose(res.metrics["actor/ppo_kl"], out["ppo_kl"], rtol=1e-4, atol=1e-6)
