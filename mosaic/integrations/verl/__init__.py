"""Mosaic as a verl (0.9.x) plugin: estimators, trajectory-token-mean, the multi-session agent loop.

verl is imported lazily: this package and :mod:`.rows` import nothing of verl; the modules
that subclass or call verl (:mod:`.advantages`, :mod:`.agent_loop`, :mod:`.plugin`) do, and
are only imported where verl is installed (``pip install mosaic-rl[verl]``).

How it plugs in (every point is one verl offers, except the one marked):

| what | verl's extension point |
| --- | --- |
| every estimator of ``mosaic.core.estimators`` that session rows can feed (:func:`estimator_names`: ``mosaic``, ``mosaic-traj``, ``mosaic-session``, ``broadcast``, and their other spellings), knobs ``algorithm.mosaic.<knob>`` from the same registry | ``core_algos.register_adv_est`` |
| per-row fields reaching them (trajectory, kind, final flag, count, gain) | **none in verl 0.9.1**: its dispatcher forwards ``non_tensor_batch`` only to ``gdpo``; :func:`.advantages.install_row_hook` wraps ``compute_advantage`` for our names only |
| trajectory-token-mean | the estimator scales each row's advantage by ``N / (n_traj * tokens_of_traj)`` (unit token mean); verl's own ``token-mean`` ``agg_loss`` then yields our weights exactly, at any micro-batch or data-parallel layout of one mini-batch (several mini-batches: several optimizer steps, each normalised by its own tokens; counted as ``mosaic/verl_minibatches``) |
| the multi-session agent loop ``mosaic_agent`` | ``experimental.agent_loop.register`` + ``AgentLoopBase``; one ``AgentLoopOutput`` per session (list return, consumed by verl's v1 trainer) |
| session gains, downstream credit (``mosaic.downstream=true``, for ``mosaic-dag``) | the rollout servers' prompt log-probs (``sampling_params["prompt_logprobs"]``), see :mod:`.agent_loop` |
| reward | ``custom_reward_function.path`` → :func:`.reward.compute_score` |
| loading all of the above in every Ray process | the ``verl.plugins`` entry point (:mod:`.plugin`), which ``import verl`` loads |
"""

AGENT_NAME = "mosaic_agent"
"""``agent_name`` of the multi-session agent loop (a dataset column, or the rollout's default)."""

VERL_OWN = {"grpo": "verl registers its own 'grpo' (the same single-session GRPO on its rows): the name stays verl's"}
"""Registry names verl itself registers; the plugin leaves them to verl."""

__all__ = ["estimator_names", "not_registered", "AGENT_NAME", "VERL_OWN"]


def not_registered() -> dict[str, str]:
    """The registered estimators the plugin does not register with verl, and why: per-turn inputs the
    per-session verl rows do not carry, or a name verl owns (:data:`VERL_OWN`)."""
    from mosaic.core.estimators import ESTIMATORS

    out = {}
    for name, e in ESTIMATORS.items():
        extra = sorted(e.needs - {"gains", "downstream"})  # (both are per-session columns the agent loop writes)
        if name in VERL_OWN:
            out[name] = VERL_OWN[name]
        elif e.level != "session" or extra:
            out[name] = (f"needs per-turn inputs ({', '.join(extra) or 'turn layout'}) that verl's per-session "
                         "rows do not carry; it runs in `mosaic train`")
    return out


def estimator_names() -> dict[str, str]:
    """verl's ``algorithm.adv_estimator`` names the plugin registers -> the registered estimator each runs:
    every estimator of ``mosaic.core.estimators.ESTIMATORS`` but :func:`not_registered`, under its name and
    its other spellings (``mosaic-traj`` and ``mosaic_traj``: the names ``algo.estimator`` takes)."""
    from mosaic.core.estimators import ESTIMATORS

    skip = not_registered()
    return {n: name for name, e in ESTIMATORS.items() if name not in skip for n in (name, *e.spellings())}
