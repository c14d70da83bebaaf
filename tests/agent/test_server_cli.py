"""``mosaic serve --model DIR`` end to end: a subprocess serving a saved tiny model."""

from __future__ import annotations

import os
import sys

import httpx

from mosaic.agent.models.embedded import save_model
from _tiny import tiny_model
from mosaic.agent.policies.openai import OpenAIPolicy
from mosaic.agent.policy import GenRequest


def test_serve_cli_serves_a_saved_model(tmp_path, spawn_server):
    model, tok = tiny_model(seed=1)
    save_model(model, tok, tmp_path / "m")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc, url = spawn_server([sys.executable, "-m", "mosaic.cli", "serve", "--model", str(tmp_path / "m"),
                              "--port", "0", "--name", "tiny"], "/v1/models", env=env)
    try:
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
        with OpenAIPolicy(base_url=url, max_retries=0) as pol:
            res = pol.generate([GenRequest("a", [5, 6, 7, 8], 5)])[0]
        assert res.error is None and 1 <= len(res.token_ids) == len(res.logprobs) <= 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_cli_rejects_a_missing_model(tmp_path, capsys):
    from mosaic.cli import main

    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "neither 'smollm2' nor an existing directory" in capsys.readouterr().err
