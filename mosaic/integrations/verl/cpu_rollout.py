"""Rollout backend ``hf`` of verl's CPU support (:mod:`mosaic.integrations.verl.cpu`, test support).

:class:`HFServer` is one rollout server (a Ray actor) answering verl's token-in, token-out requests with an
HF causal LM; the replica class (``replica_class()``, registered as ``hf``) launches one per replica; the
adapter class (``HFServerAdapter``) is the rollout object inside verl's hybrid actor worker and hands it
the trained weights after every update. The classes deriving from verl's are built on first use, so
importing this module imports no verl.
"""

from __future__ import annotations

import asyncio
import functools
import math
import numbers
from typing import Any

import torch


def server_name(replica_rank: int) -> str:
    return f"mosaic_hf_server_{replica_rank}"


class HFServer:
    """One rollout server (a Ray actor): an HF causal LM answering verl's token-in, token-out requests.

    Requests run one at a time (a lock; CPU), each a KV-cached decode of at most ``max_tokens`` tokens,
    sampled with ``temperature`` / ``top_p`` / ``top_k``; ``logprobs`` are those of the sampled tokens
    under the temperature-scaled distribution (what verl's actor recomputes); ``prompt_logprobs=0``
    returns the prompt's per-token log-probs in vLLM's layout (token 0 dropped, one dummy at the end).
    Stops at the model's EOS ids (generation config) unless ``ignore_eos``, and at ``stop_token_ids``. The
    log-probs are taken before top-k / top-p (what verl's actor recomputes; vLLM's ``processed_logprobs``
    may differ when those are set). Parameters it does not implement are refused (:meth:`check_request`).
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
        self.vocab = int(self.model.get_input_embeddings().weight.shape[0])
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions is not None and int(max_model_len) > int(positions):
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {positions} positions "
                             "(lower data.max_prompt_length + data.max_response_length)")  # fmt: skip
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

        prompt, params = self.check_request(prompt_ids, sampling_params)
        async with self.lock:
            ids, lps, plps = await asyncio.to_thread(self._generate, prompt, params)
            extra: dict[str, Any] = {"global_steps": self.global_steps, "weight_version": self.weight_version}
        self.requests += 1
        if plps is not None:
            extra["prompt_logprobs"] = plps
        return TokenOutput(token_ids=ids, log_probs=lps if params.get("logprobs") else None,
                           stop_reason="completed", extra_fields=extra)  # fmt: skip

    SUPPORTED = frozenset({"max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "logprobs",
                           "prompt_logprobs", "ignore_eos", "stop_token_ids", "repetition_penalty", "detokenize",
                           "n", "min_tokens", "seed"})  # fmt: skip
    """The sampling parameters served; any other key is refused (never silently ignored)."""

    def check_request(self, prompt_ids, sampling_params) -> tuple[list[int], dict[str, Any]]:
        """The request's prompt as ints in the vocabulary and its parameters, or a ValueError naming the problem."""
        if not isinstance(sampling_params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(sampling_params).__name__}")
        params = dict(sampling_params)
        unknown = sorted(set(params) - self.SUPPORTED)
        if unknown:
            raise ValueError(f"sampling parameters the hf rollout does not implement: {unknown}")
        prompt = list(prompt_ids or [])
        if not prompt:
            raise ValueError("empty prompt")

        def ok_id(t) -> bool:
            return isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < self.vocab

        if not all(ok_id(t) for t in prompt):
            raise ValueError(f"prompt ids must be ints in [0, {self.vocab}), got {next(t for t in prompt if not ok_id(t))!r}")
        prompt = [int(t) for t in prompt]
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room within max_model_len {self.max_model_len}")
        checks = [
            ("temperature", lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
            ("top_p", lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "in (0, 1]"),
            ("top_k", lambda v: isinstance(v, int) and (v == -1 or v > 0), "-1 or a positive int"),
            ("max_tokens", lambda v: v is None or (isinstance(v, int) and v >= 1), "an int >= 1"),
            ("max_new_tokens", lambda v: v is None or (isinstance(v, int) and v >= 1), "an int >= 1"),
            ("repetition_penalty", lambda v: v == 1.0, "1.0 (no penalty is implemented)"),
            ("n", lambda v: v == 1, "1"),
            ("min_tokens", lambda v: v in (0, None), "0"),
            ("prompt_logprobs", lambda v: v in (0, None), "0 or None (the prompt tokens' own log-probs)"),
            ("stop_token_ids", lambda v: v is None or all(isinstance(t, int) for t in v), "a list of ints"),
        ]  # fmt: skip
        for key, ok, what in checks:
            if key in params and not ok(params[key]):
                raise ValueError(f"sampling parameter {key}={params[key]!r}: must be {what}")
        return prompt, params

    @torch.no_grad()
    def _generate(self, prompt: list[int], params: dict[str, Any]):
        room = self.max_model_len - len(prompt)
        limit = params.get("max_tokens", params.get("max_new_tokens"))
        max_tokens = room if limit is None else min(int(limit), room)
        temp = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        stops = set() if params.get("ignore_eos") else set(self.eos)
        stops |= set(params.get("stop_token_ids") or [])
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
            if tok in stops:
                break
            if len(ids) == max_tokens:
                break
            out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
        return ids, lps, plps

    # -- weights --------------------------------------------------------------------------------
    async def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load a full set of trained weights (HF names), or nothing: every name known, every shape equal,
        every weight of the model covered (tied weights count as one), checked before anything is copied."""
        own = self.model.state_dict(keep_vars=True)  # tied weights under both names
        unknown = [k for k in state if k not in own]
        if unknown:
            raise KeyError(f"weights the rollout model does not have: {unknown[:5]} (a LoRA adapter must be "
                           "merged: actor_rollout_ref.model.lora.merge=True)")  # fmt: skip
        shapes = [f"{k}: {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items() if v.shape != own[k].shape]
        if shapes:
            raise ValueError(f"weight shapes differ from the rollout model's: {shapes[:5]}")
        covered = {own[k].data_ptr() for k in state}
        missing = [k for k, v in own.items() if v.data_ptr() not in covered]
        if missing:
            raise ValueError(f"a weight update must cover the whole model; missing {missing[:5]} "
                             f"({len(missing)} tensors)")  # fmt: skip
        async with self.lock:
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


@functools.cache
def replica_class():
    """The replica class, built on first use (its base class imports verl's Ray worker groups)."""
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


def __getattr__(name: str):  # HFReplica / HFServerAdapter: verl's registries import them by name
    if name == "HFReplica":
        return replica_class()
    if name == "HFServerAdapter":
        return adapter_class()
    raise AttributeError(name)


@functools.cache
def adapter_class():
    """The rollout class of verl's hybrid worker, built on first use."""
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

    return _HFServerAdapter
