"""Mosaic: multi-session agentic reinforcement learning.

The package is built in floors; a module imports only from its own floor or the floors below it
(``tests/test_import_graph.py`` enforces this, function-level imports included). Bottom to top:

- ``mosaic.core``          pure tensor math: the estimator registry, advantages, losses. No I/O.
- ``mosaic.config``        the configuration and command-line grammar (frozen, validated sections).
- ``mosaic.serving``       running an ASGI app (uvicorn, or in-process for tests and harnesses).
- ``mosaic.trace``         the session-graph data model and its storage (JSONL, Parquet).
- ``mosaic.envs``          environments (the offline deep-search world).
- ``mosaic.agent``         the multi-session harness, the policies that drive it, ``mosaic serve``.
- ``mosaic.capture``       the recording OpenAI-compatible proxy that rebuilds session graphs, and a
                           scripted upstream to try it without a model.
- ``mosaic.train``         SFT warm start, RL trainer, rollout sources, scorer, evaluation.
- ``mosaic.integrations``  Mosaic inside other engines (verl).
- ``mosaic.experiment``    grids of runs, held-out evaluation, seed-level reports.
- ``mosaic.view``          ``mosaic view``: a static HTML page of a run's rollouts.
- ``mosaic.cli``           the ``mosaic`` command: each area registers its verbs.
"""

__version__ = "0.1.0"

FLOORS: tuple[str, ...] = (
    "core", "config", "serving", "trace", "envs", "agent", "capture",
    "train", "integrations", "experiment", "view", "cli",
)
"""The areas, bottom floor first (see the module docstring); the import test reads this."""
