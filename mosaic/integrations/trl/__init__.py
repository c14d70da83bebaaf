"""Mosaic in TRL (1.16): ``GRPOTrainer`` trains on Mosaic's multi-session rollouts (``pip install mosaic-rl[trl]``).

- :mod:`.trainer` — :class:`~.trainer.MosaicGRPOTrainer`, the ``GRPOTrainer`` subclass (imports TRL).
- :mod:`.rollouts` — rollout sources (built-in harness, recorded file) and the prompt dataset (no TRL).
- :mod:`.batch` — advantages and loss weights over the global batch of all data-parallel ranks (no TRL).

Importing this package imports neither TRL nor torch; ``from mosaic.integrations.trl import
MosaicGRPOTrainer`` imports the trainer module (and TRL) on first use.
"""

from __future__ import annotations

__all__ = ["MosaicGRPOTrainer", "rollout_reward", "HarnessRollouts", "RecordedRollouts", "task_dataset"]

_WHERE = {"MosaicGRPOTrainer": "trainer", "rollout_reward": "trainer", "HarnessRollouts": "rollouts",
          "RecordedRollouts": "rollouts", "task_dataset": "rollouts"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
