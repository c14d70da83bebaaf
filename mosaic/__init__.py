"""Mosaic: multi-session agentic reinforcement learning.

Layout (imports point one way, downwards in this list):

- ``mosaic.core``     pure tensor math: advantage estimators and losses. No I/O.
- ``mosaic.trace``    the session-graph data model and its storage (JSONL, Parquet).
- ``mosaic.envs``     environments (the offline deep-search world).
- ``mosaic.agent``    the multi-session harness and the policies that drive it.
- ``mosaic.train``    SFT warm start, RL trainer, information-gain scorer, evaluation.
- ``mosaic.capture``  a recording OpenAI-compatible proxy that rebuilds session graphs.
- ``mosaic.cli``      the ``mosaic`` command.
"""

__version__ = "0.1.0"
