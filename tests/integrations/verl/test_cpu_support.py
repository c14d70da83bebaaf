"""verl's CPU support (``mosaic.integrations.verl.cpu``): registration under ``VERL_PLATFORM=cpu`` and the
HF rollout server's token-in, token-out contract (runs in .venv-verl; the end-to-end run through verl's
trainer is ``test_cpu_e2e.py``, slow)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from mosaic.integrations.verl.cpu_rollout import HFServer
from mosaic.train.setup import base_model_dir

MODEL = str(base_model_dir("tiny"))


def _run(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    res = subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_verl_platform_cpu_registers_the_platform_engine_rollout_and_a_gloo_group():
    out = _run(
        "import os, verl, torch.distributed as dist\n"
        "from mosaic.integrations.verl import plugin, cpu\n"
        "from verl.utils.device import get_device_name, get_nccl_backend, get_device_id, get_torch_device\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "from verl.utils.distributed import initialize_global_process_group_ray\n"
        "assert plugin.LOAD_ERROR is None\n"
        "print(get_device_name(), get_nccl_backend(), get_device_id(), get_torch_device().get_device_name())\n"
        "print(EngineRegistry.get_engine_cls('language_model', 'fsdp2').__name__)\n"
        "print(get_rollout_replica_class('hf').__name__, get_rollout_class('hf', 'async').__name__)\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533', RANK='0', WORLD_SIZE='1')\n"
        "initialize_global_process_group_ray()\n"
        "print(dist.get_backend())\n"
        "try:\n    get_rollout_replica_class('vllm')\nexcept ValueError as e:\n    print('refused:', e)\n",
        VERL_PLATFORM="cpu")  # fmt: skip
    lines = out.strip().splitlines()[-5:]
    assert lines[0].split() == ["cpu", "gloo", "cpu", "CPU"]
    assert lines[1] == "FSDPEngineWithLMHead"
    assert lines[2] == "_HFReplica _HFServerAdapter"
    assert lines[3] == "gloo"
    assert lines[4].startswith("refused: actor_rollout_ref.rollout.name=vllm needs a GPU")


def test_without_verl_platform_cpu_nothing_is_registered():
    out = _run("import verl\nfrom verl.plugin.platform.platform_manager import PlatformRegistry\n"
               "from mosaic.integrations.verl import cpu\nprint('cpu' in PlatformRegistry.registered_names(), cpu._REGISTERED)")
    assert out.strip().splitlines()[-1] == "False []"


@pytest.fixture(scope="module")
def server():
    return HFServer(MODEL, max_model_len=256, seed=0)


def _reference_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return lp.gather(-1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_generated_logprobs_are_the_models_under_the_sampling_temperature(server, temperature):
    prompt = list(range(5, 40))
    out = asyncio.run(server.generate(prompt, {"max_tokens": 16, "temperature": temperature, "logprobs": True,
                                               "ignore_eos": True}, request_id="r"))  # fmt: skip
    assert len(out.token_ids) == 16 and len(out.log_probs) == 16 and out.stop_reason == "completed"
    ref = _reference_logprobs(server.model, prompt, list(out.token_ids), temperature)
    torch.testing.assert_close(torch.tensor(out.log_probs), ref, atol=1e-4, rtol=1e-4)


def test_stops_at_eos_and_within_the_budget(server):
    for i in range(6):
        out = asyncio.run(server.generate([5 + i, 9, 11], {"max_tokens": 24, "temperature": 1.0}, request_id=str(i)))
        assert 1 <= len(out.token_ids) <= 24 and out.log_probs is None  # logprobs only when asked
        if len(out.token_ids) < 24:
            assert out.token_ids[-1] in server.eos


def test_prompt_logprobs_come_in_vllms_layout(server):
    prompt = list(range(3, 30))
    out = asyncio.run(server.generate(prompt, {"max_tokens": 1, "prompt_logprobs": 0}, request_id="p"))
    rows = out.extra_fields["prompt_logprobs"]
    assert len(rows) == len(prompt) and rows[-1] == [0.0]  # token 0 dropped, one dummy at the end
    with torch.no_grad():
        lp = torch.log_softmax(server.model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    expect = [float(lp[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor([r[0] for r in rows[:-1]]), torch.tensor(expect), atol=1e-5, rtol=1e-5)


def test_weight_updates_reach_the_server_and_bad_updates_change_nothing():
    srv = HFServer(MODEL, max_model_len=256)
    prompt = list(range(5, 30))
    state = {k: v.detach().clone() for k, v in srv.model.state_dict().items()}
    name = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    state[name] += 0.5
    before = srv.model(input_ids=torch.tensor([prompt])).logits.detach()
    for bad, err in [({"no.such.weight": torch.zeros(1)}, KeyError),  # unknown name
                     ({**state, name: torch.ones(1)}, ValueError),  # a shape that merely broadcasts
                     ({name: state[name]}, ValueError)]:  # a partial update: stale weights otherwise
        with pytest.raises(err):
            asyncio.run(srv.load_weights(bad))
    assert torch.equal(srv.model(input_ids=torch.tensor([prompt])).logits.detach(), before)  # atomic: untouched
    assert srv.stats()["weight_version"] == 0
    assert asyncio.run(srv.load_weights(state, global_steps=3)) == len(state)
    after = srv.model(input_ids=torch.tensor([prompt])).logits.detach()
    assert (after - before).abs().max() > 1e-3 and srv.stats() == {"requests": 0, "weight_version": 1, "global_steps": 3}
    out = asyncio.run(srv.generate(prompt, {"max_tokens": 2}, request_id="w"))
    assert out.extra_fields["global_steps"] == 3  # verl's staleness metrics read this


def test_stop_token_ids_end_a_generation(server):
    prompt = list(range(5, 40))
    free = asyncio.run(server.generate(prompt, {"max_tokens": 12, "temperature": 0, "ignore_eos": True}, request_id="a"))
    stop = free.token_ids[3]
    out = asyncio.run(server.generate(prompt, {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                          "stop_token_ids": [stop]},
                                      request_id="b"))  # fmt: skip
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


@pytest.mark.parametrize("prompt,params,match", [
    ([], {"max_tokens": 4}, "empty prompt"),
    (list(range(300)), {"max_tokens": 4}, "no room"),
    ([5, 2000], {}, "prompt ids must be ints"),
    ([5, -1], {}, "prompt ids must be ints"),
    ([5.7, 17.2], {}, "prompt ids must be ints"),
    (["5"], {}, "prompt ids must be ints"),
    ([5, 6], {"top_p": 0}, "top_p"),
    ([5, 6], {"temperature": float("nan")}, "temperature"),
    ([5, 6], {"temperature": -1}, "temperature"),
    ([5, 6], {"top_k": 2.7}, "top_k"),
    ([5, 6], {"max_tokens": 0}, "max_tokens"),
    ([5, 6], {"n": 3}, "n=3"),
    ([5, 6], {"prompt_logprobs": 5}, "prompt_logprobs"),
    ([5, 6], {"stop": ["x"]}, "does not implement"),
    ([5, 6], None, "must be a dict"),
])  # fmt: skip
def test_bad_requests_are_clear_errors(server, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        asyncio.run(server.generate(prompt, params, request_id="e"))


def test_a_context_longer_than_the_models_positions_is_refused():
    with pytest.raises(ValueError, match="positions"):
        HFServer(MODEL, max_model_len=100_000)


@pytest.mark.parametrize("env,args,message", [
    ({"DEVICE": "bogus"}, [], "DEVICE must be gpu or cpu"),
    ({"DEVICE": "cpu", "MODEL": "/nonexistent"}, [], "is not a model directory"),
    ({"DEVICE": "cpu"}, ["actor_rollout_ref.rollout.name=vllm"], "serves rollouts with 'hf'"),
    ({"DEVICE": "gpu"}, [], "set MODEL"),
])  # fmt: skip
def test_the_script_refuses_bad_arguments_before_any_work(env, args, message, tmp_path):
    """One line and exit status 2 (1 for a missing MODEL on GPU), before data export or Ray."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "examples/verl/run_mosaic_compaction.sh"
    base = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DEVICE")}
    run_env = {**base, "PYTHON": sys.executable, "DATA": str(tmp_path / "data"),
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **env}  # fmt: skip
    res = subprocess.run(["bash", str(script), *args], env=run_env, capture_output=True, text=True, timeout=120)
    assert res.returncode in (1, 2) and message in res.stderr, (res.returncode, res.stderr[-2000:])
    assert not (tmp_path / "data").exists()  # refused before the data export
