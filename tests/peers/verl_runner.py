"""Run verl's reference functions on arrays from an .npz; runs inside the verl venv.

Usage: ``python verl_runner.py IN.npz OUT.npz``. ``IN`` holds cases as keys
``"<case>:<field>"``, each with a ``"<case>:op"`` string; ``OUT`` gets
``"<case>:<output>"``. Many cases per call, because importing verl takes seconds.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")


def _token_rewards(rewards: np.ndarray, lengths: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) token-level rewards (the score on the last response token, as verl's
    reward managers do) and the (B, L) response mask."""
    b = rewards.shape[0]
    mask = torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]  # (B, L)
    tlr = torch.zeros(b, width, dtype=torch.float32)
    tlr[torch.arange(b), torch.as_tensor(lengths) - 1] = torch.as_tensor(rewards, dtype=torch.float32)
    return tlr, mask.to(torch.float32)


def op_grpo(c: dict) -> dict:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    tlr, mask = _token_rewards(c["rewards"], c["lengths"], int(c["width"]))
    adv, ret = compute_grpo_outcome_advantage(
        token_level_rewards=tlr,
        response_mask=mask,
        index=c["index"],
        epsilon=float(c["eps"]),
        norm_adv_by_std_in_grpo=bool(c["norm_by_std"]),
    )
    return {"advantages": adv.numpy(), "scalar": adv[:, 0].numpy()}


def op_multi_traj(c: dict) -> dict:
    """verl v1 multi-output advantage: rows keyed ``{uid}_{session_id}_{index}``;
    GRPO over each agent loop's last output, broadcast to its other outputs."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    tlr, mask = _token_rewards(c["rewards"], c["lengths"], int(c["width"]))
    uid = np.array([f"g{int(g)}" for g in c["group"]], dtype=object)
    keys = [f"g{int(g)}_{int(t)}_{int(k)}" for g, t, k in zip(c["group"], c["traj"], c["position"], strict=True)]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid}
    )
    out = compute_advantage_for_multi_trajectories(
        data, keys, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=bool(c["norm_by_std"])
    )
    adv = out.batch["advantages"]
    return {"advantages": adv.numpy(), "scalar": adv[:, 0].numpy()}


def op_policy_loss(c: dict) -> dict:
    from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss, kl_penalty

    logp = torch.as_tensor(c["log_prob"]).clone().requires_grad_(True)
    old = torch.as_tensor(c["old_log_prob"])
    mask = torch.as_tensor(c["mask"]).to(torch.float32)
    adv = torch.as_tensor(c["advantages"])
    mode = str(c["mode"])
    pg_loss, clipfrac, ppo_kl, _ = compute_policy_loss(
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        response_mask=mask,
        cliprange_low=float(c["clip_low"]),
        cliprange_high=float(c["clip_high"]),
        clip_ratio_c=float(c["clip_ratio_c"]),
        loss_agg_mode=mode,
    )
    ref = torch.as_tensor(c["ref_log_prob"])
    kl_mat = kl_penalty(logp, ref, "low_var_kl")
    kl_loss = agg_loss(loss_mat=kl_mat, loss_mask=mask, loss_agg_mode=mode)
    total = pg_loss + float(c["kl_coef"]) * kl_loss
    (grad,) = torch.autograd.grad(total, logp)
    return {
        "pg_loss": pg_loss.detach().numpy(),
        "clipfrac": clipfrac.detach().numpy(),
        "ppo_kl": ppo_kl.detach().numpy(),
        "kl_loss": kl_loss.detach().numpy(),
        "kl_mat": kl_mat.detach().numpy(),
        "grad": grad.numpy(),
    }


OPS = {"grpo": op_grpo, "multi_traj": op_multi_traj, "policy_loss": op_policy_loss}


def main(src: str, dst: str) -> None:
    data = np.load(src, allow_pickle=False)
    cases: dict[str, dict] = {}
    for key in data.files:
        case, field = key.split(":", 1)
        cases.setdefault(case, {})[field] = data[key]
    out = {}
    for case, fields in cases.items():
        for name, value in OPS[str(fields["op"])](fields).items():
            out[f"{case}:{name}"] = value
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
