"""verl 0.9.x on CPU, as test support: a training step through verl's real trainer without a GPU.

verl ships no CPU platform (its registry holds nvidia, huawei, amd), registers its FSDP engine for
``cuda``/``npu`` only and serves rollouts with vLLM, SGLang or TRT-LLM. It has the extension points
to add all three from outside, and this module uses them; nothing in verl is patched:

- :class:`PlatformCPU`, registered as platform ``cpu`` and chosen with ``VERL_PLATFORM=cpu``: device
  ``cpu``, gloo process groups, no-op synchronisation and memory calls; worker slots are Ray's logical
  ``GPU`` resource (verl's resource check counts only ``GPU``/``NPU``), which ``ray.init`` declares
  without a GPU (``+ray_kwargs.ray_init.num_gpus=N``; torch sees no CUDA either way);
- verl's FSDP engine (``fsdp``/``fsdp2``, language and value models) registered for device ``cpu``;
- rollout backend ``hf``: :class:`HFReplica` launches one :class:`HFServer` Ray actor per replica that
  serves token ids and their log-probs through the interface verl's ``LLMServerClient`` calls
  (``generate(prompt_ids, sampling_params, request_id)`` -> ``TokenOutput``; ``prompt_logprobs`` as
  vLLM's server returns them, so Mosaic's live gains work), and :class:`HFServerAdapter`, the rollout
  object inside verl's hybrid actor worker, hands the trained weights to that server after every
  update (verl's ``naive`` checkpoint engine: ``update_weights(generator of (name, tensor))``).

:func:`register` does it; the Mosaic plugin (``mosaic.integrations.verl.plugin``) calls it at
``import verl`` in every process when ``VERL_PLATFORM=cpu``, before anything resolves verl's platform.
It is for tests and small runs on one machine (generation is one request at a time, HF forward passes
with a KV cache); on GPUs use verl's own platforms and vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

RAY_RESOURCE = "GPU"  # logical slots; see the module docstring
ROLLOUT_NAME = "hf"
_REGISTERED: list[str] = []


def enabled() -> bool:
    """Whether this process runs verl on CPU (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


class _CPUDevice(types.ModuleType):
    """A ``torch.cuda``-shaped module for the CPU: ``torch.cpu``'s functions (streams, events, device
    count), and the memory, seed and cache calls verl makes on its device module as no-ops."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)


def _device_module() -> types.ModuleType:
    mod = _CPUDevice("mosaic_verl_cpu_device")
    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    mod.is_available = lambda: True
    mod.current_device = lambda: "cpu"
    mod.device_count = lambda: 1
    mod.get_device_name = lambda *a, **k: "CPU"
    mod.set_device = none
    mod.synchronize = none
    mod.empty_cache = none
    mod.manual_seed = lambda seed: torch.manual_seed(seed)
    mod.manual_seed_all = lambda seed: torch.manual_seed(seed)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, zero)
    mod.reset_peak_memory_stats = none
    mod.set_per_process_memory_fraction = none
    mod.mem_get_info = lambda *a, **k: (0, 0)
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.memory = types.SimpleNamespace(_set_allocator_settings=none)
    return mod


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform ``cpu``: see the module docstring."""

        _module = _device_module()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return self._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return enabled()  # never auto-detected over a real accelerator

        def current_device(self):
            return "cpu"  # what verl passes to .to() / device=

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "MOSAIC_VERL_CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return RAY_RESOURCE

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    return PlatformCPU


def _register_engines() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as fsdp

    for model_type, cls in (("language_model", fsdp.FSDPEngineWithLMHead),
                            ("value_model", fsdp.FSDPEngineWithValueHead)):  # fmt: skip
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(cls)


def _register_rollout() -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _replica)


def _patch_process_group() -> None:
    """verl builds its process-group backend as ``cpu:gloo,<device>:<backend>``, which torch refuses when
    the device is ``cpu`` (``cpu:gloo,cpu:gloo``): the one place patched, to plain ``gloo``."""
    import sys

    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_mosaic_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._mosaic_cpu = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    for name in ("verl.workers.engine_workers",):  # modules that imported the name before this ran
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "initialize_global_process_group_ray"):
            mod.initialize_global_process_group_ray = initialize_global_process_group_ray


def register() -> list[str]:
    """Register the CPU platform (selected when ``VERL_PLATFORM=cpu``), the FSDP engine for ``cpu`` and the
    ``hf`` rollout backend; idempotent. Returns what was registered."""
    if _REGISTERED:
        return list(_REGISTERED)
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register(platform="cpu")(_platform_class())
    _REGISTERED.append("platform:cpu")
    _patch_process_group()
    _REGISTERED.append("patch:verl.utils.distributed.initialize_global_process_group_ray")
    _register_engines()
    _REGISTERED.append("engine:fsdp@cpu")
    _register_rollout()
    _REGISTERED.append(f"rollout:{ROLLOUT_NAME}")
    return list(_REGISTERED)


# --------------------------------------------------------------------------------------------------
# rollout backend ``hf``
# --------------------------------------------------------------------------------------------------


def server_name(replica_rank: int) -> str:
    return f"mosaic_hf_server_{replica_rank}"


class HFServer:
    """One rollout server (a Ray actor): an HF causal LM answering verl's token-in, token-out requests.

    Requests run one at a time (a lock; CPU), each a KV-cached decode of at most ``max_tokens`` tokens,
    sampled with ``temperature`` / ``top_p`` / ``top_k``; ``logprobs`` are those of the sampled tokens
    under the temperature-scaled distribution (what verl's actor recomputes); ``prompt_logprobs=0``
    returns the prompt's per-token log-probs in vLLM's layout (token 0 dropped, one dummy at the end).
    Stops at the model's EOS ids (generation config) unless ``ignore_eos``.
    """

    def __init__(self, model_path: str, max_model_len: int, seed: int = 0, threads: int = 1):
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(max(1, int(threads)))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            eos = self.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        self.max_model_len = int(max_model_len)
        self.gen = torch.Generator().manual_seed(int(seed))
        self.lock = asyncio.Lock()
        self.global_steps: int | None = None
        self.weight_version = 0
        self.requests = 0

    # -- serving --------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       **kwargs: Any):  # fmt: skip
        from verl.workers.rollout.replica import TokenOutput

        params = dict(sampling_params)
        async with self.lock:
            ids, lps, plps = await asyncio.to_thread(self._generate, list(map(int, prompt_ids)), params)
        self.requests += 1
        extra: dict[str, Any] = {"global_steps": self.global_steps, "weight_version": self.weight_version}
        if plps is not None:
            extra["prompt_logprobs"] = plps
        return TokenOutput(token_ids=ids, log_probs=lps if params.get("logprobs") else None,
                           stop_reason="completed", extra_fields=extra)  # fmt: skip

    @torch.no_grad()
    def _generate(self, prompt: list[int], params: dict[str, Any]):
        if not prompt:
            raise ValueError("empty prompt")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room within max_model_len {self.max_model_len}")
        max_tokens = max(1, min(int(params.get("max_tokens", params.get("max_new_tokens", room))), room))
        temp = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        ignore_eos = bool(params.get("ignore_eos", False))
        x = torch.tensor([prompt])
        out = self.model(input_ids=x, use_cache=True)
        plps = None
        if params.get("prompt_logprobs") is not None:
            lp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
            plps = [[float(v)] for v in lp] + [[0.0]]
        past, logits = out.past_key_values, out.logits[0, -1].float()
        ids: list[int] = []
        lps: list[float] = []
        for _ in range(max_tokens):
            scaled = logits / max(temp, 1e-6)
            logp = torch.log_softmax(scaled, -1)
            if temp <= 0:
                tok = int(torch.argmax(logits))
            else:
                probs = logp.exp()
                if top_k > 0:
                    kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
                    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                if top_p < 1.0:
                    sp, si = torch.sort(probs, descending=True)
                    keep = torch.cumsum(sp, 0) - sp < top_p * sp.sum()
                    mask = torch.zeros_like(probs, dtype=torch.bool)
                    mask[si[keep]] = True
                    probs = torch.where(mask, probs, torch.zeros_like(probs))
                tok = int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
            ids.append(tok)
            lps.append(float(logp[tok]))
            if tok in self.eos and not ignore_eos:
                break
            if len(ids) == max_tokens:
                break
            out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
        return ids, lps, plps

    # -- weights --------------------------------------------------------------------------------
    async def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load trained weights (HF names; missing names keep their value, unknown names are an error)."""
        async with self.lock:
            own = self.model.state_dict(keep_vars=True)  # tied weights under both names
            unknown = [k for k in state if k not in own]
            if unknown:
                raise KeyError(f"weights the rollout model does not have: {unknown[:5]}")
            with torch.no_grad():
                for k, v in state.items():
                    own[k].copy_(v.to(own[k].dtype))
            self.weight_version += 1
            if global_steps is not None:
                self.global_steps = int(global_steps)
        return len(state)

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "weight_version": self.weight_version, "global_steps": self.global_steps}

    # -- verl's server control calls: nothing to free or pause on CPU ---------------------------
    async def set_global_steps(self, global_steps: int):
        self.global_steps = int(global_steps)

    async def wake_up(self, tags: list[str] | None = None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def wait_for_requests_to_drain(self):
        async with self.lock:
            return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True):
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


def _replica_class():
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class _HFReplica(RolloutReplica):
        """verl rollout replica ``hf``: one :class:`HFServer` actor (no accelerator resource)."""

        async def launch_servers(self):
            path = getattr(self.model_config, "local_path", None) or self.model_config.path
            max_len = int(getattr(self.config, "max_model_len", None)
                          or self.config.prompt_length + self.config.response_length)  # fmt: skip
            seed = int(getattr(self.config, "seed", 0) or 0) + self.replica_rank
            server = ray.remote(HFServer).options(
                name=server_name(self.replica_rank), max_concurrency=self.max_concurrency, num_cpus=0,
                runtime_env={"env_vars": {"VERL_PLATFORM": "cpu"}},
            ).remote(model_path=str(path), max_model_len=max_len, seed=seed)  # fmt: skip
            await server.stats.remote()  # constructed (raises here if the model does not load)
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"hf-cpu-{self.replica_rank}"

        async def sleep(self):
            await asyncio.gather(*[s.sleep.remote() for s in self.servers])

    return _HFReplica


_CLASSES: dict[str, Any] = {}


def _replica():
    """The replica class, built on first use (its base class imports verl's Ray worker groups)."""
    if "replica" not in _CLASSES:
        _CLASSES["replica"] = _replica_class()
    return _CLASSES["replica"]


def __getattr__(name: str):  # HFReplica / HFServerAdapter: verl's registries import them by name
    if name == "HFReplica":
        return _replica()
    if name == "HFServerAdapter":
        return _adapter_class()
    raise AttributeError(name)


def _adapter_class():
    if "adapter" in _CLASSES:
        return _CLASSES["adapter"]
    import ray
    from verl.workers.rollout.base import BaseRollout

    class _HFServerAdapter(BaseRollout):
        """The rollout object in verl's hybrid actor worker: hands each weight update to its HFServer."""

        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh)
            self.sleep_level = 1
            world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                     * self.config.pipeline_model_parallel_size)  # fmt: skip
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.replica_rank, self.is_leader = rank // world, rank % world == 0
            self._server = None

        def _handle(self):
            if self._server is None:
                self._server = ray.get_actor(server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            if wire_format != "named_tensors":
                raise ValueError(f"the hf rollout takes full named tensors, not {wire_format!r}")
            state = {}
            for name, t in weights:  # every rank iterates: FSDP gathers collectively
                if hasattr(t, "full_tensor"):
                    t = t.full_tensor()
                if self.is_leader:
                    state[name] = t.detach().to("cpu", torch.float32).clone()
            if self.is_leader:
                await self._handle().load_weights.remote(state, global_steps=kwargs.get("global_steps"))

    _CLASSES["adapter"] = _HFServerAdapter
    return _HFServerAdapter
