"""CAPO through TRL (``algo.capo=true`` in ``MosaicGRPOTrainer``): TRL's one backward over the loss it is
given moves the parameters along CAPO's routed gradient (docs/algorithm.md §5.1), with TRL's own loss
scaling, gradient accumulation and DDP all-reduce.

Both runs (plain and CAPO) train the shipped base model one step with plain SGD on the same recorded
batch, so each parameter moves by ``-lr * c * gradient`` with one scale ``c`` for both. Here the test
recomputes, from the row batches TRL's loss was given, the plain gradient and the routed one (our
``capo`` functions on the base model), takes ``c`` from the plain run and checks the CAPO run's step
against the routed gradient; the routed and plain gradients must differ where units are routed, so a
CAPO run that silently trained the plain loss fails. Shares the TRL runs of ``test_processes.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.peer, pytest.mark.slow]

LR = 0.05  # runner.py's


def _gradients(batches: list[dict], routed: bool) -> dict[str, torch.Tensor]:
    """Sum over the captured micro-batches (every rank's) of the plain or the routed gradient, by name."""
    from _record import OVERRIDES

    from mosaic.config.loader import load_config
    from mosaic.core.loss import policy_loss
    from mosaic.train import capo, setup
    from mosaic.train.batching import RowBatch, completion_logprobs

    cfg = load_config("cpu", overrides=OVERRIDES + ["algo.capo=true"])
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    model.train()
    names = {id(p): n for n, p in model.named_parameters()}
    piece, a = capo.piece_fn(tok), cfg.algo
    total: dict[str, torch.Tensor] = {}
    for b in batches:
        rb = RowBatch(**{k: b[k] for k in b if k != "token_weights"})
        act, meter = capo.meter_for(model, rb, piece)
        with meter:
            lp, _ = completion_logprobs(model, rb, temperature=cfg.rollout.temperature)
        kw = dict(clip_low=a.clip_low, clip_high=a.clip_high, clip_ratio_c=a.clip_ratio_c)
        w = b["token_weights"]
        la = policy_loss(lp, rb.old_logprobs, rb.advantages, rb.loss_mask, w * act, **kw).loss
        lb = policy_loss(lp, rb.old_logprobs, rb.advantages, rb.loss_mask, w * ~act, **kw).loss
        pairs, _ = capo.routed_grads(model, la, lb, meter.partitions() if routed else None)
        for p, g in pairs:
            total[names[id(p)]] = total.get(names[id(p)], 0) + g
    return total


def _flat(d: dict[str, torch.Tensor], keys) -> torch.Tensor:
    return torch.cat([d[k].flatten().double() for k in keys])


@pytest.mark.parametrize("processes", [1, 2])
def test_trl_capo_step_follows_the_routed_gradient(trl_run, base_params, processes):
    plain, routed = trl_run(processes), trl_run(processes, capo=True)
    batches = [b for r in range(processes) for b in torch.load(routed / f"batch-rank{r}.pt")]
    g_plain, g_routed = _gradients(batches, routed=False), _gradients(batches, routed=True)
    keys = sorted(g_plain)
    step_plain = _flat({k: torch.load(plain / "params.pt")[k] - base_params[k] for k in keys}, keys)
    step_capo = _flat({k: torch.load(routed / "params.pt")[k] - base_params[k] for k in keys}, keys)
    gp, gr = _flat(g_plain, keys), _flat(g_routed, keys)
    c = float(step_plain @ gp) / (-LR * float(gp @ gp))  # the engine's scale (loss scaling, accumulation)
    assert c > 0
    assert (step_plain + LR * c * gp).norm() <= 1e-3 * step_plain.norm()  # the scale explains the plain run
    assert (gr - gp).norm() > 0.05 * gp.norm(), "routing changed nothing: the test could not tell"
    assert (step_capo + LR * c * gr).norm() <= 1e-3 * step_capo.norm()
    assert (step_capo - step_plain).norm() > 0.05 * step_plain.norm()


def test_trl_capo_logs_its_shares(trl_run):
    import json

    logged = json.loads((trl_run(1, capo=True) / "metrics-rank0.json").read_text())
    row = next(m for m in logged if "capo/action_unit_share" in m)
    assert 0.0 < row["capo/action_unit_share"] < 1.0
    assert 0.0 < row["capo/action_token_share"] < 0.5
