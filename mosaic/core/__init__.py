"""mosaic.core: pure tensor math, no I/O, no config objects; depends on nothing else in mosaic.

- ``advantages``: GRPO, session-aware Â, per-kind gain z-scores, Mosaic, broadcasting,
  turn-level (IGPO-style) shaping — docs/algorithm.md §4.
- ``estimators``: the estimators by name (``get_estimator``) over an ``AdvantageBatch``.
- ``loss``: PPO clip-higher token loss, k3 KL, whole-batch token weights — docs/algorithm.md §5.
"""
