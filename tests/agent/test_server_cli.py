"""``mosaic serve --model DIR`` end to end: a subprocess serving a saved tiny model."""

from __future__ import annotations

import os
import socket
import sys

import httpx
import pytest

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


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "{tmp}/nope"], "--model '{tmp}/nope': neither 'smollm2' nor an existing directory"),
    (["--port", "-1"], "--port must be in [0, 65535] (0: any free port), got -1"),
    (["--port", "65536"], "--port must be in [0, 65535]"),
    (["--port", "{busy}"], "--host 127.0.0.1 --port {busy}: cannot bind"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    (["--default-max-tokens", "-5"], "--default-max-tokens must be >= 1, got -5"),
    (["--max-body-mb", "0"], "--max-body-mb must be a finite number > 0, got 0.0"),
    (["--api-key-env", "MOSAIC_TEST_UNSET_KEY_VAR"], "environment variable MOSAIC_TEST_UNSET_KEY_VAR is not set"),
    (["--device", "bogus"], "--device 'bogus': not a torch device"),
    (["--device", "cuda:99"], "--device 'cuda:99': no "),  # a device this machine does not have
])
def test_serve_bad_arguments_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, argv, fragment):
    # issue 11: `serve` with a bad port loaded the model, then ended in a traceback.
    from mosaic.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    (tmp_path / "m").mkdir()  # (a model dir that is never loaded: the flags are checked first)
    try:
        argv = [a.replace("{tmp}", str(tmp_path)).replace("{busy}", port) for a in argv]
        assert main(["serve", "--model", str(tmp_path / "m"), *argv]) == 2
    finally:
        busy.close()
    captured = capsys.readouterr()
    want = fragment.replace("{tmp}", str(tmp_path)).replace("{busy}", port)
    assert captured.err.startswith("mosaic serve: ") and want in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--model", "m", "--port", "abc"], "mosaic serve: argument --port: invalid int value: 'abc'"),
    (["serve"], "mosaic serve: the following arguments are required: --model"),
    (["bogus-verb"], "mosaic: argument COMMAND: invalid choice: 'bogus-verb'"),
    (["data", "score", "x"], "mosaic data score: the following arguments are required: ground_truth"),
    (["data", "generate", "--seed", "x"], "mosaic data generate: argument --seed: invalid int value: 'x'"),
    (["train", "--preset"], "mosaic train: argument --preset: expected one argument"),
    (["compare", "a", "b", "--n-boot", "1e3"], "mosaic compare: argument --n-boot: invalid int value: '1e3'"),
    (["proxy", "scripted-upstream", "--port", "abc"], "mosaic proxy scripted-upstream: argument --port: invalid int"),
])
def test_argparse_errors_are_one_line_for_every_verb(capsys, argv, fragment):
    # issue 11: argparse errors printed the usage block (5-14 lines) before the message.
    from mosaic.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(fragment), captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "usage:" not in captured.err


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--model", "m", "--bogus"], "mosaic serve: unrecognized arguments: --bogus"),
    (["data", "score", "a", "b", "c"], "mosaic data score: unrecognized arguments: c"),
    (["proxy", "export", "--records", "r", "--out", "o.jsonl", "--nope"], "mosaic proxy export: unrecognized arguments: --nope"),
])
def test_unrecognized_arguments_name_the_verb(capsys, argv, fragment):
    from mosaic.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(fragment) and len(err.strip().splitlines()) == 1, err
