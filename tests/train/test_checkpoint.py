import json
import random

import numpy as np
import pytest
import torch

from mosaic.train import checkpoint as ck
from mosaic.config.loader import OptimConfig
from mosaic.train.optim import build_optimizer, build_scheduler, lr_factor


class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.2)  # consumes the global torch RNG: tests its restore
        self.l2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.l2(self.drop(torch.tanh(self.l1(x))))


def _setup(seed: int, total: int):
    net = Net(seed)
    cfg = OptimConfig(lr=1e-2, warmup_steps=3, lr_schedule="cosine", weight_decay=0.01)
    opt = build_optimizer(net, cfg)
    return net, opt, build_scheduler(opt, cfg, total)


def _step(net, opt, sched, gen: torch.Generator, nprng: np.random.Generator):
    x = torch.randn(16, 8, generator=gen)
    noise = torch.from_numpy(nprng.normal(size=(16, 1))).float()
    y = x.sum(-1, keepdim=True) + 0.1 * noise + random.random()  # python RNG too
    loss = torch.nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _seed_all(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def test_resume_equals_uninterrupted(tmp_path):
    total, k = 12, 5
    _seed_all(1)
    net, opt, sched = _setup(0, total)
    gen, nprng = torch.Generator().manual_seed(7), np.random.default_rng(7)
    losses_full = [_step(net, opt, sched, gen, nprng) for _ in range(total)]
    ref = {n: p.detach().clone() for n, p in net.named_parameters()}

    _seed_all(1)
    net2, opt2, sched2 = _setup(0, total)
    gen2, nprng2 = torch.Generator().manual_seed(7), np.random.default_rng(7)
    losses = [_step(net2, opt2, sched2, gen2, nprng2) for _ in range(k)]
    ck.save_checkpoint(tmp_path, k, model=net2, optimizer=opt2, scheduler=sched2,
                       generators={"data": gen2, "np": nprng2}, state={"cursor": k * 16})
    # A fresh process: different init, RNGs scrambled; everything must come from the checkpoint.
    _seed_all(999)
    net3, opt3, sched3 = _setup(123, total)
    gen3, nprng3 = torch.Generator().manual_seed(0), np.random.default_rng(0)
    st = ck.load_checkpoint(ck.resolve_resume("auto", tmp_path), model=net3, optimizer=opt3, scheduler=sched3,
                            generators={"data": gen3, "np": nprng3})
    assert st.step == k and st.state == {"cursor": k * 16}
    losses += [_step(net3, opt3, sched3, gen3, nprng3) for _ in range(total - k)]
    assert losses == pytest.approx(losses_full, abs=1e-6)
    for n, p in net3.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n], atol=1e-6, rtol=0)
    assert sched3.get_last_lr() == pytest.approx(sched.get_last_lr())
    # The run moved: the test could fail.
    assert any(not torch.equal(p.detach(), q.detach()) for p, q in zip(Net(0).parameters(), net3.parameters()))


def test_kill_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    net, opt, sched = _setup(0, 10)
    gen = torch.Generator().manual_seed(3)
    _step(net, opt, sched, gen, np.random.default_rng(0))
    good = ck.save_checkpoint(tmp_path, 1, model=net, optimizer=opt, scheduler=sched, generators={"g": gen})
    saved = {n: p.detach().clone() for n, p in net.named_parameters()}
    _step(net, opt, sched, gen, np.random.default_rng(0))

    real_save = torch.save

    def dying_save(obj, f, *a, **kw):  # write half a file, then "get killed"
        if str(f).endswith("scheduler.pt"):
            with open(f, "wb") as fh:
                fh.write(b"\x80\x02partial")
            raise KeyboardInterrupt("killed")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, model=net, optimizer=opt, scheduler=sched, generators={"g": gen})
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "checkpoints" / "ckpt-2.tmp").exists()
    assert ck.find_latest(tmp_path) == good
    net2, opt2, sched2 = _setup(5, 10)
    st = ck.load_checkpoint(ck.find_latest(tmp_path), model=net2, optimizer=opt2, scheduler=sched2,
                            generators={"g": torch.Generator()})
    assert st.step == 1
    for n, p in net2.named_parameters():
        assert torch.equal(p.detach(), saved[n])
    # The next save clears the stale tmp dir.
    ck.save_checkpoint(tmp_path, 2, model=net, optimizer=opt, scheduler=sched)
    assert not (tmp_path / "checkpoints" / "ckpt-2.tmp").exists()
    assert ck.find_latest(tmp_path).name == "ckpt-2"


def test_corrupt_or_unfinished_dirs_are_ignored(tmp_path):
    net, opt, sched = _setup(0, 10)
    a = ck.save_checkpoint(tmp_path, 1, model=net, optimizer=opt, keep_last=5)
    b = ck.save_checkpoint(tmp_path, 2, model=net, optimizer=opt, keep_last=5)
    assert ck.find_latest(tmp_path) == b
    # A truncated file in the newest: its manifest no longer matches -> fall back to the previous one.
    f = b / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:10])
    assert not ck.is_complete(b) and ck.find_latest(tmp_path) == a
    # A directory renamed without a manifest, and a pointer to a missing dir.
    (tmp_path / "checkpoints" / "ckpt-9").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("ckpt-42")
    assert ck.find_latest(tmp_path) == a
    with pytest.raises(FileNotFoundError):
        ck.load_checkpoint(b, model=net)
    with pytest.raises(FileNotFoundError):
        ck.resolve_resume(str(b), tmp_path)
    assert ck.resolve_resume("never", tmp_path) is None


def test_keep_last_prunes(tmp_path):
    net, opt, _ = _setup(0, 10)
    for s in range(1, 6):
        ck.save_checkpoint(tmp_path, s, model=net, optimizer=opt, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [4, 5]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "ckpt-5"
    manifest = json.loads((tmp_path / "checkpoints" / "ckpt-5" / "COMPLETE").read_text())
    assert "model/model.safetensors" in manifest["files"]


def test_hf_model_and_tokenizer_round_trip(tmp_path, tokenizer):
    from .conftest import tiny_model

    m = tiny_model(vocab_size=len(tokenizer), seed=0)
    d = ck.save_checkpoint(tmp_path, 3, model=m, tokenizer=tokenizer)
    m2 = tiny_model(vocab_size=len(tokenizer), seed=1)
    ck.load_checkpoint(d, model=m2)
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = "<|im_start|>assistant\n<answer>Velmora Quint</answer><|im_end|>"
    for tok2 in (PreTrainedTokenizerFast.from_pretrained(d / "model"),
                 AutoTokenizer.from_pretrained(str(d / "model"), local_files_only=True)):
        assert tok2(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_lr_factor():
    assert [lr_factor(s, warmup_steps=2, total_steps=6, schedule="constant") for s in range(4)] == [0.5, 1, 1, 1]
    assert lr_factor(2, warmup_steps=2, total_steps=6, schedule="cosine") == 1.0
    assert lr_factor(6, warmup_steps=2, total_steps=6, schedule="cosine") == pytest.approx(0.0)


# ----------------------------------------------------------------------------- integrity (issue 11)


def _three(tmp_path):
    net, opt, sched = _setup(0, 10)
    out = []
    for s in (1, 2, 3):
        _step(net, opt, sched, torch.Generator().manual_seed(s), np.random.default_rng(s))
        out.append(ck.save_checkpoint(tmp_path, s, model=net, optimizer=opt, scheduler=sched, keep_last=5))
    return net, opt, sched, out


def _flip(f, offset, n):
    raw = bytearray(f.read_bytes())
    for i in range(offset, min(offset + n, len(raw))):
        raw[i] ^= 0xFF
    f.write_bytes(bytes(raw))


def test_manifest_carries_a_sha256_per_file(tmp_path):
    import hashlib

    _, _, _, (a, _, _) = _three(tmp_path)
    m = json.loads((a / "COMPLETE").read_text())
    assert set(m["sha256"]) == set(m["files"]) and "optimizer.pt" in m["sha256"]
    for name, h in m["sha256"].items():
        assert hashlib.sha256((a / name).read_bytes()).hexdigest() == h
    assert ck.verify_checkpoint(a) is None


def test_flipped_weight_bytes_fail_the_hash_and_auto_falls_back(tmp_path, capsys):
    # issue 11: 4 KB flipped in the weights (same size) resumed silently.
    net, opt, sched, (a, b, c) = _three(tmp_path)
    f = c / "model" / "model.safetensors"
    size = f.stat().st_size
    _flip(f, size - 256, 256)  # the last tensor bytes (the net is tiny), header intact
    assert f.stat().st_size == size and ck.is_complete(c)  # names and sizes alone do not see it
    assert "sha256 mismatch in model/model.safetensors" in ck.verify_checkpoint(c)
    with pytest.raises(ck.CheckpointError, match="sha256 mismatch in model/model.safetensors"):
        ck.load_checkpoint(c, model=_setup(1, 10)[0])
    assert ck.resolve_resume("auto", tmp_path) == b
    err = capsys.readouterr().err
    assert "skipping" in err and "ckpt-3" in err and "sha256 mismatch in model/model.safetensors" in err
    with pytest.raises(FileNotFoundError, match="sha256 mismatch"):  # an explicit path that does not verify
        ck.resolve_resume(str(c), tmp_path)
    assert ck.resolve_resume(str(tmp_path), tmp_path) == b  # a run dir: its newest good one


def test_corrupt_header_optimizer_and_missing_file_are_each_named(tmp_path, capsys):
    # issue 11: a corrupt newest checkpoint crashed with a traceback although a good older one existed.
    net, opt, sched, (a, b, c) = _three(tmp_path)
    _flip(c / "model" / "model.safetensors", 0, 8)  # header length
    _flip(b / "optimizer.pt", 0, 64)  # zip magic
    assert "corrupt safetensors header in model.safetensors" in ck.verify_checkpoint(c)
    assert "corrupt optimizer.pt" in ck.verify_checkpoint(b)
    assert ck.resolve_resume("auto", tmp_path) == a
    err = capsys.readouterr().err
    assert "ckpt-3: corrupt safetensors header" in err and "ckpt-2: corrupt optimizer.pt" in err
    (a / "scheduler.pt").unlink()
    assert ck.verify_checkpoint(a) == "missing file scheduler.pt"
    assert ck.resolve_resume("auto", tmp_path) is None  # nothing verifies: a fresh run, not a crash
    assert "ckpt-1: missing file scheduler.pt" in capsys.readouterr().err


def test_manifest_without_hashes_is_still_checked_structurally(tmp_path):
    _, _, _, (a, b, c) = _three(tmp_path)
    m = json.loads((c / "COMPLETE").read_text())
    del m["sha256"]  # a checkpoint written before content hashes
    (c / "COMPLETE").write_text(json.dumps(m))
    assert ck.verify_checkpoint(c) is None
    _flip(c / "optimizer.pt", 0, 64)
    assert "corrupt optimizer.pt" in ck.verify_checkpoint(c)
    assert ck.resolve_resume("auto", tmp_path) == b


def test_latest_pointer_cannot_leave_the_run_dir(tmp_path, capsys):
    import os

    run, other = tmp_path / "run", tmp_path / "other"
    net, opt, _ = _setup(0, 10)
    own = ck.save_checkpoint(run, 1, model=net, optimizer=opt)
    foreign = ck.save_checkpoint(other, 7, model=net, optimizer=opt)
    ptr = run / "checkpoints" / "latest"
    for text in ("../../other/checkpoints/ckpt-7", str(foreign), "ckpt-7/../../../other/checkpoints/ckpt-7"):
        ptr.write_text(text)
        assert ck.find_latest(run) == own, text
        assert ck.resolve_resume("auto", run) == own, text
        assert "refused" in capsys.readouterr().err
    # A checkpoint directory that is a symlink out of the run dir is neither followed nor listed.
    os.symlink(foreign, run / "checkpoints" / "ckpt-9")
    ptr.write_text("ckpt-9")
    assert ck.find_latest(run) == own
    assert ck.resolve_resume("auto", run) == own
    assert [s for s, _ in ck.list_checkpoints(run)] == [1]
    # The pointer file itself a symlink to a file outside.
    ptr.unlink()
    (tmp_path / "evil").write_text("ckpt-9")
    os.symlink(tmp_path / "evil", ptr)
    assert ck.find_latest(run) == own


def test_config_diff_lists_changed_keys():
    old = "algo:\n  estimator: mosaic\n  lam: 0.1\noptim:\n  lr: 1.0e-05\n  betas: [0.9, 0.999]\n"
    new = "algo:\n  estimator: grpo\n  lam: 0.1\noptim:\n  lr: 0.5\n  betas: [0.9, 0.95]\n  extra: 1\n"
    assert ck.config_diff(old, new) == ["algo.estimator: 'mosaic' -> 'grpo'", "optim.betas: [0.9, 0.999] -> [0.9, 0.95]",
                                        "optim.extra: (absent) -> 1", "optim.lr: 1e-05 -> 0.5"]
    assert ck.config_diff(old, old) == []


def test_resume_with_a_changed_config_needs_force(tmp_path, capsys):
    # issue 11: resuming with a changed estimator and lr=0.5 gave no warning.
    from mosaic.config.loader import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(overrides=[f"train.run_dir={run}"])
    (run / "config.yaml").write_text(dump_config(cfg))
    same = load_config(overrides=[f"train.run_dir={run}", "train.resume=never", "train.resume_force=true"])
    assert ck.check_resume_config(run, dump_config(same), force=False) == []  # resume keys are free
    changed = dump_config(load_config(overrides=[f"train.run_dir={run}", "algo.estimator=broadcast", "optim.lr=0.5"]))
    with pytest.raises(ck.CheckpointError) as exc:
        ck.check_resume_config(run, changed, force=False)
    msg = str(exc.value)
    assert f"algo.estimator: {cfg.algo.estimator!r} -> 'broadcast'" in msg and "optim.lr:" in msg and "-> 0.5" in msg
    assert "train.resume_force=true" in msg
    got = ck.check_resume_config(run, changed, force=True)
    assert len(got) == 2 and "algo.estimator" in capsys.readouterr().err
    # More steps under a constant schedule extend the run (said, not refused); under cosine they change the
    # schedule of the steps still to come, so they need force like any other change.
    more = dump_config(load_config(overrides=[f"train.run_dir={run}", f"train.steps={cfg.train.steps + 5}"]))
    assert ck.check_resume_config(run, more, force=False) == []
    assert f"train.steps: {cfg.train.steps} -> {cfg.train.steps + 5}" in capsys.readouterr().err
    cosine = [f"train.run_dir={run}", "optim.lr_schedule=cosine"]
    (run / "config.yaml").write_text(dump_config(load_config(overrides=cosine)))
    longer = load_config(overrides=[*cosine, f"train.steps={cfg.train.steps + 5}"])
    with pytest.raises(ck.CheckpointError, match="train.steps"):
        ck.check_resume_config(run, dump_config(longer), force=False)
    # No config.yaml (e.g. resuming a checkpoint copied elsewhere): the estimator saved in its state.
    (run / "config.yaml").unlink()
    with pytest.raises(ck.CheckpointError, match="algo.estimator"):
        ck.check_resume_config(run, changed, force=False, state={"estimator": cfg.algo.estimator})


def test_a_config_key_removed_since_the_run_started_does_not_block_resume(tmp_path):
    # A field that no longer exists cannot change what the run does (e.g. harness.subagent_states).
    import yaml

    from mosaic.config.loader import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(overrides=[f"train.run_dir={run}"])
    saved = yaml.safe_load(dump_config(cfg))
    saved["harness"]["subagent_states"] = "merge"
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert ck.check_resume_config(run, dump_config(cfg), force=False) == []
    saved["optim"]["lr"] = 0.5  # a real change still needs the flag
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ck.CheckpointError, match="optim.lr"):
        ck.check_resume_config(run, dump_config(cfg), force=False)


def test_the_cached_warm_start_result_is_reused_only_under_the_same_evaluation(tmp_path, monkeypatch):
    """A resumed run reuses the warm start's held-out result; one forced on under another harness (here, another
    reset partner) evaluates again instead of comparing against a result measured under the old one."""
    from types import SimpleNamespace

    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    calls = []

    def fake_evaluate(cfg, *a, out=None, **k):
        calls.append(cfg.harness.partner)
        out.write_text("")
        return SimpleNamespace(accuracy=0.5, lo=0.4, hi=0.6, outcomes=[], metrics={}, line=lambda label: label)

    monkeypatch.setattr(entrypoints, "evaluate", fake_evaluate)
    roles = 'harness.reset_roles=["a: search", "b: answer"]'
    cfg = {p: load_config("cpu", overrides=["harness.mode=reset", roles, f"harness.partner={p}", "data.n_eval_tasks=2"])
           for p in ("self", "expert")}
    for partner in ("self", "self", "expert", "expert"):
        entrypoints._heldout_eval(cfg[partner], tmp_path, "warmstart", None, None, None, SimpleNamespace(tasks=[]))
    assert calls == ["self", "expert"]
    meta = tmp_path / "eval_warmstart.json"  # a cache written before the key was kept: reused as it was
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "key"}))
    entrypoints._heldout_eval(cfg["self"], tmp_path, "warmstart", None, None, None, SimpleNamespace(tasks=[]))
    assert calls == ["self", "expert"]
