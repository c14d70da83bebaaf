"""Train / validation / test splits from disjoint worlds, generated on demand and cached.

Disjointness is structural: split ``i`` only accepts entity names whose hash
falls in slice ``i`` of 3 (:func:`mosaic.envs.names.in_partition`), and the
world seeds differ. :class:`SplitConfig` refuses a world config whose name
partition does not match its split, and :func:`check_disjoint` verifies loaded
splits share no name.

Presets: ``paper`` (default sizes: 1,000 / 300 / 500 tasks, hops 2-5) and
``cpu`` (60-entity worlds, 2-3 hop questions, for the CPU training preset).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mosaic.envs.questions import Task, make_tasks
from mosaic.envs.search import DEFAULT_SNIPPET_TOKENS, SearchIndex, default_cache_dir
from mosaic.envs.world import World, WorldConfig, generate_world
from mosaic.envs.names import name_key

SPLITS = ("train", "validation", "test")
SPLIT_INDEX = {s: i for i, s in enumerate(SPLITS)}
SplitName = Literal["train", "validation", "test"]
CACHE_FORMAT = 1

# (n_entities, n_tasks) per split, per preset.
PRESETS: dict[str, dict] = {
    "paper": {"sizes": {"train": (2000, 1000), "validation": (1000, 300), "test": (1500, 500)},
              "hop_mix": ((2, 0.25), (3, 0.25), (4, 0.25), (5, 0.25))},
    "cpu": {"sizes": {"train": (60, 200), "validation": (60, 64), "test": (60, 64)},
            "hop_mix": ((2, 0.5), (3, 0.5))},
}


@dataclass(frozen=True)
class SplitConfig:
    """Everything that determines a split (and its cache key)."""

    split: SplitName
    """Which split: train, validation or test."""
    world: WorldConfig
    """The split's world; its ``name_partition`` must be ``(split index, 3)``."""
    n_tasks: int = 1000
    """Number of questions."""
    hop_mix: tuple[tuple[int, float], ...] = PRESETS["paper"]["hop_mix"]
    """(hops, weight) pairs; counts per hop count by largest remainder."""
    task_seed: int = 0
    """Seed of the question sampler."""
    snippet_tokens: int = DEFAULT_SNIPPET_TOKENS
    """Tokens of document text per search hit."""
    snippet_mode: Literal["passage", "lead"] = "passage"
    """Snippet window: at the best-matching sentence, or the document's start."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        want = (SPLIT_INDEX[self.split], len(SPLITS))
        if self.world.name_partition != want:
            raise ValueError(f"world.name_partition must be {want} for split {self.split!r} "
                             f"(keeps entity names disjoint across splits), got "
                             f"{self.world.name_partition}")
        if self.n_tasks < 1:
            raise ValueError(f"n_tasks must be >= 1, got {self.n_tasks}")

    @property
    def key(self) -> str:
        blob = json.dumps([CACHE_FORMAT, dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def split_config(split: str, preset: str = "paper", *, seed: int = 0, **world_overrides) -> SplitConfig:
    """The preset's config for ``split``. World seeds: ``3 * seed + split index`` (all distinct)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    p = PRESETS[preset]
    n_entities, n_tasks = p["sizes"][split]
    world = WorldConfig(**{"seed": 3 * seed + SPLIT_INDEX[split], "n_entities": n_entities,
                           "name_partition": (SPLIT_INDEX[split], len(SPLITS)), **world_overrides})
    return SplitConfig(split=split, world=world, n_tasks=n_tasks, hop_mix=p["hop_mix"], task_seed=seed)


@dataclass
class Split:
    config: SplitConfig
    world: World
    tasks: list[Task]
    index: SearchIndex = field(repr=False)

    @property
    def name(self) -> str:
        return self.config.split


def _generate(config: SplitConfig) -> tuple[World, list[Task]]:
    world = generate_world(config.world)
    tasks = make_tasks(world, config.n_tasks, dict(config.hop_mix), seed=config.task_seed,
                       split=config.split)
    return world, tasks


def load_split(split: str, config: SplitConfig | None = None, cache_dir: str | Path | None = None,
               *, preset: str = "paper") -> Split:
    """Load ``split`` from the cache, generating (and caching) it on first use."""
    config = config or split_config(split, preset)
    if config.split != split:
        raise ValueError(f"config is for split {config.split!r}, asked for {split!r}")
    root = Path(cache_dir or default_cache_dir())
    path = root / "splits" / f"{split}-{config.key}.json"
    world = tasks = None
    if path.exists():
        data = json.loads(path.read_text())
        world = World.from_json(data["world"])
        tasks = [Task.from_json(t) for t in data["tasks"]]
    if world is None:
        world, tasks = _generate(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"config": dataclasses.asdict(config), "world": world.to_json(),
                       "tasks": [t.to_json() for t in tasks]}, f)
        os.replace(tmp, path)
    index = SearchIndex(world, cache_dir=root, snippet_tokens=config.snippet_tokens,
                        snippet_mode=config.snippet_mode)
    return Split(config, world, tasks, index)


def check_disjoint(worlds: dict[str, World]) -> None:
    """Raise ValueError if two worlds share an entity name (normalised) or a seed."""

    items = list(worlds.items())
    for i, (a, wa) in enumerate(items):
        keys_a = {name_key(n) for n in wa.names()}
        for b, wb in items[i + 1:]:
            if wa.config.seed == wb.config.seed:
                raise ValueError(f"splits {a} and {b} use the same world seed {wa.config.seed}")
            shared = keys_a & {name_key(n) for n in wb.names()}
            if shared:
                raise ValueError(f"splits {a} and {b} share {len(shared)} entity names, "
                                 f"e.g. {sorted(shared)[:3]}")


def load_splits(preset: str = "paper", cache_dir: str | Path | None = None,
                *, seed: int = 0) -> dict[str, Split]:
    """All three splits of a preset, checked disjoint."""
    splits = {s: load_split(s, split_config(s, preset, seed=seed), cache_dir) for s in SPLITS}
    check_disjoint({s: sp.world for s, sp in splits.items()})
    return splits


def split_config_for(cfg, split: str) -> SplitConfig:
    """The split config of ``split`` with a run's ``data`` overrides (world size, task counts, hop mix);
    ``cfg`` is a :class:`mosaic.config.loader.Config` (only ``cfg.data`` is read)."""
    d = cfg.data
    n_entities = d.train_world_entities if split == "train" and d.train_world_entities else d.world_entities
    overrides = {"n_entities": n_entities} if n_entities else {}
    sc = split_config(split, d.preset, seed=d.seed, **overrides)
    changes = {}
    if split == "train" and d.n_train_tasks:
        changes["n_tasks"] = d.n_train_tasks
    if split != "train" and d.n_eval_tasks:
        changes["n_tasks"] = d.n_eval_tasks
    if d.hop_mix is not None:
        changes["hop_mix"] = tuple((int(h), float(w)) for h, w in d.hop_mix)
    return dataclasses.replace(sc, **changes) if changes else sc
