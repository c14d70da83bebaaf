"""The Mosaic estimators in verl's registry, and the one hook that feeds them per-row fields.

verl calls a registered estimator as ``fn(token_level_rewards, response_mask, config=, index=uid)``
and forwards ``non_tensor_batch`` only to ``gdpo`` (``ray_trainer.compute_advantage``, verl 0.9.1).
Mosaic needs per-row columns (:data:`.rows.COLUMNS`), so :func:`install_row_hook` wraps that
dispatcher — for our estimator names only, every other name goes to verl untouched — and passes
the batch's ``non_tensor_batch``. In verl's v1 trainer the advantage step fetches a fixed list of
fields from TransferQueue; the hook there also fetches the sessions' ``extra_fields`` by key.
The registered functions accept ``non_tensor_batch=`` (verl's gdpo convention) and fail loud
without it rather than silently computing GRPO.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

import numpy as np
import torch

from mosaic.core.estimators import alias_note
from mosaic.integrations.verl import estimator_names
from mosaic.integrations.verl.rows import COLUMNS, OPTIONAL_COLUMNS, VerlParams, row_advantages

__all__ = ["register_estimators", "install_row_hook", "estimator_fn", "LAST_METRICS"]

_NOTED: set[str] = set()
LAST_METRICS: dict[str, float] = {}
"""Metrics of the last estimator call in this process (``critic/advantages/*``, ``session/*``);
the v1 hook also merges them into the step's metrics dict."""


def _row_rewards(token_level_rewards: torch.Tensor) -> np.ndarray:
    return token_level_rewards.sum(-1).detach().to(torch.float64).cpu().numpy()


def estimator_fn(verl_name: str):
    """verl-signature estimator ``fn(token_level_rewards (B, L), response_mask (B, L), index=None,
    config=None, non_tensor_batch=None, norm_adv_by_std_in_grpo=True) -> (advantages, returns)``, both
    (B, L): the row's advantage on its response tokens (0 elsewhere)."""

    def fn(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config=None,
           non_tensor_batch: dict | None = None, norm_adv_by_std_in_grpo: bool | None = None, **_: Any):  # fmt: skip
        if non_tensor_batch is None:
            raise ValueError(
                f"advantage estimator {verl_name!r} needs the per-row Mosaic columns {list(COLUMNS)}; verl only "
                "forwards them through mosaic.integrations.verl.advantages.install_row_hook (loaded by the "
                "'mosaic' verl plugin entry point)"
            )
        uid = non_tensor_batch["uid"] if "uid" in non_tensor_batch else index
        if uid is None:
            raise ValueError(f"advantage estimator {verl_name!r} needs the group ids (non_tensor_batch['uid'])")
        params = VerlParams.from_config(config)
        if verl_name not in _NOTED and alias_note(verl_name):  # another spelling: said once per process
            _NOTED.add(verl_name)
            print(f"mosaic (verl): algorithm.adv_estimator={alias_note(verl_name)}", file=sys.stderr)
        if norm_adv_by_std_in_grpo is None:
            norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo", True)) if config is not None else True
        mask = response_mask.to(torch.float32)
        adv, metrics = row_advantages(verl_name, _row_rewards(token_level_rewards), list(uid),
                                      {c: list(non_tensor_batch[c]) for c in COLUMNS + OPTIONAL_COLUMNS
                                       if c in non_tensor_batch},
                                      mask.sum(-1), params, norm_by_std=norm_adv_by_std_in_grpo)  # fmt: skip
        LAST_METRICS.clear()
        LAST_METRICS.update(metrics)
        scores = adv.to(mask.device).unsqueeze(-1) * mask  # (B, L)
        return scores, scores

    fn.__name__ = f"compute_{verl_name}_advantage"
    fn.__qualname__ = fn.__name__
    return fn


_FNS: dict[str, Any] = {}


def _fn(name: str):
    if name not in _FNS:
        _FNS[name] = estimator_fn(name)
    return _FNS[name]


def register_estimators() -> list[str]:
    """Register every name of :func:`~mosaic.integrations.verl.estimator_names` (the registry's estimators
    and their other spellings) with ``verl.trainer.ppo.core_algos`` (idempotent); returns the names."""
    from verl.trainer.ppo import core_algos

    names = list(estimator_names())
    for name in names:
        core_algos.register_adv_est(name)(_fn(name))
    return names


def _name(adv_estimator: Any) -> str:
    return str(getattr(adv_estimator, "value", adv_estimator))


def _ours(sig: inspect.Signature, args, kwargs) -> dict[str, Any] | None:
    """A dispatcher call's arguments (defaults applied) when its estimator is a Mosaic one, else None."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments if _name(bound.arguments["adv_estimator"]) in estimator_names() else None


def _wrap_compute_advantage(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def compute_advantage(*args, **kwargs):
        if (a := _ours(sig, args, kwargs)) is None:
            return orig(*args, **kwargs)
        name = _name(a["adv_estimator"])
        data = a["data"]
        if "response_mask" not in data.batch.keys():
            from verl.trainer.ppo.ray_trainer import compute_response_mask

            data.batch["response_mask"] = compute_response_mask(data)
        adv, _ = _fn(name)(data.batch["token_level_rewards"], data.batch["response_mask"], config=a["config"],
                            non_tensor_batch=data.non_tensor_batch,
                            norm_adv_by_std_in_grpo=a["norm_adv_by_std_in_grpo"])  # fmt: skip
        data.batch["advantages"] = adv
        data.batch["returns"] = adv
        return data

    compute_advantage._mosaic_hook = True
    return compute_advantage


def _fetch_extra_fields(keys: list[str], partition_id: str) -> list[dict]:
    """Each key's ``extra_fields`` from TransferQueue (verl's v1 trainer stores every output's there)."""
    import transfer_queue as tq

    got = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
    rows = got["extra_fields"]
    rows = rows.tolist() if hasattr(rows, "tolist") else list(rows)
    if len(rows) != len(keys) or not all(isinstance(r, dict) for r in rows):
        raise RuntimeError("TransferQueue returned no per-row extra_fields dicts for the Mosaic estimators")
    return rows


def real_rows(keys: list[str], traj_ids) -> np.ndarray:
    """(N,) bool: which rows are the agent loop's own. verl keys a row ``{uid}_{session_id}_{index}`` and
    the ``mosaic_agent`` loop names its trajectory ``{uid}_{session_id}``; a synthetic padding row copies
    another row's fields under a key of its own (``pad<hex>_<i>_0``), so its key and trajectory disagree."""
    return np.array([str(k).rsplit("_", 1)[0] == str(t) for k, t in zip(keys, traj_ids, strict=True)], dtype=bool)


def _wrap_multi_traj(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def compute_advantage_for_multi_trajectories(*args, **kwargs):
        if (a := _ours(sig, args, kwargs)) is None:
            return orig(*args, **kwargs)
        data, keys = a["data"], list(a["batch_keys"])
        missing = [c for c in COLUMNS if c not in data.non_tensor_batch]
        if missing:
            extra = _fetch_extra_fields(keys, "train")
            for c in COLUMNS:
                data.non_tensor_batch[c] = np.array([e.get(c) for e in extra], dtype=object)
            for c in OPTIONAL_COLUMNS:
                if extra and all(c in e for e in extra):
                    data.non_tensor_batch[c] = np.array([e[c] for e in extra], dtype=object)
        # verl's own trajectory key is "{uid}_{session_id}"; ours must agree with it
        run = functools.partial(_wrap_compute_advantage(_base_compute_advantage()), adv_estimator=a["adv_estimator"],
                                norm_adv_by_std_in_grpo=a["norm_adv_by_std_in_grpo"], config=a["config"])  # fmt: skip
        real = real_rows(keys, data.non_tensor_batch["mosaic_traj"])
        if real.all():
            return run(data)
        # verl pads the batch to a multiple of its mini-batch size with copies of the first row
        # (`upsample_batch_to_divisible_size`): those rows train nothing (response mask 0) and must not
        # count as a second final session of that trajectory. The estimator sees the real rows only.
        out = run(data.select_idxs(real))
        LAST_METRICS["mosaic/verl_padding_rows"] = float(len(real) - real.sum())
        for field in ("advantages", "returns"):
            full = torch.zeros_like(data.batch["response_mask"], dtype=out.batch[field].dtype)
            full[torch.from_numpy(real)] = out.batch[field]
            data.batch[field] = full
        return data

    compute_advantage_for_multi_trajectories._mosaic_hook = True
    return compute_advantage_for_multi_trajectories


_WARNED: set[str] = set()


def minibatches(rows: int, config) -> int:
    """How many optimizer steps verl's actor takes on a step of ``rows`` rows (sessions, padding included):
    its mini-batch is ``ppo_mini_batch_size x rollout.n`` rows. The trajectory-token-mean scaling is exact
    when this is 1; with several, verl normalises each mini-batch by its own tokens, so each optimizer
    step weighs its tokens by ``N / N_minibatch`` (docs/verl.md). Warned once per process when > 1."""
    per = int(config.actor_rollout_ref.actor.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n)
    k = max(1, -(-int(rows) // max(1, per)))
    if k > 1 and "minibatches" not in _WARNED:
        _WARNED.add("minibatches")
        logging.getLogger(__name__).warning(
            "Mosaic on verl: a step of %d session rows is %d mini-batches of %d rows, so verl takes %d optimizer "
            "steps and normalises each by its own tokens; for one update per step (the trajectory-token-mean "
            "weights of mosaic train) set actor_rollout_ref.actor.ppo_mini_batch_size >= rows / rollout.n with "
            "actor_rollout_ref.actor.use_dynamic_bsz=True (docs/verl.md)", rows, k, per, k)
    return k


def _wrap_trainer_metrics(cls):
    """``PPOTrainer._compute_advantage(batch, metrics)`` also logs the last Mosaic estimator metrics
    (``session/pos_gain_share/*``, ``critic/advantages/*``) into the step's ``metrics``."""
    orig = cls._compute_advantage

    @functools.wraps(orig)
    def _compute_advantage(self, batch, metrics):
        LAST_METRICS.clear()
        out = orig(self, batch, metrics=metrics)
        metrics.update(LAST_METRICS)
        if _name(self.config.algorithm.adv_estimator) in estimator_names():
            metrics["mosaic/verl_minibatches"] = float(minibatches(len(batch), self.config))
        return out

    cls._compute_advantage = _compute_advantage
    cls._mosaic_hook = True
    return cls


def _base_compute_advantage():
    from verl.trainer.ppo import ray_trainer

    f = ray_trainer.compute_advantage
    return getattr(f, "__wrapped__", f)


def install_row_hook() -> list[str]:
    """Wrap verl's advantage dispatchers so the Mosaic estimators get ``non_tensor_batch``; idempotent.

    Returns the patched ``module.function`` names (modules that are not importable are skipped).
    """
    import importlib

    patched = []
    targets = [("verl.trainer.ppo.ray_trainer", "compute_advantage", _wrap_compute_advantage),
               ("verl.trainer.ppo.v1.utils", "compute_advantage", _wrap_compute_advantage),
               ("verl.trainer.ppo.v1.utils", "compute_advantage_for_multi_trajectories", _wrap_multi_traj),
               ("verl.trainer.ppo.v1.trainer_base", "compute_advantage_for_multi_trajectories", _wrap_multi_traj)]
    targets.append(("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", _wrap_trainer_metrics))
    for mod_name, attr, wrap in targets:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # e.g. the v1 trainer without transfer_queue: nothing there to hook
            continue
        f = getattr(mod, attr, None)
        if f is None:
            continue
        if not getattr(f, "_mosaic_hook", False):
            setattr(mod, attr, wrap(f))  # a class is patched in place and set back as itself
        patched.append(f"{mod_name}.{attr}")
    return patched
