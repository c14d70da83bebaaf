"""verl plugin entry point (``[project.entry-points."verl.plugins"] mosaic``).

verl 0.9.x imports every ``verl.plugins`` entry point at ``import verl`` (unless
``VERL_USE_EXTERNAL_PLUGINS=none``), in the driver and in every Ray worker, so installing
``mosaic-rl[verl]`` is all it takes: the estimators, the advantage-row hook and the
``mosaic_agent`` loop are registered wherever verl runs. verl logs a failing plugin only at debug
level, so :func:`load` keeps the failure visible in :data:`LOAD_ERROR` (tested).

Importing this module while ``verl/__init__`` runs is safe: it imports only verl submodules.
"""

from __future__ import annotations

LOAD_ERROR: BaseException | None = None
PATCHED: list[str] = []


def load() -> None:
    """Register the Mosaic estimators and agent loop with verl and install the row hook (idempotent);
    with ``VERL_PLATFORM=cpu``, first verl's CPU support (:mod:`mosaic.integrations.verl.cpu`), before
    anything resolves verl's platform."""
    from mosaic.integrations.verl import cpu

    if cpu.enabled():
        cpu.register()
    from mosaic.integrations.verl import advantages

    advantages.register_estimators()
    PATCHED[:] = advantages.install_row_hook()
    from mosaic.integrations.verl import agent_loop  # noqa: F401  (registers 'mosaic_agent')


try:
    load()
except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised for verl's own log
    LOAD_ERROR = exc
    raise
