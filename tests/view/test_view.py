"""``mosaic view``: what the page is built from, and that it is one closed file (no browser here)."""

from __future__ import annotations

import json
import random
import re

import pytest

from mosaic.cli import main
from mosaic.core.estimators import ESTIMATORS, EstimatorParams
from mosaic.trace import write_jsonl
from mosaic.train.samples import all_estimator_advantages, sample_records
from mosaic.view.data import ViewError, load_view
from mosaic.view.page import render_page
from tests.train.trajs import compaction_chain, fork

VOCAB = 400


def _trajs():
    rng = random.Random(5)
    return [compaction_chain(rng, 2, tid="a"), compaction_chain(rng, 0, tid="b", reward=0.0), fork(rng, tid="c")]


def _pieces():
    # a piece that would end the data block if it were not escaped, and one that is markup
    return ["</script><script>alert(1)</script>", "<b>", "\n"] + [f"w{i} " for i in range(3, VOCAB)]


def _run_dir(tmp_path):
    trajs = _trajs()
    advs, why = all_estimator_advantages(trajs, EstimatorParams())
    d = tmp_path / "run"
    d.mkdir()
    with open(d / "samples.jsonl", "w") as fh:
        for step in (1, 2):
            for r in sample_records(trajs, range(len(trajs)), step=step, estimator="broadcast", advantages=advs,
                                    unavailable=why):  # fmt: skip
                fh.write(json.dumps(r) + "\n")
    (d / "vocab.json").write_text(json.dumps({"pieces": _pieces()}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "critic/score/mean": s / 4, "bad": float("nan")})
                                             + "\n" for s in (1, 2)))  # fmt: skip
    (d / "config.yaml").write_text("algo:\n  estimator: broadcast\n")
    return d, trajs


def _data_of(page: str) -> dict:
    m = re.search(r'<script id="mosaic-data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def test_a_run_dir_becomes_one_closed_page(tmp_path):
    d, trajs = _run_dir(tmp_path)
    view = load_view(d)
    assert [t["step"] for t in view["samples"]] == [1, 1, 1, 2, 2, 2]
    assert [m["step"] for m in view["metrics"]] == [1, 2] and "bad" not in view["metrics"][0]  # NaN dropped
    assert view["estimators"] == list(ESTIMATORS)
    used = {i for t in trajs for s in t.sessions for i in s.prompt_ids + s.completion_ids}
    assert set(map(int, view["pieces"])) <= used  # only the pieces the page prints
    page = render_page(view)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page  # the page can fetch nothing
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert _data_of(page) == json.loads(json.dumps(view))  # the data block survives "</script>" in a token
    assert page.count("</script>") == 2  # the data block's and the script's own: nothing leaked out


def test_a_rollouts_file_gets_advantages_from_its_graph(tmp_path):
    trajs = _trajs()
    path = tmp_path / "rollouts.jsonl"
    write_jsonl(path, trajs)
    (tmp_path / "vocab.json").write_text(json.dumps({"pieces": _pieces()}))
    view = load_view(path)
    assert view["source"] == "rollouts" and len(view["samples"]) == 3
    rec = view["samples"][0]
    assert "mosaic" in rec["unavailable"] and "gains" in rec["unavailable"]["mosaic"]
    assert "context budget" in rec["unavailable"]["fold"]
    assert all("broadcast" in s["adv"] and s["gain"] is None for s in rec["sessions"])
    assert [s["kind"] for s in view["samples"][2]["sessions"]] == ["main", "subagent"]


def test_bad_inputs_fail_with_a_message(tmp_path, capsys):
    old = tmp_path / "samples.jsonl"
    old.write_text(json.dumps({"step": 1, "trajectory": "x", "sessions": [{"kind": "main", "text": "hi"}]}) + "\n")
    with pytest.raises(ViewError, match="older trainer"):
        load_view(old)
    d, _ = _run_dir(tmp_path)
    (d / "vocab.json").write_text(json.dumps({"pieces": ["a", "b"]}))
    with pytest.raises(ViewError, match="outside the vocabulary"):
        load_view(d)
    (d / "vocab.json").unlink()
    with pytest.raises(ViewError, match="--tokenizer") as err:  # where to find one, an expert rollout's too
        load_view(d)
    assert "checkpoints/*/model" in str(err.value) and "--save-tokenizer wrote" in str(err.value)
    assert main(["view", str(tmp_path / "nowhere")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_writes_the_page_beside_the_run(tmp_path, capsys):
    d, _ = _run_dir(tmp_path)
    assert main(["view", str(d), "--max-trajectories", "4"]) == 0
    page = (d / "view.html").read_text()
    assert len(_data_of(page)["samples"]) == 4
    assert "4 trajectories" in capsys.readouterr().out


def test_a_tokenizer_prints_the_ids_when_no_vocab_is_beside_the_file(tmp_path):
    from pathlib import Path

    import mosaic

    trajs = _trajs()
    write_jsonl(tmp_path / "rollouts.jsonl", trajs)
    model_dir = Path(mosaic.__file__).parent / "assets" / "models" / "tiny-base"
    view = load_view(tmp_path / "rollouts.jsonl", tokenizer=str(model_dir))
    from mosaic.agent.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    some = trajs[0].sessions[0].completion_ids[0]
    assert view["pieces"][str(some)] == tok.decode([some])


@pytest.mark.parametrize("content, said", [
    (b"\xff\xfe\x00garbage", "not UTF-8 text"),
    (b"[1, 2]\n42\n", "a JSON list, not an object"),
    (b"hello world\nnot json\n", "g.x:1: not a JSON line"),
    (b'{"schema": "mosaic.sample"}\n{"broken\n{"schema": "mosaic.sample"}\n', "g.x:2: not a JSON line"),
    (b"garbage\n", "g.x:1: not a JSON line"),  # a whole line (newline after it): not a cut one
], ids=["binary", "not-objects", "text", "corrupt-middle-line", "one-whole-non-json-line"])
def test_a_file_that_is_not_samples_is_one_line_naming_it(tmp_path, capsys, content, said):
    f = tmp_path / "g.x"
    f.write_bytes(content)
    assert main(["view", str(f)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and err.count("\n") == 1


def test_a_bad_output_path_fails_before_any_work(tmp_path, capsys):
    d, _ = _run_dir(tmp_path)
    (tmp_path / "afile").write_text("")
    assert main(["view", str(d), "-o", str(tmp_path / "afile" / "x.html")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["view", str(d), "-o", str(tmp_path)]) == 2
    assert "it is a directory" in capsys.readouterr().err


def _one_sample_file(tmp_path, edit):
    d, _ = _run_dir(tmp_path)
    recs = [json.loads(line) for line in (d / "samples.jsonl").read_text().splitlines()]
    edit(recs)
    # ensure_ascii: a lone surrogate is written as the JSON escape a client can send ("\udfff")
    (d / "samples.jsonl").write_text("".join(json.dumps(r, ensure_ascii=True) + "\n" for r in recs))
    return d


def test_lone_surrogates_and_nan_become_safe_and_counted(tmp_path, capsys):
    # issue 33: an answer posted with "\udfff" crashed the page's write (UnicodeEncodeError) and left a
    # 0-byte view.html; a NaN reward failed the JSON of the page
    def edit(recs):
        recs[0]["answer"] = "Ama \udfff Rell"
        recs[1]["reward"] = float("nan")
    d = _one_sample_file(tmp_path, edit)
    assert main(["view", str(d)]) == 0
    err = capsys.readouterr().err
    assert "made 1 text(s) with lone surrogates safe (U+FFFD) and 1 NaN/infinite number(s) null" in err
    data = _data_of((d / "view.html").read_text(encoding="utf-8"))
    assert data["samples"][0]["answer"] == "Ama \ufffd Rell" and data["samples"][1]["reward"] is None
    assert data["sanitized"] == {"text": 1, "numbers": 1}


def test_a_failed_write_keeps_the_earlier_page_and_leaves_nothing_partial(tmp_path, capsys, monkeypatch):
    import mosaic.view.page as page_mod

    d, _ = _run_dir(tmp_path)
    assert main(["view", str(d)]) == 0
    before = (d / "view.html").read_bytes()
    monkeypatch.setattr(page_mod, "render_page", lambda view: "text with no UTF-8 form: \udfff")
    assert main(["view", str(d)]) == 2
    assert "surrogates not allowed" in capsys.readouterr().err
    assert (d / "view.html").read_bytes() == before
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("content", [b"", b'{"schema": "mosaic.sam'], ids=["empty", "only-a-cut-line"])
def test_a_file_with_no_record_is_refused_not_an_empty_page(tmp_path, capsys, content):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    assert main(["view", str(f), "-o", str(tmp_path / "v.html")]) == 2
    err = capsys.readouterr().err
    assert "no sample or trajectory record in it" in err and "Traceback" not in err
    assert err.count("last line is cut") == (1 if content else 0) and not (tmp_path / "v.html").exists()


def test_the_service_outcome_is_checked_and_shown(tmp_path, capsys):
    env = {"state_match": False, "answer_correct": True, "visits": 2, "visits_correct": 1, "stale_actions": 1,
           "actions": 3}
    d = _one_sample_file(tmp_path, lambda recs: recs[0].__setitem__("env", env))
    assert main(["view", str(d)]) == 0
    assert load_view(d)["samples"][0]["env"] == env
    (tmp_path / "b").mkdir()
    d = _one_sample_file(tmp_path / "b", lambda recs: recs[0].__setitem__("env", {"stale": [1]}))
    assert main(["view", str(d)]) == 2
    assert "samples.jsonl:1: env: must be a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("field, value, said", [
    ("parent", 5, "sessions[0].parent: must be null or an earlier session's index"),
    ("completion", ["a"], "sessions[0].completion: must be a list of integers"),
    ("prefix", [0, 1], "sessions[0].prefix"),
    ("adv", {"grpo": "high"}, "sessions[0].adv"),
])
def test_a_sample_the_page_cannot_compute_with_is_one_line_naming_the_field(tmp_path, capsys, field, value, said):
    d = _one_sample_file(tmp_path, lambda recs: recs[2]["sessions"][0].__setitem__(field, value))
    assert main(["view", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"samples.jsonl:3: {said}" in err and err.count("\n") == 1


HOSTILE = [None, "", "<script>x</script>", "\udfff", 1e308, float("nan"), -1, 10**30, True, [], {}, [1, "a"],
           {"a": "<b>"}]


def sweep_pages(d, out_dir, capsys=None) -> tuple[list, int]:
    """Every top-level and session field of a sample of run dir ``d`` set to each hostile value in turn;
    the pages ``mosaic view`` wrote (copied to ``out_dir``) and the number it refused in one line."""
    base = [json.loads(line) for line in (d / "samples.jsonl").read_text().splitlines()]
    fields = [("top", k) for k in base[0] if k != "schema"] + [("session", k) for k in base[0]["sessions"][0]]
    pages, refused = [], 0
    for where, key in fields:
        for j, value in enumerate(HOSTILE):
            recs = json.loads(json.dumps(base))
            (recs[0] if where == "top" else recs[0]["sessions"][0])[key] = value
            (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            page = out_dir / f"{where}-{key}-{j}.html"
            rc = main(["view", str(d), "-o", str(page)])
            err = capsys.readouterr().err if capsys else ""
            assert rc in (0, 2) and "Traceback" not in err, (where, key, value, err)
            if rc == 0:
                pages.append((page, where, key, value))
            else:
                refused += 1
                assert not page.exists()
                assert not capsys or (err.count("\n") == 1 and "samples.jsonl:1: " in err), (key, value, err)
    return pages, refused


def test_any_one_field_set_to_anything_is_a_page_or_one_line(tmp_path, capsys):
    # the sweep: `mosaic view` writes a page (whose data block parses) or refuses in one line naming
    # the line and field; never a traceback (the browser test opens every page: test_hostile.py)
    d, _ = _run_dir(tmp_path)
    pages, refused = sweep_pages(d, tmp_path, capsys)
    for page, *_ in pages:
        _data_of(page.read_text(encoding="utf-8"))
    print(f"\nsweep: {len(pages)} pages, {refused} refused in one line")
    assert pages and refused


def test_a_cut_last_line_is_skipped_with_a_word(tmp_path, capsys):
    """A samples.jsonl whose writer was killed mid-line: the page shows the whole lines and stderr names
    the cut one (it used to vanish without a word)."""
    d, _ = _run_dir(tmp_path)
    p = d / "samples.jsonl"
    whole = p.read_text()
    p.write_text(whole + whole.splitlines()[0][:50])
    assert len(load_view(d)["samples"]) == 6
    err = capsys.readouterr().err
    assert f"mosaic view: {p}:7: the last line is cut (50 bytes" in err and "skipped" in err


def test_a_tokenizer_path_that_is_not_one_is_named(tmp_path, capsys):
    d, _ = _run_dir(tmp_path)
    (d / "vocab.json").unlink()
    assert main(["view", str(d), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"mosaic view: --tokenizer {tmp_path / 'nope'}: no such directory"
    assert main(["view", str(d), "--tokenizer", str(tmp_path)]) == 2
    assert "no tokenizer files in this directory" in capsys.readouterr().err


@pytest.mark.parametrize("role", [{"index": "1"}, {"index": 0, "text": 3}, {"index": 0, "partner": 5}, "solver"])
def test_a_malformed_role_is_named(role):
    from mosaic.view.data import check_sample

    ok = {"kind": "reset", "parent": None, "prompt": [1], "completion": [2], "mask": [0, 1]}
    check_sample({"sessions": [{**ok, "role": {"index": 0, "text": "searcher", "partner": None}}]})
    with pytest.raises(ViewError, match=r"sessions\[0\]\.role"):
        check_sample({"sessions": [{**ok, "role": role}]})


def test_a_rollouts_file_with_a_cut_last_line_is_one_line_on_stderr(tmp_path, capsys):
    """As for samples.jsonl: a word on stderr, not a Python warning with its source line."""
    import warnings

    path = tmp_path / "rollouts.jsonl"
    write_jsonl(path, _trajs())
    (tmp_path / "vocab.json").write_text(json.dumps({"pieces": _pieces()}))
    path.write_text(path.read_text() + '{"schema": "mosaic.traj')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_view(path)["samples"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("mosaic view: ") and "torn last line" in err and err.count("\n") == 1


@pytest.mark.parametrize("notes", ["oops", {"before": "oops"}, {"after": [1]}])
def test_malformed_reset_notes_are_named_not_shown_as_letters(tmp_path, notes):
    from mosaic.view.data import check_sample

    ok = {"kind": "reset", "parent": None, "prompt": [1], "completion": [2], "mask": [0, 1]}
    check_sample({"sessions": [{**ok, "notes": {"before": ["a fact"], "after": []}}]})
    with pytest.raises(ViewError, match=r"sessions\[0\]\.notes"):
        check_sample({"sessions": [{**ok, "notes": notes}]})
    trajs = _trajs()  # a hand-edited rollouts file: notes_before a string (was shown as ["o","o","p","s"])
    trajs[0].sessions[0].meta["notes_before"] = "oops"
    write_jsonl(tmp_path / "r.jsonl", trajs)
    (tmp_path / "vocab.json").write_text(json.dumps({"pieces": _pieces()}))
    with pytest.raises(ViewError, match=r"trajectory 1 \(a\): sessions\[0\]\.notes"):
        load_view(tmp_path / "r.jsonl")
