"""CAPO (docs/algorithm.md §5.1): token types, the activation partition and the routed gradient."""

import pytest
import torch

from mosaic.core.loss import policy_loss
from mosaic.train import capo

from .conftest import tiny_model


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from mosaic.agent.chat import ChatFormat
    from mosaic.agent.models.corpus import build_project_tokenizer
    from mosaic.envs.deepsearch import load_split

    split = load_split("validation", preset="cpu", cache_dir=tmp_path_factory.mktemp("cache"))
    return ChatFormat(build_project_tokenizer([split]))


@pytest.mark.parametrize("text, label", [
    ('<tool_call>{"name": "search", "arguments": {"query": "Kelpin founder"}}</tool_call>',
     '<tool_call>{"name": "search"'),
    ('I will look. <tool_call>{"name": "delegate", "arguments": {"question": "Who?"}}</tool_call>',
     '<tool_call>{"name": "delegate"'),
    ("<answer>Velmora Quint</answer>", "<answer>"),
    ("no action at all", ""),
    ('<tool_call>{"arguments": {"query": "x"}, "name": "search"}</tool_call>', "<tool_call>"),
])
def test_the_action_label_is_the_tool_choice_or_the_answer_tag(chat, text, label):
    ids = chat.encode(text + "<|im_end|>")
    piece = capo.piece_fn(chat.tokenizer)
    m = capo.action_mask(ids, piece)
    act = "".join(piece(i) for i, a in zip(ids, m) if a)
    if not label:
        assert not any(m)
        return
    # the action tokens cover the label and spill over by at most one token's text on each side
    assert label in act and len(act) <= len(label) + max(len(piece(i)) for i in ids) * 2
    assert not m[-1]  # the end of the turn is an argument token
    assert any(not a for a in m)


def _batch(chat, model):
    from mosaic.train.batching import collate
    from mosaic.trace.rows import TrainingRow

    turns = ['<tool_call>{"name": "search", "arguments": {"query": "Kelpin founder"}}</tool_call><|im_end|>',
             "<answer>Velmora Quint</answer><|im_end|>"]
    rows = []
    for k, t in enumerate(turns):
        prompt = chat.encode("<|im_start|>user\nWho founded Kelpin?<|im_end|>\n<|im_start|>assistant\n")
        comp = chat.encode(t)
        rows.append(TrainingRow(traj_index=k, session_index=0, kind="main", is_final=True, group_id="g",
                                prompt_ids=prompt, completion_ids=comp, loss_mask=[True] * len(comp),
                                logprobs=[-1.0] * len(comp), reward=float(k), advantage=1.0 - 2 * k))  # fmt: skip
    return collate(rows, range(len(rows)), pad_id=0)


def _losses(model, batch, act):
    from mosaic.train.batching import completion_logprobs

    lp, _ = completion_logprobs(model, batch)
    w = torch.full(batch.loss_mask.shape, 0.05)
    args = (lp, batch.old_logprobs, batch.advantages, batch.loss_mask)
    return (policy_loss(*args, w).loss, policy_loss(*args, w * act).loss, policy_loss(*args, w * ~act).loss)


def test_routed_gradients_touch_disjoint_units_and_one_partition_is_the_plain_loss(chat):
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=3).train()
    batch = _batch(chat, model)
    act = capo.batch_action_mask(batch.completion_ids, batch.loss_mask, capo.piece_fn(chat.tokenizer)) & batch.loss_mask
    assert 0 < int(act.sum()) < int(batch.loss_mask.sum())
    with capo.ActivationMeter(model, capo.positions(batch, act), capo.positions(batch, batch.loss_mask & ~act)) as m:
        full, la, lb = _losses(model, batch, act)
    parts = m.partitions()
    mods = dict(capo.routed_modules(model))
    assert set(parts) == set(mods) and len(mods) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    share = sum(int(p.sum()) for p in parts.values()) / sum(p.numel() for p in parts.values())
    assert 0.05 < share < 0.95  # both partitions hold units
    torch.testing.assert_close(la + lb, full)  # the loss splits exactly by token type

    def grads(fn):
        model.zero_grad(set_to_none=True)
        fn()
        return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}

    def routed(a_on: bool, b_on: bool, use_parts=True):
        def run():
            _, a, b = _losses(model, batch, act)
            capo.routed_backward(model, a * float(a_on), b * float(b_on), parts if use_parts else None)
        return grads(run)

    only_a, only_b, both = routed(True, False), routed(False, True), routed(True, True)
    for name, mod in mods.items():
        rows_a = parts[name]
        ga, gb = only_a[f"model.layers.{name}.weight"], only_b[f"model.layers.{name}.weight"]
        assert ga[~rows_a].abs().sum() == 0 and gb[rows_a].abs().sum() == 0  # disjoint units
        torch.testing.assert_close(both[f"model.layers.{name}.weight"], ga + gb)
    assert any(only_a[f"model.layers.{n}.weight"].abs().sum() > 0 for n in mods)
    assert any(only_b[f"model.layers.{n}.weight"].abs().sum() > 0 for n in mods)
    # shared parameters (embeddings, norms) take both gradients
    assert only_a["model.embed_tokens.weight"].abs().sum() > 0 and only_b["model.embed_tokens.weight"].abs().sum() > 0
    # one partition (every parameter shared) = the plain loss's gradient
    plain = grads(lambda: _losses(model, batch, act)[0].backward())
    one = routed(True, True, use_parts=False)
    for n in plain:
        torch.testing.assert_close(one[n], plain[n], atol=1e-6, rtol=1e-5)


def test_a_capo_step_trains_from_the_cli(tmp_path):
    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    d = tmp_path / "run"
    cfg = load_config("cpu", overrides=[
        f"data.cache_dir={tmp_path / 'cache'}", "data.n_train_tasks=8", "train.steps=1", "algo.capo=true",
        "train.batch_tasks=2", "train.group_size=2", "train.heldout_split=none", "train.tensorboard=false",
        f"train.run_dir={d}"])  # fmt: skip
    assert entrypoints.run_train(cfg) == 0
    import json
    m = json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < m["capo/action_token_share"] < 1 and 0 < m["capo/action_unit_share"] < 1
    assert m["actor/grad_norm"] > 0
