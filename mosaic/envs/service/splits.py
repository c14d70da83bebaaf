"""Train / validation / test episodes of the service family, disjoint by user and entity names.

As for deep search (:mod:`mosaic.envs.splits`): split ``i`` draws every user, city, street and item name
from slice ``i`` of 3 of the name space (:func:`mosaic.envs.names.in_partition`), and the generator
seeds differ (``3 * seed + i``), so no two splits share a name whatever their seeds;
:func:`check_disjoint` verifies it. Generation takes milliseconds per episode, so splits are not cached.
"""

from __future__ import annotations

import dataclasses

from mosaic.envs.names import name_key
from mosaic.envs.service.state import city_of
from mosaic.envs.service.world import Episode, ServiceConfig, generate_episodes
from mosaic.envs.splits import SPLIT_INDEX, SPLITS

PRESETS: dict[str, dict] = {
    "paper": {"sizes": {"train": 1000, "validation": 300, "test": 500},
              "knobs": {"visits": 3, "events_between": 2, "unannounced_share": 0.5}},
    "cpu": {"sizes": {"train": 200, "validation": 64, "test": 64},
            "knobs": {"visits": 2, "events_between": 2, "unannounced_share": 0.5}},
}


def service_config(split: str, preset: str = "cpu", *, seed: int = 0, **overrides) -> ServiceConfig:
    """The preset's config for ``split``; ``overrides``: any :class:`ServiceConfig` knob but the partition."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if "name_partition" in overrides or "seed" in overrides:
        raise ValueError("service_config: the seed and name partition follow the split; pass seed=")
    p = PRESETS[preset]
    knobs = {"n_users": p["sizes"][split], **p["knobs"], **overrides}
    return ServiceConfig(seed=3 * seed + SPLIT_INDEX[split], name_partition=(SPLIT_INDEX[split], len(SPLITS)),
                         **knobs)


def load_service_split(split: str, config: ServiceConfig | None = None, *, preset: str = "cpu",
                       seed: int = 0) -> list[Episode]:
    """The episodes of ``split`` (``config`` must carry the split's name partition)."""
    config = config or service_config(split, preset, seed=seed)
    want = (SPLIT_INDEX[split], len(SPLITS))
    if config.name_partition != want:
        raise ValueError(f"config.name_partition must be {want} for split {split!r} (keeps names disjoint), "
                         f"got {config.name_partition}")
    return generate_episodes(config, split)


def episode_names(ep: Episode) -> set[str]:
    """Normalised user, address, city and item names of an episode (what must not cross splits)."""
    names = {ep.user, ep.initial["address"]} | {o["item"] for o in ep.initial["orders"].values()}
    names |= {e.value for e in ep.events if e.kind == "move"}
    names |= {city_of(n) for n in names if ", " in n}
    return {name_key(n) for n in names}


def check_disjoint(splits: dict[str, list[Episode]]) -> None:
    """Raise ValueError if two splits share a user, address or item name."""
    keys = {s: set().union(*(episode_names(e) for e in eps)) if eps else set() for s, eps in splits.items()}
    items = list(keys.items())
    for i, (a, ka) in enumerate(items):
        for b, kb in items[i + 1:]:
            shared = ka & kb
            if shared:
                raise ValueError(f"splits {a} and {b} share {len(shared)} names, e.g. {sorted(shared)[:3]}")


def load_service_splits(preset: str = "cpu", *, seed: int = 0, **overrides) -> dict[str, list[Episode]]:
    splits = {s: load_service_split(s, service_config(s, preset, seed=seed, **overrides)) for s in SPLITS}
    check_disjoint(splits)
    return splits


def config_json(cfg: ServiceConfig) -> dict:
    return dataclasses.asdict(cfg)


@dataclasses.dataclass
class ServiceSplit:
    """A split of the service family as the trainer, evaluation and rollouts take it (deep search's
    :class:`mosaic.envs.splits.Split` has the same ``tasks`` and ``name``): its episodes are the tasks
    (``id``, ``question`` = the first visit, ``answer``)."""

    config: ServiceConfig
    tasks: list[Episode]
    name: str
    family: str = "service"


def load_service_split_for(cfg, split: str) -> ServiceSplit:
    """The service split ``split`` of a run's ``data`` section (:func:`service_config_for`)."""
    config = service_config_for(cfg, split)
    return ServiceSplit(config, load_service_split(split, config), split)


def service_config_for(cfg, split: str) -> ServiceConfig:
    """The config of ``split`` from a run's ``data`` section (``cfg``: a :class:`mosaic.config.loader.Config`):
    its preset and seed, ``n_train_tasks`` / ``n_eval_tasks`` as the number of users, and the service knobs
    (``visits``, ``events_between``, ``unannounced_share``) where set."""
    d = cfg.data
    over = {}
    n_users = d.n_train_tasks if split == "train" else d.n_eval_tasks
    if n_users:
        over["n_users"] = n_users
    if d.visits:
        over["visits"] = d.visits
    if d.events_between >= 0:
        over["events_between"] = d.events_between
    if d.unannounced_share >= 0:
        over["unannounced_share"] = float(d.unannounced_share)
    return service_config(split, d.preset, seed=d.seed, **over)
