"""The service family's generator, experts and splits (issue 29, items 1, 4 and 8)."""

import json

import pytest

from mosaic.envs.names import in_partition
from mosaic.envs.service import ServiceConfig, ServiceEnv, ServiceExpert, generate_episodes, run_episode
from mosaic.envs.service.splits import check_disjoint, load_service_split, load_service_splits, service_config
from mosaic.envs.service.world import Episode, dumps

CONFIGS = [
    ServiceConfig(seed=1, n_users=150),
    ServiceConfig(seed=2, n_users=100, unannounced_share=0.2),
    ServiceConfig(seed=3, n_users=60, visits=5, events_between=3),
    ServiceConfig(seed=4, n_users=60, visits=2, events_between=1, unannounced_share=0.9),
]


@pytest.fixture(scope="module")
def runs():
    """(config, episodes, expert outcomes, trusting outcomes) per config."""
    env, out = ServiceEnv(), []
    for cfg in CONFIGS:
        eps = generate_episodes(cfg)
        out.append((cfg, eps, [run_episode(env, e, ServiceExpert(True)) for e in eps],
                    [run_episode(env, e, ServiceExpert(False)) for e in eps]))
    return out


def test_same_seed_same_episodes_different_seed_different():
    cfg = ServiceConfig(seed=5, n_users=40)
    a, b = dumps(generate_episodes(cfg)), dumps(generate_episodes(cfg))
    assert a == b
    assert dumps(generate_episodes(ServiceConfig(seed=6, n_users=40))) != a


def test_json_round_trip():
    eps = generate_episodes(ServiceConfig(seed=7, n_users=20))
    back = [Episode.from_json(json.loads(json.dumps(e.to_json()))) for e in eps]
    assert dumps(back) == dumps(eps)
    assert back[3].visits[1].required == eps[3].visits[1].required


def test_knobs_shape_the_episodes():
    eps = generate_episodes(ServiceConfig(seed=8, n_users=30, visits=4, events_between=3, orders_per_user=2))
    for e in eps:
        assert len(e.visits) == 4 and len(e.initial["orders"]) == 2
        assert [len(e.events_before(v)) for v in range(4)] == [0, 3, 3, 3]
        days = [v.day for v in e.visits]
        assert days == sorted(set(days))
        assert e.visits[-1].question and not any(v.question for v in e.visits[:-1])
        assert all(v.required for v in e.visits)  # every visit needs a consequential action
    quiet = generate_episodes(ServiceConfig(seed=8, n_users=30, unannounced_share=0.0))
    loud = generate_episodes(ServiceConfig(seed=8, n_users=30, unannounced_share=1.0))
    assert all(e.unannounced == 0 and not e.trap for e in quiet)
    assert all(e.unannounced == len(e.events) for e in loud)


def test_more_events_than_can_happen_make_fuller_gaps_not_a_crash_and_long_episodes_are_not_cut():
    """``events_between`` beyond what a gap can hold (each once-per-gap kind used, no order left to move) stops
    the gap there; an episode of many visits is not cut by a fixed turn cap: the expert still solves it."""
    eps = generate_episodes(ServiceConfig(seed=3, n_users=20, visits=3, events_between=50))
    assert all(3 <= len(e.events_before(v)) < 50 for e in eps for v in (1, 2))  # (move, card, channel: always)
    long = generate_episodes(ServiceConfig(seed=4, n_users=4, visits=25))
    for e in eps[:5] + long:
        env = ServiceEnv()
        out = run_episode(env, e, ServiceExpert(True))
        assert out.success and out.stale_actions == 0, (e.id, len(e.visits))


@pytest.mark.parametrize("bad", [{"n_users": 0}, {"visits": 0}, {"events_between": -1},
                                 {"unannounced_share": 1.5}, {"orders_per_user": 99}, {"name_partition": (3, 3)}])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ValueError):
        ServiceConfig(**bad)


def test_the_expert_solves_the_episodes_without_stale_actions(runs):
    for cfg, eps, expert, _trusting in runs:
        solved = sum(o.success for o in expert)
        assert solved >= 0.99 * len(eps), (cfg, solved)
        assert sum(o.stale_actions for o in expert) == 0
        assert all(o.tool_errors == 0 and o.rejected == 0 for o in expert)


def test_the_trusting_expert_fails_exactly_the_episodes_with_an_unannounced_change_it_depends_on(runs):
    for cfg, eps, _expert, trusting in runs:
        assert [not o.success for o in trusting] == [e.trap for e in eps], cfg
    eps = [e for _c, es, _x, _t in runs for e in es]
    trusting = [o for _c, _es, _x, ts in runs for o in ts]
    # The test discriminates: traps exist, and so do unannounced changes the trusting expert does not
    # depend on (it passes those, stale actions and all).
    assert sum(e.trap for e in eps) > 50
    quiet_changes = [o for e, o in zip(eps, trusting) if e.unannounced and not e.trap]
    assert len(quiet_changes) > 20 and all(o.success for o in quiet_changes)
    assert any(o.stale_actions for o in quiet_changes)
    assert all(o.stale_actions > 0 or not o.state_match or not o.answer_correct
               for e, o in zip(eps, trusting) if e.trap)


def test_every_trap_has_an_unannounced_event():
    for e in generate_episodes(ServiceConfig(seed=9, n_users=200)):
        if e.trap:
            assert e.unannounced > 0 and e.trap_reason


def test_splits_are_disjoint_by_names_and_seeds():
    splits = load_service_splits("cpu", seed=0, n_users=40)
    assert set(splits) == {"train", "validation", "test"}
    for i, (name, eps) in enumerate(splits.items()):
        assert all(e.split == name and e.id.startswith(name) for e in eps)
        assert all(in_partition(e.user, (i, 3)) for e in eps)
    planted = {"a": splits["train"][:3], "b": splits["train"][2:5]}
    with pytest.raises(ValueError, match="share"):
        check_disjoint(planted)


def test_split_configs_refuse_a_foreign_partition():
    cfg = service_config("train", "cpu", seed=1)
    assert cfg.seed == 3 and cfg.name_partition == (0, 3)
    with pytest.raises(ValueError, match="name_partition"):
        load_service_split("test", cfg)
    with pytest.raises(ValueError, match="preset"):
        service_config("train", "huge")


def test_a_service_split_of_more_users_than_the_family_generates_is_refused_before_any_work():
    from mosaic.config.loader import ConfigError, load_config

    for key in ("data.n_train_tasks", "data.n_eval_tasks"):
        with pytest.raises(ConfigError, match="<= 100000 for the service family"):
            load_config("cpu-service", overrides=[f"{key}=200000"])
    assert load_config("cpu", overrides=["data.n_train_tasks=200000"]).data.n_train_tasks == 200000  # deep search
