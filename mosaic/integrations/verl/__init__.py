"""Mosaic as a verl (0.9.x) plugin: estimators, trajectory-token-mean, the multi-session agent loop.

verl is imported lazily: this package and :mod:`.rows` import nothing of verl; the modules
that subclass or call verl (:mod:`.advantages`, :mod:`.agent_loop`, :mod:`.plugin`) do, and
are only imported where verl is installed (``pip install mosaic-rl[verl]``).

How it plugs in (every point is one verl offers, except the one marked):

| what | verl's extension point |
| --- | --- |
| estimators ``mosaic``, ``mosaic_traj``, ``mosaic_session``, ``mosaic_broadcast`` | ``core_algos.register_adv_est`` |
| per-row fields reaching them (trajectory, kind, final flag, count, gain) | **none in verl 0.9.1**: its dispatcher forwards ``non_tensor_batch`` only to ``gdpo``; :func:`.advantages.install_row_hook` wraps ``compute_advantage`` for our names only |
| trajectory-token-mean | the estimator scales each row's advantage by ``N / (n_traj * tokens_of_traj)`` (unit token mean); verl's own ``token-mean`` ``agg_loss`` then yields our weights exactly, at any micro-batch or data-parallel layout |
| the multi-session agent loop ``mosaic_agent`` | ``experimental.agent_loop.register`` + ``AgentLoopBase``; one ``AgentLoopOutput`` per session (list return, consumed by verl's v1 trainer) |
| session gains | the rollout servers' prompt log-probs (``sampling_params["prompt_logprobs"]``), see :mod:`.agent_loop` |
| reward | ``custom_reward_function.path`` → :func:`.reward.compute_score` |
| loading all of the above in every Ray process | the ``verl.plugins`` entry point (:mod:`.plugin`), which ``import verl`` loads |
"""

ESTIMATOR_NAMES: dict[str, str] = {
    "mosaic": "mosaic",
    "mosaic_traj": "mosaic-traj",
    "mosaic_session": "mosaic-session",
    "mosaic_broadcast": "broadcast",
}
"""verl's ``algorithm.adv_estimator`` name -> the :mod:`mosaic.core.estimators` name it runs."""

AGENT_NAME = "mosaic_agent"
"""``agent_name`` of the multi-session agent loop (a dataset column, or the rollout's default)."""

__all__ = ["ESTIMATOR_NAMES", "AGENT_NAME"]
