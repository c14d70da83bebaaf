"""The data of ``mosaic pretrain`` (:mod:`mosaic.train.pretrain`): expert rollouts over a pretraining world of
either family, and the drills (names to copy; service accounts to read and act on)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from mosaic.agent.expert import ExpertPolicy
from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.config.loader import Config
from mosaic.envs.splits import load_split, split_config
from mosaic.trace import to_rows
from mosaic.train import setup
from mosaic.train.batching import PackedRow, pack_rows
from mosaic.train.sft import expert_noise

__all__ = ["PretrainConfig", "PretrainError", "service_config", "world_rows", "copy_drill", "service_drill"]


class PretrainError(ValueError):
    """The output dir or ``init`` does not fit this run (a config error, said before any training)."""


@dataclass(frozen=True)
class PretrainConfig:
    """Knobs of ``mosaic pretrain`` (recorded next to the weights)."""

    steps: int = 1500
    """Optimizer steps."""
    batch_size: int = 16
    """Rows (sessions, mains packed into their compactions) per step."""
    lr: float = 2e-3
    """Peak learning rate (linear warm-up, cosine decay to 10 %)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    vocab_size: int = 1024
    """Tokenizer vocabulary (see :func:`mosaic.agent.models.corpus.build_generator_tokenizer`)."""
    tokenizer_worlds: int = 40
    """Generated worlds the tokenizer is trained on."""
    world_seed_base: int = 1000
    """Data seed of the first pretraining world (the CPU preset's ``train`` split under that seed)."""
    tasks_per_world: int = 32
    """Questions per world. Few per world and many worlds: with 200 questions of one world in a row
    the model memorises that world's names (the loss jumps at every new world) instead of copying."""
    pool_rows: int = 1024
    """Rows kept in the shuffle pool (refilled with new worlds), so a batch mixes many worlds."""
    modes: tuple[str, ...] = ("compaction", "compaction", "fork")
    """Harness modes, cycled per world, so every session kind is seen."""
    expert_noise: float = 0.2
    """The expert's mistake rate (as ``sft.expert_noise``)."""
    context_weight: float = 0.5
    """Weight of the language-model loss on the *context* tokens (prompts, tool responses, inserted
    text) next to the loss on the expert's own tokens. Documents repeat entity names, so predicting
    them teaches the copying the actions need, from the same forward pass."""
    copy_share: float = 0.25
    """Share of each batch made of short name drills over the pool's worlds: repeat a list of names,
    or give the name a listed key maps to. They train the exact multi-token copying of unseen names
    that every query, summary and answer needs, at a fraction of a rollout's tokens."""
    init: str = ""
    """Start from this saved model directory (continue a pretraining run) instead of a fresh init."""
    eval_every: int = 250
    """Greedy check on the validation world every this many steps (0 = never)."""
    eval_tasks: int = 32
    """Validation questions per check."""
    seed: int = 0
    """Seed of the model init and the row order."""
    save_every: int = 50
    """Write the resumable training state every this many steps (0 = only at the checks): a stopped
    run started again with the same ``out`` and config goes on from there."""
    service_share: float = 0.0
    """Share of the pretraining worlds that are service-family batches (``mosaic.envs.service``): the
    revalidating expert's successful episodes of ``tasks_per_world`` generated training-partition users,
    through the harness of ``service_preset``. 0: deep search only (the recipe of the shipped ``tiny-base``)."""
    service_modes: tuple[str, ...] = ("compaction", "compaction", "reset")
    """Harness modes cycled over the service worlds (the service expert plays ``single``, ``compaction`` and
    ``reset``)."""
    service_drills: float = 0.0
    """Share of the drills that are service account drills once service worlds are in the pool: an account
    and its orders as a lookup shows them, then a question (the card, the address, an order's status, the
    plan's status) or a request whose one tool call must be written (reorder, cancel, upgrade) — the exact
    reading and copying of values into JSON arguments the family's actions need. 0: name drills only."""
    service_preset: str = "cpu-service"
    """The preset whose ``data`` and ``harness`` sections the service episodes are generated and played under
    (and checked on, on its validation split)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "lr", "vocab_size", "tokenizer_worlds", "tasks_per_world"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PretrainConfig.{name}: must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.copy_share < 1.0:
            raise ValueError(f"PretrainConfig.copy_share: must be in [0, 1), got {self.copy_share}")
        if self.pool_rows < 2 * self.batch_size:
            raise ValueError(f"PretrainConfig.pool_rows: must be >= 2 * batch_size, got {self.pool_rows}")
        if not self.modes:
            raise ValueError("PretrainConfig.modes: at least one harness mode")
        if self.save_every < 0 or self.eval_every < 0:
            raise ValueError("PretrainConfig.save_every / eval_every: must be >= 0")
        if not 0.0 <= self.service_share < 1.0:
            raise ValueError(f"PretrainConfig.service_share: must be in [0, 1), got {self.service_share}")
        if not 0.0 <= self.service_drills <= 1.0:
            raise ValueError(f"PretrainConfig.service_drills: must be in [0, 1], got {self.service_drills}")
        from mosaic.config.harness import MODES

        bad = [m for m in (*self.modes, *self.service_modes) if m not in MODES]
        if bad or not self.service_modes:
            raise ValueError(f"PretrainConfig.modes / service_modes: unknown harness mode(s) {bad} (modes: {', '.join(MODES)})")

    def is_service(self, k: int) -> bool:
        """World ``k`` is a service-family batch (spread evenly: ``service_share`` of every run of worlds)."""
        return int((k + 1) * self.service_share) > int(k * self.service_share)

    def mode(self, k: int) -> str:
        """The harness mode of world ``k``: ``modes`` cycled over the deep-search worlds, ``service_modes`` over
        the service worlds."""
        if self.is_service(k):
            return self.service_modes[int(k * self.service_share) % len(self.service_modes)]
        return self.modes[(k - int(k * self.service_share)) % len(self.modes)]


def service_config(cfg: Config, pc: PretrainConfig) -> Config:
    """``cfg`` with the data and harness sections of ``pc.service_preset`` (the service family's budget)."""
    from mosaic.config.loader import preset_config

    svc = preset_config(pc.service_preset)
    if svc.data.family != "service":
        raise PretrainError(f"PretrainConfig.service_preset: {pc.service_preset!r} is not a service-family preset")
    return cfg.replace(data=replace(svc.data, cache_dir=cfg.data.cache_dir), harness=svc.harness)


def world_rows(cfg: Config, pc: PretrainConfig, k: int, tok, chat, cache_dir: Path) -> tuple[list, dict]:
    """Packed training rows of expert rollouts over pretraining world ``k`` (of either family)."""
    if pc.is_service(k):
        return _service_rows(cfg, pc, k, tok, chat)
    sc = replace(split_config("train", cfg.data.preset, seed=pc.world_seed_base + k), n_tasks=pc.tasks_per_world)
    split = load_split("train", sc, cache_dir=cache_dir)
    hcfg = cfg.harness.replace(mode=pc.mode(k))
    policy = ExpertPolicy(tok, split.tasks, expert_noise(pc.expert_noise), seed=pc.seed + k)
    trajs = Harness(policy, chat, DeepSearchEnv(split), hcfg).run(
        split.tasks, group_size=1, seed=pc.seed + k, progress=False, step="pretrain")
    rows = pack_rows([r for r in to_rows(trajs) if r.num_trainable > 0])
    info = {"names": sorted(split.world.names()), "world_seed": sc.world.seed, "mode": hcfg.mode, "trajectories": len(trajs),
            "expert_accuracy": sum(t.success for t in trajs) / max(1, len(trajs))}
    return rows, info


def _service_rows(cfg: Config, pc: PretrainConfig, k: int, tok, chat) -> tuple[list, dict]:
    """Packed rows of the revalidating expert's *successful* episodes over ``tasks_per_world`` service users
    generated under data seed ``world_seed_base + k`` (``service_modes``, ``service_preset``'s harness). Its
    failures through the harness (a cap reached, a summary that cut a visit short) are left out: unlike deep
    search's noisy expert, they are not recoveries worth imitating."""
    from mosaic.agent.episode import make_env
    from mosaic.agent.service_expert import ServiceExpertPolicy

    scfg = service_config(cfg, pc)
    scfg = scfg.replace(data=replace(scfg.data, seed=pc.world_seed_base + k, n_train_tasks=pc.tasks_per_world))
    split = setup.load_split(scfg, "train")
    hcfg = scfg.harness.replace(mode=pc.mode(k))
    trajs = Harness(ServiceExpertPolicy(tok, split.tasks), chat, make_env(split), hcfg).run(
        split.tasks, group_size=1, seed=pc.seed + k, progress=False, step="pretrain")
    rows = pack_rows([r for r in to_rows([t for t in trajs if t.success]) if r.num_trainable > 0])
    names = sorted({n for e in split.tasks for n in (e.user, e.initial["address"], *(o["item"] for o in e.initial["orders"].values()))})
    info = {"family": "service", "names": names, "accounts": [e.initial for e in split.tasks],
            "world_seed": scfg.data.seed, "mode": hcfg.mode,
            "trajectories": len(trajs), "expert_accuracy": sum(t.success for t in trajs) / max(1, len(trajs))}
    return rows, info


def copy_drill(rng: random.Random, tok, names: list[str]):
    """One name drill as a training row (loss on the answer): repeat a list of names, or look up the
    name a key maps to in a list of pairs."""

    if rng.random() < 0.5:
        pick = rng.sample(names, rng.randint(2, 5))
        prompt = f"Copy these names exactly: {'; '.join(pick)}"
        answer = "; ".join(pick)
    else:
        pick = rng.sample(names, 2 * rng.randint(2, 4))
        pairs = list(zip(pick[::2], pick[1::2]))
        key, answer = pairs[rng.randrange(len(pairs))]
        prompt = " ".join(f"{a} -> {b}." for a, b in pairs) + f" Which name does {key} point to?"
    p_ids = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    c_ids = tok.encode(f"<answer>{answer}</answer><|im_end|>")
    n = len(c_ids)
    return PackedRow(p_ids, c_ids, [True] * n, [0.0] * n, [0.0] * n, [0] * n, 0)


def service_drill(rng: random.Random, tok, account: dict):
    """One service account drill as a training row (loss on the answer): ``account`` (an episode's initial
    state) with its order and plan statuses redrawn, shown as ``get_account`` + ``list_orders`` show it, then
    a question or a request whose tool call must be written (:attr:`PretrainConfig.service_drills`)."""
    from mosaic.envs.service import tool_call_text
    from mosaic.envs.service.state import PLANS, Request, answer_for, plan_request
    from mosaic.envs.service.text import format_account, format_orders

    st = {**account, "orders": {k: dict(v) for k, v in account["orders"].items()}}
    for o in st["orders"].values():
        if rng.random() < 0.5:
            o["status"] = rng.choice(("placed", "shipped", "delivered"))
    if rng.random() < 0.5:
        st["plan_status"] = rng.choice(("active", "lapsed"))
    item = rng.choice([o["item"] for o in st["orders"].values()])
    kind = rng.choice(("card", "city", "status", "plan", "reorder", "cancel", "upgrade"))
    questions = {"card": "Which card is on file? Give its last four digits.", "city": "In which city does the customer live?",
                 "status": f"What is the status of the newest {item} order?", "plan": "Is the plan active or lapsed?"}
    if kind in questions:
        question, answer = questions[kind], f"<answer>{answer_for(st, kind, item)}</answer>"
    else:
        req = Request(kind, item=item if kind != "upgrade" else "", tier=rng.choice(PLANS) if kind == "upgrade" else "")
        calls = plan_request(st, req)
        if not calls:  # (nothing of that item can still be cancelled)
            question, answer = questions["card"], f"<answer>{st['card']}</answer>"
        else:
            what = {"reorder": f"order another {item}", "cancel": f"take care of the {item} they no longer want",
                    "upgrade": f"put them on the {req.tier} plan"}[kind]
            question = f"Write the one tool call that does this: {what}."
            answer = tool_call_text(calls[0].name, dict(calls[0].kw))
    prompt = f"{format_account(st)}\n{format_orders(st['orders'])}\n{question}"
    p_ids = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    c_ids = tok.encode(f"{answer}<|im_end|>")
    n = len(c_ids)
    return PackedRow(p_ids, c_ids, [True] * n, [0.0] * n, [0.0] * n, [0] * n, 0)
