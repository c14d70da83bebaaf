"""mosaic.core: pure tensor math, no I/O, no config objects; depends on nothing else in mosaic.

- ``advantages``: GRPO, session-aware Â, per-kind gain z-scores, Mosaic, broadcasting,
  turn-level (IGPO-style) shaping — docs/algorithm.md §4.
- ``estimators``: the estimators by name (``get_estimator``) over an ``AdvantageBatch``, and the knob table
  (``KNOBS``) the core functions take their defaults from: loaded here, before any of them is called.
- ``loss``: PPO clip-higher token loss, k3 KL, whole-batch token weights — docs/algorithm.md §5.
"""

from . import estimators as _estimators  # noqa: E402,F401  (declares KNOBS, the defaults of .advantages)
