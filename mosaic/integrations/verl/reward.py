"""verl's ``custom_reward_function`` for the deep-search rows: :func:`mosaic.envs.rewards.score_answer`.

Point verl at this file: ``reward.custom_reward_function.path=<this file>``
``reward.custom_reward_function.name=compute_score`` (the recipe in ``examples/verl/`` finds the
path with ``python -c "import mosaic.integrations.verl.reward as m; print(m.__file__)"``). No verl import: the function only scores text.

The ``mosaic_agent`` loop already sets each trajectory's ``reward_score`` (the harness scores the
answer with the same function), so verl calls this only for rows produced by other agent loops
(its ``single_turn_agent`` or ``tool_agent`` on the exported Parquet) — the same reward either way.
"""

from __future__ import annotations

from typing import Any

from mosaic.envs.export import DATA_SOURCE
from mosaic.envs.rewards import score_answer
from mosaic.envs.service.export import DATA_SOURCE as SERVICE_SOURCE

__all__ = ["compute_score"]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None,
                  metric: str = "em", **_: Any) -> dict[str, Any]:  # fmt: skip
    """``{"score": reward in [0, 1], "acc": same, "answered": 0/1}`` for one response text.

    ``metric``: ``em`` (exact match after normalisation) or ``f1``; pass it through verl's
    ``reward.custom_reward_function.reward_kwargs.metric``. Raises ValueError for rows of another
    data source (a misrouted reward is an error, not a 0).
    """
    if data_source == SERVICE_SOURCE:
        raise ValueError("mosaic compute_score got a service-family row: its reward needs the account backend's final "
                         "state, which only the mosaic_agent loop has (set the rows' agent_name to mosaic_agent)")
    if data_source != DATA_SOURCE:
        raise ValueError(f"mosaic compute_score got a row of data_source {data_source!r}, expected {DATA_SOURCE!r}")
    s = score_answer(solution_str, ground_truth, metric=metric)  # type: ignore[arg-type]
    return {"score": float(s.reward), "acc": float(s.reward), "answered": float(s.answer is not None)}
