"""Equality across engines: on one recorded batch, our trainer's step (``mosaic.train.rl.rl_step``, the
``mosaic/train/batch.py`` path) and the TRL path (``MosaicGRPOTrainer``, 1 and 2 processes) hand the
loss the same per-token advantages and loss weights, within 1e-6.

Tokens are matched by (the packed sequence's ids, the token's position): both engines pack sessions
that prefix a longer one into it, and the TRL path's rows may come in another order and on two ranks.
Runs our step here and TRL in its venv (shares the TRL runs of ``test_processes.py``).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

pytestmark = [pytest.mark.peer, pytest.mark.slow]


def _tokens(batches) -> dict[tuple, list[tuple[float, float]]]:
    """(ids, absolute position) of every trained token -> its (advantage, weight) values."""
    out: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for b in batches:
        if "input_ids" not in b:  # the scoring entry
            continue
        for i in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][i].sum())
            ids = tuple(b["input_ids"][i, :n].tolist())
            p = int(b["prompt_lens"][i])
            for k in torch.nonzero(b["loss_mask"][i]).flatten().tolist():
                out[(ids, p + k)].append((float(b["advantages"][i, k]), float(b["token_weights"][i, k])))
    return {k: sorted(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def ours(recorded, monkeypatch_module):
    """What our trainer's loss is given, per micro-batch, for one step on the recorded batch."""
    from _record import our_step

    return _tokens(our_step(recorded, monkeypatch_module))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("processes", [1, 2])
def test_trl_path_gives_the_loss_our_advantages_and_weights(ours, trl_run, processes):
    out = trl_run(processes)
    batches = [b for r in range(processes) for b in torch.load(out / f"batch-rank{r}.pt")]
    theirs = _tokens(batches)
    assert theirs.keys() == ours.keys()
    assert sum(len(v) for v in ours.values()) > 100
    worst = max(abs(x - y) for k in ours for a, b in zip(ours[k], theirs[k]) for x, y in zip(a, b))
    assert worst <= 1e-6
    assert sum(w for v in ours.values() for _, w in v) == pytest.approx(1.0, abs=1e-5)  # the weights' total
    assert any(abs(a) > 1e-3 for v in ours.values() for a, _ in v)  # a batch with something to learn
