"""Random multi-session batches, in both layouts: ours (trajectory + session arrays) and verl's rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mosaic.core.estimators import AdvantageBatch
from mosaic.trace.graph import KIND_CODES


@dataclass
class Case:
    batch: AdvantageBatch  # ours: T trajectories, S sessions (session axis = verl row axis)
    uid: np.ndarray  # (S,) verl group ids (strings)
    columns: dict[str, np.ndarray]  # (S,) each: the Mosaic non_tensor_batch columns
    token_level_rewards: torch.Tensor  # (S, L)
    response_mask: torch.Tensor  # (S, L)
    keys: list[str]  # verl v1 keys "{uid}_{session_id}_{index}"


def random_case(seed: int, *, n_groups: int = 4, width: int = 6, gains: bool = True) -> Case:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 6, n_groups)
    group_of_traj = np.repeat(np.arange(n_groups), sizes)  # (T,)
    t = group_of_traj.size
    rewards = rng.integers(0, 2, t).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rewards[starts], rewards[starts + 1] = 1.0, 0.0  # every group mixed: GRPO is never all zero
    n_sess = rng.integers(1, 5, t)  # (T,)
    session_traj = np.repeat(np.arange(t), n_sess)  # (S,)
    position = np.concatenate([np.arange(n) for n in n_sess])
    is_final = position == n_sess[session_traj] - 1
    kinds_txt = np.where(is_final, "main", rng.choice(["main", "compaction", "subagent"], session_traj.size))
    g = rng.normal(0, 1, session_traj.size).astype(np.float32)
    d = rng.normal(0, 1, session_traj.size).astype(np.float32)  # downstream credit (mosaic-dag)
    perm = rng.permutation(session_traj.size)  # rows in any order
    session_traj, position, is_final, kinds_txt, g, d = (x[perm] for x in (session_traj, position, is_final, kinds_txt, g, d))
    s = session_traj.size
    lengths = rng.integers(1, width + 1, s)
    mask = torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]
    tlr = torch.zeros(s, width)
    # every row carries its trajectory's reward on its last token (verl v1 copies the final reward)
    tlr[torch.arange(s), torch.as_tensor(lengths) - 1] = torch.as_tensor(rewards[session_traj])
    uid = np.array([f"prompt-{group_of_traj[i]}" for i in session_traj], dtype=object)
    traj_name = np.array([f"prompt-{group_of_traj[i]}_{i}" for i in session_traj], dtype=object)
    batch = AdvantageBatch(
        rewards=torch.from_numpy(rewards), group_ids=torch.from_numpy(group_of_traj),
        session_counts=torch.from_numpy(n_sess), success=torch.from_numpy(rewards >= 1.0),
        session_traj=torch.from_numpy(session_traj),
        kinds=torch.tensor([KIND_CODES[k] for k in kinds_txt]), is_final=torch.from_numpy(is_final),
        gains=torch.from_numpy(np.where(is_final, 0.0, g).astype(np.float32)) if gains else None,
        downstream=torch.from_numpy(np.where(is_final, 0.0, d).astype(np.float32)) if gains else None,
    )  # fmt: skip
    columns = {
        "mosaic_traj": traj_name, "mosaic_kind": kinds_txt.astype(object), "mosaic_final": is_final,
        "mosaic_sessions": n_sess[session_traj],
        "mosaic_gain": (g if gains else np.full(s, np.nan)).astype(np.float64),
        "mosaic_downstream": (d if gains else np.full(s, np.nan)).astype(np.float64),
    }  # fmt: skip
    keys = [f"{traj_name[i]}_{position[i]}" for i in range(s)]
    return Case(batch, uid, columns, tlr, mask.to(torch.float32), keys)
