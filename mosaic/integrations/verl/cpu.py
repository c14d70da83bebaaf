"""verl 0.9.x on CPU, as test support: a training step through verl's real trainer without a GPU.

verl ships no CPU platform (its registry holds nvidia, huawei, amd), registers its FSDP engine for
``cuda``/``npu`` only and serves rollouts with vLLM, SGLang or TRT-LLM. It has the extension points
to add all three from outside, and this module uses them (one function of verl is wrapped, see
:func:`_patch_process_group`):

- platform ``cpu`` (:class:`CPUPlatformMethods`), chosen with ``VERL_PLATFORM=cpu``: device
  ``cpu``, gloo process groups, no-op synchronisation and memory calls; worker slots are Ray's logical
  ``GPU`` resource (verl's resource check counts only ``GPU``/``NPU``), which ``ray.init`` declares
  without a GPU (``+ray_kwargs.ray_init.num_gpus=N``; torch sees no CUDA either way);
- verl's FSDP engine (``fsdp``/``fsdp2``, language and value models) registered for device ``cpu``;
- rollout backend ``hf`` (:mod:`mosaic.integrations.verl.cpu_rollout`): each replica launches one
  ``HFServer`` Ray actor that serves token ids and their log-probs through the interface verl's ``LLMServerClient`` calls
  (``generate(prompt_ids, sampling_params, request_id)`` -> ``TokenOutput``; ``prompt_logprobs`` as
  vLLM's server returns them, so Mosaic's live gains work), and ``HFServerAdapter``, the rollout
  object inside verl's hybrid actor worker, hands the trained weights to that server after every
  update (verl's ``naive`` checkpoint engine: ``update_weights(generator of (name, tensor))``).

:func:`register` does it; the Mosaic plugin (``mosaic.integrations.verl.plugin``) calls it at
``import verl`` in every process when ``VERL_PLATFORM=cpu``, before anything resolves verl's platform.
It is for tests and small runs on one machine (generation is one request at a time, HF forward passes
with a KV cache); on GPUs use verl's own platforms and vLLM.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch

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


class CPUPlatformMethods:
    """The methods of verl platform ``cpu`` (see the module docstring), mixed into verl's ``PlatformBase``
    by :func:`_platform_class`, so this module imports no verl at import time."""

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


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    return type("PlatformCPU", (CPUPlatformMethods, PlatformBase), {"__doc__": "verl platform ``cpu`` (Mosaic)."})


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

    from mosaic.integrations.verl import cpu_rollout

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{cpu_rollout.__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, cpu_rollout.replica_class)
    for name in ("vllm", "sglang", "trtllm"):  # a clear error instead of verl's "vllm version None not supported"
        RolloutReplicaRegistry.register(name, _gpu_only(name))


def _gpu_only(name: str):
    def load():
        raise ValueError(f"actor_rollout_ref.rollout.name={name} needs a GPU; on CPU (VERL_PLATFORM=cpu) use "
                         f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}")  # fmt: skip

    return load


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
