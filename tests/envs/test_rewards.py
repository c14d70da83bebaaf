import pytest
from hypothesis import given
from hypothesis import strategies as st

from mosaic.envs.rewards import (
    count_statuses, exact_match, extract_answer, normalize_answer, score_answer, token_f1,
)


@pytest.mark.parametrize("raw, norm", [
    ("Port Osk", "port osk"),
    ("  The   Port Osk. ", "port osk"),
    ("an Osk, a Port!", "osk port"),
    ("Port-Osk", "port osk"),
    ("Thelma Osk", "thelma osk"),  # "the" inside a word is kept
    ("A", ""),
    ("“Varnel” Osk’s", "varnel osk s"),
])
def test_normalize(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_and_f1():
    assert exact_match("the Port Osk!", "port osk") == 1.0
    assert exact_match("Port Oska", "Port Osk") == 0.0
    assert token_f1("Varnel Osk Works", "Varnel Osk") == pytest.approx(0.8)
    assert token_f1("Port Osk", "the port osk") == 1.0
    assert token_f1("Kel", "Port Osk") == 0.0
    assert token_f1("", "Port Osk") == 0.0


@pytest.mark.parametrize("text, answer, status", [
    ("<answer>Port Osk</answer>", "Port Osk", "ok"),
    ("thinking... <answer> Port Osk </answer> done", "Port Osk", "ok"),
    ("<answer>A</answer> no wait <answer>B</answer>", "B", "ok"),  # the last complete one
    ("<answer>A</answer> then <answer>B", "A", "ok"),  # trailing unclosed is ignored
    ("<answer><answer>X</answer></answer>", "X", "ok"),  # nested: innermost of the last pair
    ("<answer>outer <answer>X</answer>", "X", "ok"),
    ("<ANSWER>Port Osk</Answer>", "Port Osk", "ok"),
    ("<answer>Port\nOsk</answer>", "Port\nOsk", "ok"),
    ("no tags at all", None, "missing"),
    ("", None, "missing"),
    ("<answer>Port Osk", None, "malformed"),  # unclosed
    ("Port Osk</answer>", None, "malformed"),  # stray close
    ("</answer>X<answer>", None, "malformed"),  # reversed
    ("<answer></answer>", None, "empty"),
    ("<answer>   </answer>", None, "empty"),
    ("<answer><answer></answer></answer>", None, "empty"),
])
def test_extract(text, answer, status):
    assert extract_answer(text) == (answer, status)


def test_score_answer_statuses_and_counts():
    scores = [
        score_answer("<answer>the port osk</answer>", "Port Osk"),
        score_answer("<answer>Port Oska</answer>", "Port Osk"),
        score_answer("Port Osk", "Port Osk"),
        score_answer("<answer>Port Osk", "Port Osk"),
        score_answer("<answer></answer>", "Port Osk"),
    ]
    assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [s.status for s in scores] == ["ok", "ok", "missing", "malformed", "empty"]
    assert count_statuses(scores) == {"ok": 2, "missing": 1, "malformed": 1, "empty": 1}
    assert score_answer("<answer>Varnel Osk Works</answer>", "Varnel Osk", metric="f1").reward == \
        pytest.approx(0.8)


def test_bad_ground_truth_and_metric_raise():
    with pytest.raises(ValueError, match="ground_truth"):
        score_answer("<answer>x</answer>", "")
    with pytest.raises(ValueError, match="ground_truth"):
        score_answer("<answer>x</answer>", None)
    with pytest.raises(ValueError, match="metric"):
        score_answer("<answer>x</answer>", "x", metric="bleu")


def test_non_string_model_output_scores_zero():
    assert score_answer(None, "x").status == "malformed"


@given(st.text())
def test_never_raises_and_reward_in_range(text):
    for metric in ("em", "f1"):
        s = score_answer(text, "Port Osk", metric=metric)
        assert 0.0 <= s.reward <= 1.0
        assert s.status in ("ok", "missing", "malformed", "empty")
        assert (s.answer is None) == (s.status != "ok")


@given(st.text(alphabet=st.characters(blacklist_characters="<>"), min_size=1))
def test_wrapped_answer_matches_itself(name):
    if normalize_answer(name):
        assert score_answer(f"blah <answer>{name}</answer>", name).reward == 1.0
