"""The deepagents harness lives in its own virtualenv, ``<repo>/.venv-deepagents`` (gitignored).

Built on demand with the exact pins of pyproject's ``deepagents`` extra
(langchain and its providers would otherwise enter the core environment);
reused when it exists and ``deepagents`` + ``langchain_openai`` import in it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mosaic.integrations import peer_env

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-deepagents"
_PROBE = ("import deepagents, langchain_openai; from deepagents.middleware.summarization import "
          "SummarizationMiddleware; print(deepagents.__version__)")


def pins() -> list[str]:
    return peer_env.extra_pins(REPO, "deepagents")


def venv_python() -> Path | None:
    return peer_env.venv_python(VENV, _PROBE)


def ensure_venv(log=sys.stderr) -> Path:
    """The venv's python, building the venv first if needed (about a minute); RuntimeError on failure."""
    return peer_env.ensure_venv(REPO, "deepagents", "deepagents", _PROBE, log=log)
