"""Training on an external harness's rollouts (``rollout.source=harness``): the served policy behind the
recording proxy, graphs rebuilt from the records, faults dropped and counted, weights swapped in place."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

from mosaic.train import entrypoints, setup
from mosaic.config.loader import ConfigError, load_config

from tests.capture._fidelity import assert_trained_on_sampled_contexts

from .conftest import save_tiny_base

ROOT = Path(__file__).resolve().parents[2]
H = "tests.train._harnesses"
TINY = [
    "model.source=embedded", "model.embedded_preset=tiny", "data.n_train_tasks=8", "data.n_eval_tasks=3",
    "harness.context_budget=320", "harness.max_new_tokens=12", "harness.summary_max_new_tokens=12",
    "harness.max_turns=3", "harness.max_sessions=3", "harness.max_total_turns=6", "harness.subagent_max_turns=2",
    "train.batch_tasks=2", "train.group_size=2", "train.tensorboard=false", "train.plot_every=0",
    "optim.lr=0.01", "optim.micro_batch_size=3", "train.heldout_split=none", "rollout.source=harness",
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory, TINY + [f"rollout.harness={H}:scripted"])


def _cfg(base_dir, tmp_path, *extra):
    d, cache = base_dir
    return load_config("cpu", overrides=TINY + [f"data.cache_dir={cache}", "model.source=dir", f"model.path={d}",
                                                f"train.run_dir={tmp_path / 'run'}", *extra])


def _source(cfg, tmp_path):
    from mosaic.train.external import ExternalRollouts

    model, tok = setup.load_policy(cfg.model.path, device=torch.device("cpu"), dtype=torch.float32)
    split = setup.load_split(cfg, "train")
    return ExternalRollouts(cfg, model, tok, split, tmp_path / "records"), split


def _shape(t):
    return [(s.kind, s.parent, s.edge, s.prompt_ids, s.completion_ids, s.loss_mask, s.is_final) for s in t.sessions]


def test_graphs_trained_on_equal_what_proxy_export_rebuilds(base_dir, tmp_path):
    from mosaic.capture.cli import export
    from mosaic.capture.records import load_records
    from mosaic.trace import load_trajectories

    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={H}:scripted", f"rollout.reward={H}:right_is_one")
    src, split = _source(cfg, tmp_path)
    try:
        assert type(src.server.worker).__name__ == "ProcessWorker" and src.server.worker_fallback is None
        tasks = split.tasks[:2]
        trajs, m = src.collect(tasks, step=0)
        # (a rollout whose random-model summary came out empty cannot be linked: dropped as unbuildable)
        assert m["rollout/kept"] == len(trajs) >= 3 and m["rollout/dropped"] == m["rollout/dropped/unbuildable"], \
            src.last_drop_examples
        kinds = {s.kind for t in trajs for s in t.sessions}
        assert kinds == {"main", "subagent", "compaction"}
        # every call was decoded by the served policy in some batch of at least one sequence
        assert m["rollout/served_batches"] >= 1 and 1 <= m["rollout/served_batch_mean"] <= cfg.rollout.batch_size
        assert m["rollout/served_batches"] * m["rollout/served_batch_mean"] >= m["rollout/calls"]
        assert {t.reward for t in trajs} == {0.0, 1.0}
        assert {t.ground_truth for t in trajs} == {t.answer for t in tasks}
        assert all(t.group_id in {x.id for x in tasks} for t in trajs)
        calls, _ = load_records(src.records_dir)
        assert calls and {c.policy_version for c in calls} == {0}
        for t in trajs:  # every trained token on the context it was sampled from (drift repaired, issue 33)
            assert_trained_on_sampled_contexts(t, calls)
        # docs/algorithm.md §4.4: the compacted main session's end state holds its last tool response (the search result
        # the harness sent only with the compaction instruction), and the compaction starts from that state
        tok = src.server.tokenizer
        for t in trajs:
            for c in (s for s in t.sessions if s.kind == "compaction"):
                parent = t.sessions[c.state_before.session]
                # (which path a compaction takes depends on the random model's replies: tests/capture/test_history_tail.py
                # pins both)
                if c.meta["parent_by"] != "prefix":  # the harness re-rendered a reply (the random model's): left
                    assert c.meta["history_tail"] == "in the compaction's prompt only"
                    continue
                assert c.meta.get("history_tail") == "added to the parent" and parent.kind == "main", c.meta
                assert c.state_before.upto == len(parent.prompt_ids) + len(parent.completion_ids)
                assert parent.state_after.upto is None and not parent.loss_mask[-1]  # ends on inserted tokens
                assert tok.decode(parent.completion_ids[-60:]).endswith("</tool_response><|im_end|>\n")
                assert list(c.prompt_ids[: c.state_before.upto]) == list(parent.prompt_ids) + list(parent.completion_ids)
        # sampling is the trainer's: the harness asked for 0.25, every call was sampled as the trainer samples
        sampled_with = {(c.request_params.get("temperature"), c.request_params.get("top_p")) for c in calls}
        assert sampled_with == {(cfg.rollout.temperature, cfg.rollout.top_p)} and cfg.rollout.temperature != 0.25

        export(str(src.records_dir), str(tmp_path / "exported.jsonl"), rules=src.rules)
        again = {t.id: t for t in load_trajectories(tmp_path / "exported.jsonl")}
        assert sorted(again) == sorted(t.id for t in trajs)
        for t in trajs:
            assert _shape(again[t.id]) == _shape(t)
            assert (again[t.id].reward, again[t.id].ground_truth) == (t.reward, t.ground_truth)
        # the command line's export, given the model's tokenizer, puts the history tails where the trainer does
        from dataclasses import replace

        export(str(src.records_dir), str(tmp_path / "cli.jsonl"), tokenizer=str(base_dir[0]),
               rules=replace(src.rules, render_prefix=None))
        cli = {t.id: t for t in load_trajectories(tmp_path / "cli.jsonl")}
        for t in trajs:
            assert [(s.kind, s.state_before, len(s.completion_ids)) for s in cli[t.id].sessions] == \
                [(s.kind, s.state_before, len(s.completion_ids)) for s in t.sessions]

        with src.hold():  # what the trainer's update does: the next step is answered by version 1
            pass
        trajs2, _ = src.collect(tasks[:1], step=1)
        calls2, _ = load_records(src.records_dir)
        assert {c.policy_version for c in calls2 if c.rollout_id in {t.id for t in trajs2}} == {1}
    finally:
        src.close()


def test_a_worker_process_that_died_is_replaced_at_the_next_step(base_dir, tmp_path, capsys):
    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={H}:scripted", f"rollout.reward={H}:right_is_one")
    src, split = _source(cfg, tmp_path)
    try:
        _, m = src.collect(split.tasks[:1], step=0)
        assert m["rollout/worker_restarts"] == 0 and m["rollout/kept"] >= 1
        src.server.worker.process.kill()  # e.g. the kernel's out-of-memory killer
        src.server.worker.process.join(10)
        _, m = src.collect(split.tasks[:1], step=1)
        assert m["rollout/worker_restarts"] == 1 and m["rollout/kept"] >= 1
        assert "worker process had died; a new one serves" in capsys.readouterr().err
    finally:
        src.close()


def test_faults_drop_the_rollout_count_it_and_keep_serving(base_dir, tmp_path, capsys):
    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={H}:faulty", "rollout.reward=harness", "train.group_size=6",
               "rollout.deadline_s=30")
    src, split = _source(cfg, tmp_path)
    try:
        trajs, m = src.collect(split.tasks[:1], step=0)
        got = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("rollout/dropped/") and v}
        assert got == {"crashed": 1, "timeout": 1, "double_reward": 1, "no_reward": 1, "foreign_id": 1}, \
            src.last_drop_examples
        assert m["rollout/kept"] == 1 and len(trajs) == 1 and trajs[0].reward == 1.0
        assert m["rollout/foreign_requests"] >= 1
        # why each was dropped, rollout by rollout, beside the records (not among them) and on the console
        drops = [json.loads(x) for x in (tmp_path / "drops.jsonl").read_text().splitlines()]
        assert sorted(d["reason"] for d in drops) == sorted(got) and all(d["step"] == 1 for d in drops)
        assert "RuntimeError: harness bug" in next(d["detail"] for d in drops if d["reason"] == "crashed")
        assert "5 of 6 rollouts dropped" in capsys.readouterr().err
        # the proxy and the server are still up, and a late call of the dropped step is refused
        assert httpx.get(src.url + "/healthz", timeout=10).status_code == 200
        r = httpx.post(f"{src.url}/rollouts/{trajs[0].id}/v1/chat/completions", timeout=10,
                       json={"model": "mosaic-policy", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404
        trajs2, m2 = src.collect(split.tasks[1:2], step=1)  # the next step goes on
        assert m2["rollout/kept"] == 1
    finally:
        src.close()


def test_async_and_command_harnesses(base_dir, tmp_path):
    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={H}:async_ok", f"rollout.reward={H}:right_is_one")
    src, split = _source(cfg, tmp_path)
    try:
        trajs, m = src.collect(split.tasks[:1], step=0)
        assert sorted(t.reward for t in trajs) == [0.0, 1.0]
    finally:
        src.close()
    script = tmp_path / "h.py"
    script.write_text(
        "import json, os, urllib.request\n"
        "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', method='POST',\n"
        "    headers={'content-type': 'application/json'}, data=json.dumps({'model': os.environ['MOSAIC_MODEL'],\n"
        "    'max_tokens': 3, 'messages': [{'role': 'user', 'content': os.environ['MOSAIC_QUESTION']}]}).encode())\n"
        "urllib.request.urlopen(req).read()\n"
        "tool = urllib.request.Request(os.environ['MOSAIC_TOOLS_URL'], method='POST', data=json.dumps(\n"
        "    {'name': 'search', 'arguments': {'query': 'x'}}).encode())\n"
        "assert json.loads(urllib.request.urlopen(tool).read())['content']\n"
        "print('right' if os.environ['MOSAIC_SAMPLE'] == '0' else 'wrong')\n")
    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={sys.executable} {script}", f"rollout.reward={H}:right_is_one")
    src, split = _source(cfg, tmp_path / "cmd")
    try:
        trajs, m = src.collect(split.tasks[:1], step=0)
        assert sorted(t.reward for t in trajs) == [0.0, 1.0], src.last_drop_examples
    finally:
        src.close()


def test_mosaic_train_on_a_harness_updates_the_weights_and_logs_session_metrics(base_dir, tmp_path):
    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={ROOT / 'tests/train/_harnesses.py'}:scripted",
               f"rollout.reward={H}:right_is_one", "train.steps=2", "algo.estimator=mosaic")
    entrypoints.run_train(cfg)
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    keys = set(lines[-1])
    for prefix in ("session/", "critic/", "actor/", "rollout/dropped/"):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert lines[-1]["rollout/kept"] >= 3
    # the served model decoded in a worker process over the trainer's weights (rollout.worker_process, the
    # default): the states were scored off its prefix cache, and the sampler agreed with the trainer after step 1
    assert all(m["score/cached_states"] > 0 for m in lines)
    assert lines[-1]["training/rollout_actor_probs_pearson_corr"] > 0.99
    from mosaic.capture.records import load_records

    calls, rewards = load_records(run / "records")
    assert {c.policy_version for c in calls} == {0, 1}  # step 2 answered by the weights step 1 made
    before, _ = setup.load_policy(cfg.model.path, device=torch.device("cpu"), dtype=torch.float32)
    from mosaic.train.checkpoint import find_latest

    ckpt = find_latest(run) / "model"
    after, _ = setup.load_policy(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    diff = sum(float((a - b).abs().sum()) for a, b in zip(after.parameters(), before.parameters()))
    assert diff > 0


def test_the_plain_example_harness_trains_and_a_killed_run_resumes(base_dir, tmp_path, monkeypatch):
    """examples/harness/plain.py itself (docs/capture.md's command, on the tiny model): a step trains on its
    rollouts and logs per-session metrics; a run killed after its checkpoint resumes there, with no
    half-step (metrics for each step once, the final weights differ from the resumed-from ones)."""
    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={ROOT / 'examples/harness/plain.py'}:run", "train.steps=2",
               "train.save_every=1", "algo.estimator=mosaic", "rollout.deadline_s=120")
    from mosaic.train.external import ExternalRollouts

    real = ExternalRollouts.collect

    def dies_in_step_two(self, tasks, step):
        out = real(self, tasks, step)
        if step == 1:
            raise KeyboardInterrupt  # killed mid-step: after its rollouts, before its update
        return out

    monkeypatch.setattr(ExternalRollouts, "collect", dies_in_step_two)
    with pytest.raises(KeyboardInterrupt):
        entrypoints.run_train(cfg)
    run = tmp_path / "run"
    first = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(first) == 1 and any(k.startswith("session/") for k in first[0])
    assert first[0]["rollout/kept"] >= 1
    monkeypatch.setattr(ExternalRollouts, "collect", real)
    entrypoints.run_train(cfg)  # resume=auto
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2]
    from mosaic.train.checkpoint import find_latest

    assert find_latest(run).name == "ckpt-2"


def test_a_harness_that_cannot_be_loaded_fails_before_the_warm_start(base_dir, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n\ndef run(task):\n    return 'x'\n")
    for spec, key in ((f"rollout.harness={tmp_path / 'nope.py'}:run", "rollout.harness"),
                      (f"rollout.harness={broken}:run", "rollout.harness"),
                      (f"rollout.reward={tmp_path / 'nope.py'}:fn", "rollout.reward")):
        cfg = _cfg(base_dir, tmp_path, f"rollout.harness={H}:scripted", spec)
        with pytest.raises(ConfigError, match=f"config key '{key}': cannot load"):
            entrypoints.run_train(cfg)
        assert not (tmp_path / "run").exists()  # no run dir, no warm start, no evaluation


def test_a_harness_file_is_imported_once_and_can_import_its_neighbours(tmp_path, monkeypatch):
    """The config check and the trainer both load ``file.py:function``: the file's top-level code runs once
    while it is unchanged (again once edited), and a module beside it can be imported."""
    from mosaic.train.usercode import check_callables, load_callable

    (tmp_path / "agent_helpers_xyz.py").write_text("ANSWER = 'helper'\n")
    agent = tmp_path / "agent_once_xyz.py"
    log = tmp_path / "imports.log"
    agent.write_text(f"import agent_helpers_xyz\nopen({str(log)!r}, 'a').write('x')\n\n"
                     "def run(task):\n    return agent_helpers_xyz.ANSWER\n")
    cfg = load_config("cpu", overrides=[f"rollout.harness={agent}:run", "rollout.source=harness"])
    check_callables(cfg.rollout)
    fn = load_callable(f"{agent}:run", "rollout.harness")
    assert fn(None) == "helper" and log.read_text() == "x"
    agent.write_text(agent.read_text().replace("return agent_helpers_xyz.ANSWER", "return 'edited'"))
    os.utime(agent, ns=(agent.stat().st_atime_ns, agent.stat().st_mtime_ns + 10**9))
    assert load_callable(f"{agent}:run", "rollout.harness")(None) == "edited" and log.read_text() == "xx"
    # installed packages win over files beside the harness (a harness called json.py can import json); a
    # dataclass under postponed annotations works; an exit at import time is an error naming the key
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    site = tmp_path / "site" / "fake_pkg_xyz"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("VALUE = 'installed'\n")
    monkeypatch.syspath_prepend(str(site.parent))
    (shadow / "fake_pkg_xyz.py").write_text("from fake_pkg_xyz import VALUE\n\ndef run(task):\n    return VALUE\n")
    assert load_callable(f"{shadow / 'fake_pkg_xyz.py'}:run", "rollout.harness")(None) == "installed"
    (shadow / "dc.py").write_text("from __future__ import annotations\nfrom dataclasses import dataclass\n\n"
                                  "@dataclass\nclass A:\n    x: int = 1\n\ndef run(task):\n    return A().x\n")
    assert load_callable(f"{shadow / 'dc.py'}:run", "rollout.harness")(None) == 1
    (shadow / "bye.py").write_text("import sys\nsys.exit('no key set')\n")
    with pytest.raises(ValueError, match="rollout.harness: cannot load .*SystemExit: no key set"):
        load_callable(f"{shadow / 'bye.py'}:run", "rollout.harness")


def test_a_shell_command_is_taken_as_written():
    """A text field gets the text as written when YAML would read something else (a command `true`, or
    one with `: ` in it)."""
    for cmd in ("true", "sh -c 'echo a: b'", "null", "[x]"):
        assert load_config("cpu", overrides=[f"rollout.harness={cmd}"]).rollout.harness == cmd
    assert load_config("cpu", overrides=["rollout.harness='quoted'"]).rollout.harness == "quoted"
    with pytest.raises(ConfigError, match="train.steps"):
        load_config("cpu", overrides=["train.steps=true"])  # other types are unchanged


def test_bad_harness_settings_fail_before_any_work(base_dir, tmp_path):
    with pytest.raises(ConfigError, match="rollout.harness"):
        _cfg(base_dir, tmp_path, "rollout.harness=")
    with pytest.raises(ConfigError, match="rollout.reward"):
        _cfg(base_dir, tmp_path, f"rollout.harness={H}:scripted", "rollout.reward=not a function")
    cfg = _cfg(base_dir, tmp_path, "rollout.harness=no_such_module:run")
    with pytest.raises(ValueError, match="rollout.harness: cannot load 'no_such_module:run'"):
        _source(cfg, tmp_path)


def test_offline_replay_of_captured_records(base_dir, tmp_path):
    """Records captured through the proxy train again later, off-policy (the ratio against the recorded log-probs)."""
    from mosaic.train.replay import RecordsReplay

    cfg = _cfg(base_dir, tmp_path, f"rollout.harness={H}:scripted", f"rollout.reward={H}:right_is_one")
    src, split = _source(cfg, tmp_path)
    try:
        src.collect(split.tasks[:2], step=0)
    finally:
        src.close()
    from mosaic.capture.records import CallRecord, RecordWriter

    w = RecordWriter(src.records_path)  # a rollout without a reward and a torn last line: skipped, not fatal
    w.write(CallRecord(call_id="c", rollout_id="zz", seq=0, endpoint="chat", prompt_ids=[1], completion_ids=[2],
                       logprobs=[-0.5]))
    w.close()
    with open(src.records_path, "a") as fh:
        fh.write('{"type": "ca')
    rcfg = _cfg(base_dir, tmp_path, "rollout.source=records", f"rollout.records={src.records_dir}",
                "train.steps=2", "train.batch_tasks=1", "algo.estimator=mosaic", f"train.run_dir={tmp_path / 'replay'}")
    replay = RecordsReplay(rcfg)
    assert replay.n_groups == 2 and replay.dropped["no_reward"] == 1
    entrypoints.run_train(rcfg)
    lines = [json.loads(x) for x in (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert all(ln["rollout/replayed"] >= 1 and ln["train/tasks"] == 1 for ln in lines)
    assert "actor/ratio_max" in lines[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "records.jsonl").write_text("")
    with pytest.raises(ValueError, match="no usable rollout"):
        RecordsReplay(_cfg(base_dir, tmp_path, "rollout.source=records", f"rollout.records={empty}"))
    (empty / "records.jsonl").write_text('{"not": "a record"}\n{}\n')
    with pytest.raises(ValueError, match="rollout.records: .*not a Mosaic capture record"):
        RecordsReplay(_cfg(base_dir, tmp_path, "rollout.source=records", f"rollout.records={empty}"))


def test_the_service_family_through_an_external_harness(base_dir, tmp_path):
    """Issue 29 item 6: ``rollout.source=harness`` on the service family. Each rollout gets its own account
    backend behind the tool endpoint; the default reward is the family's (backend state + answer) and its
    outcome (stale actions, visits) lands in the trajectory; a bad tool call is the harness's error, not
    the trainer's; every backend is freed after the step."""
    from tests.train import _harnesses

    cfg = _cfg(base_dir, tmp_path, "data.family=service", f"rollout.harness={H}:service_expert")
    src, split = _source(cfg, tmp_path)
    try:
        _harnesses.EPISODES.update({e.id: e for e in split.tasks})
        trajs, m = src.collect(split.tasks[:2], 0)
        assert m["rollout/kept"] == 4 and all(t.reward == 1.0 for t in trajs), m
        assert all(t.meta["env"]["success"] and t.meta["env"]["stale_actions"] == 0 for t in trajs)
        assert all(t.meta["env"]["tool_errors"] == (1 if t.meta["harness"]["sample"] == 1 else 0) for t in trajs)
        assert src.env.rollouts == {}
        with pytest.raises(ValueError, match="no open rollout"):
            src._tool("nobody", "get_account", {})
    finally:
        src.close()
    # the captured rollouts replay off-policy (rollout.source=records) with the family's outcome restored
    from mosaic.train.replay import RecordsReplay

    rcfg = _cfg(base_dir, tmp_path, "data.family=service", "rollout.source=records",
                f"rollout.records={tmp_path / 'records'}", f"train.run_dir={tmp_path / 'replay'}", "train.steps=1",
                "train.batch_tasks=2")  # fmt: skip
    replay = RecordsReplay(rcfg)
    got = [t for g in replay.groups.values() for t in g]
    assert len(got) == 4 and all(t.reward == 1.0 and t.meta["env"]["success"] for t in got)
    assert sorted(t.meta["env"]["tool_errors"] for t in got) == [0, 0, 1, 1]
    entrypoints.run_train(rcfg)
    line = json.loads((tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["rollout/replayed"] >= 1 and line["env/stale_rate"] == 0.0 and line["env/visits_correct"] > 0
