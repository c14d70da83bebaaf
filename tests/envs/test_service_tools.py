"""The service tools, the SQLite backend and the stale-action detector (issue 29, items 2, 3 and 8)."""

import pytest

from mosaic.envs.service import TOOLS, ServiceEnv, StaleTracker, ToolError, check_args, run_episode, tool_call_text
from mosaic.envs.service.state import Request, call, new_state
from mosaic.envs.service.text import parse_account, parse_orders, visit_text
from mosaic.envs.service.world import Episode, Event, Visit

GOOD = {"order_id": "o1", "item": "Red lamp", "address": "9 Elm Road, Port B", "card": "1234", "tier": "premium"}


def planted(*, move_announced=False, ship_announced=False) -> Episode:
    """Two visits; between them the user moves and order o1 (a placed lamp) ships."""
    initial = new_state("Ann Bee", "1 Oak Road, Port A", "1111", "plus", "email",
                        [("Red lamp", "placed"), ("Blue chair", "shipped")])
    events = [Event("move", 2, 1, move_announced, field="address", value="2 Elm Road, Port B"),
              Event("ship", 3, 1, ship_announced, target="o1", field="order:o1:status")]
    req0, req1 = Request("upgrade", tier="premium"), Request("reorder", item="Red lamp")
    visits = [Visit(0, 1, req0, (call("change_plan", tier="premium"),), visit_text(0, 2, 1, "Ann Bee", [], req0)),
              Visit(1, 5, req1, (call("create_order", item="Red lamp", address="2 Elm Road, Port B", card="1111"),),
                    visit_text(1, 2, 5, "Ann Bee", [], req1, "city"), "city")]
    return Episode("planted", "none", "Ann Bee", initial, events, visits, {}, "Port B", trap=True)


def opened(ep=None, key="k"):
    env = ServiceEnv()
    env.open(key, ep or planted())
    return env


def bad_arguments(name: str):
    """Argument sets ``name`` must refuse."""
    want = TOOLS[name][0]
    good = {a: GOOD[a] for a in want}
    cases = [["not", "an", "object"], None, {**good, "extra": "x"}]
    for a in want:
        cases += [{k: v for k, v in good.items() if k != a}, {**good, a: 7}, {**good, a: "  "},
                  {**good, a: "x" * 201}]
    specific = {"tier": "gold", "card": "12345", "address": "Elm Road", "order_id": "order one"}
    cases += [{**good, a: specific[a]} for a in want if a in specific]
    return cases


@pytest.mark.parametrize("name", list(TOOLS))
def test_every_tool_rejects_bad_arguments_with_a_counted_error(name):
    env = opened()
    before = env.rollouts["k"].backend.snapshot()
    cases = bad_arguments(name)
    for args in cases:
        with pytest.raises(ToolError):
            env.call("k", name, args)
    assert env.rollouts["k"].backend.snapshot() == before
    out = env.finish("k", None)
    assert out.tool_errors == len(cases) and out.actions == 0 and not out.success


def test_unknown_tool_unknown_order_and_unknown_rollout_are_tool_errors():
    env = opened()
    for name, args in (("search", {"query": "x"}), ("cancel_order", {"order_id": "o9"}),
                       ("get_order", {"order_id": "o42"})):
        with pytest.raises(ToolError):
            env.call("k", name, args)
    with pytest.raises(ToolError, match="no open rollout"):
        env.call("other", "get_account", {})
    with pytest.raises(TypeError, match="service episodes"):
        env.open("x", object())
    assert env.finish("k", None).tool_errors == 3
    with pytest.raises(ToolError):
        env.finish("k", None)


def test_good_arguments_pass_and_are_stripped():
    assert check_args("update_order_address", {"order_id": " o2 ", "address": "3 Ash Way, Rell"}) == call(
        "update_order_address", order_id="o2", address="3 Ash Way, Rell")
    assert check_args("get_account", {}) == call("get_account")


def test_lookups_read_and_actions_write_the_sqlite_backend_reset_per_rollout():
    env = opened()
    acct = parse_account(env.call("k", "get_account", {}))
    assert acct["address"] == "1 Oak Road, Port A" and acct["plan_status"] == "active"
    assert env.call("k", "change_plan", {"tier": "premium"}).startswith("The plan is now premium")
    assert env.call("k", "cancel_order", {"order_id": "o2"}).startswith("Rejected")  # shipped: return it
    assert env.call("k", "end_visit", {}).startswith("Visit 2 of 2")
    orders = parse_orders(env.call("k", "list_orders", {}))
    assert orders["o1"]["status"] == "shipped"  # the event reached the backend
    assert env.call("k", "end_visit", {}).startswith("Rejected")  # the last visit ends with an answer
    env.open("k", planted())  # a new rollout under the same key starts from the initial state
    assert parse_account(env.call("k", "get_account", {}))["plan"] == "plus"


def test_stale_tracker_planted_cases():
    t = StaleTracker()
    assert t.stale(["address"]) == []  # never changed by an event: never stale
    t.see(["address"], 1)
    t.change("address", 2)
    assert t.stale(["address", "card"]) == ["address"]  # seen before the change
    t.see(["address"], 3)
    assert t.stale(["address"]) == []
    t.change("card", 4)
    assert t.stale(["card"]) == ["card"]  # changed, never seen


def _reorder(env, address):
    return env.call("k", "create_order", {"item": "Red lamp", "address": address, "card": "1111"})


def test_an_action_on_a_value_an_event_changed_since_the_last_check_is_stale():
    env = opened()
    env.call("k", "get_account", {})  # checked before the move: does not cover it
    env.call("k", "end_visit", {})
    _reorder(env, "1 Oak Road, Port A")
    stale = env.rollouts["k"].stale
    assert len(stale) == 1 and stale[0]["fields"] == ["address"] and stale[0]["visit"] == 1
    env.call("k", "cancel_order", {"order_id": "o1"})  # o1 shipped unannounced: stale, and refused
    out = env.finish("k", "<answer>Port A</answer>")
    assert out.stale_actions == 2 and out.forbidden == 1 and not out.success and out.stale_rate == 1.0


def test_checking_announcing_or_writing_a_value_makes_the_action_fresh():
    env = opened()
    env.call("k", "end_visit", {})
    env.call("k", "get_account", {})
    _reorder(env, "2 Elm Road, Port B")
    assert env.rollouts["k"].stale == []
    env = opened(planted(ship_announced=True))
    env.call("k", "end_visit", {})
    env.call("k", "return_order", {"order_id": "o1"})  # the user said it shipped: not stale
    env.call("k", "update_address", {"address": "5 Fir Lane, Port C"})  # the agent's own write
    _reorder(env, "5 Fir Lane, Port C")
    assert env.rollouts["k"].stale == []
    env = opened()
    env.call("k", "change_plan", {"tier": "basic"})  # plan never changed by an event
    env.call("k", "end_visit", {})
    env.call("k", "get_order", {"order_id": "o1"})
    env.call("k", "return_order", {"order_id": "o1"})
    assert env.rollouts["k"].stale == []


def test_the_planted_episode_is_solved_by_checking_and_failed_by_remembering():
    from mosaic.envs.service import ServiceExpert

    ep = planted()
    ep.target = new_state("Ann Bee", "2 Elm Road, Port B", "1111", "premium", "email",
                          [("Red lamp", "shipped"), ("Blue chair", "shipped")])
    ep.target["orders"]["o3"] = {"item": "Red lamp", "status": "placed", "address": "2 Elm Road, Port B"}
    ep.target["orders"]["o1"]["address"] = ep.target["orders"]["o2"]["address"] = "1 Oak Road, Port A"
    good = run_episode(ServiceEnv(), ep, ServiceExpert(True))
    bad = run_episode(ServiceEnv(), ep, ServiceExpert(False))
    assert good.success and good.visits_correct == 2 and good.stale_actions == 0
    assert not bad.success and not bad.state_match and bad.visits_correct == 1 and bad.stale_actions == 1
    assert not bad.answer_correct  # it remembers Port A


def test_the_loop_counts_bad_messages_and_tool_errors():
    class Clumsy:
        def __init__(self):
            self.moves = iter(["no call here", "<tool_call>{oops</tool_call>",
                               tool_call_text("cancel_order", {"order_id": 3}), "<answer>Port B</answer>"])

        def act(self, episode, transcript):
            return next(self.moves)

    out = run_episode(ServiceEnv(), planted(), Clumsy())
    assert out.tool_errors == 1 and out.answer_correct and not out.success and out.visits_reached == 1
