"""The project tokenizer: byte-level round trip, special tokens, save/load, chat template."""

import pytest
from hypothesis import given, settings, strategies as st

from mosaic.agent.tokenizer import (
    IM_END, IM_START, PAD_TOKEN, TAG_TOKENS, load_tokenizer, save_tokenizer, train_tokenizer,
)

CORPUS = [
    "Ruo Ces works for Hefind Trading House, headquartered in Holgrairk Heses.",
    "The founder of Varnel Osk is Ama Rell. Born in Tessaly, she studied at Oru University.",
    '<tool_call>{"name": "search", "arguments": {"query": "Ruo Ces works"}}</tool_call>',
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=400)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_special_and_tag_tokens_are_single_ids(tok):
    for t in (PAD_TOKEN, IM_START, IM_END, *TAG_TOKENS):
        ids = tok(f"a{t}b", add_special_tokens=False)["input_ids"]
        assert tok.convert_tokens_to_ids(t) in ids, t
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    # tags survive skip_special_tokens (they are not special), ChatML markers do not
    text = tok.decode(tok("<|im_start|>x<answer>y</answer><|im_end|>", add_special_tokens=False)["input_ids"],
                      skip_special_tokens=True)
    assert text == "x<answer>y</answer>"


def test_corpus_words_are_compact(tok):
    assert len(tok(" Hefind Trading House", add_special_tokens=False)["input_ids"]) <= 4
    assert len(tok(CORPUS[2], add_special_tokens=False)["input_ids"]) < len(CORPUS[2]) / 3


def test_save_load_round_trip(tok, tmp_path):
    save_tokenizer(tok, tmp_path / "tok")
    back = load_tokenizer(tmp_path / "tok")
    for text in CORPUS[:3] + ["<|im_start|>user\nhé 日本<|im_end|>\n"]:
        assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert back.chat_template == tok.chat_template
    assert back.eos_token == IM_END


def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                    "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n")


def test_vocab_size_validated():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)


def _unseen_share(tok, train_texts, names) -> float:
    """Share of the tokens of ``names`` that never occur in ``train_texts``."""
    seen = set()
    for t in train_texts:
        seen.update(tok.encode(t))
    ids = [i for n in names for i in tok.encode(" " + n)]
    return sum(i not in seen for i in ids) / len(ids)


def test_generator_tokenizer_splits_held_out_names_into_trained_pieces(tmp_path):
    """A BPE fitted to one world merges its names whole, so another world's names fall apart into
    pieces training never shows; the generator tokenizer (many random training-partition worlds)
    cuts every world's names into the same syllable-sized pieces."""
    from mosaic.agent.models.corpus import build_generator_tokenizer, build_project_tokenizer
    from mosaic.envs.splits import load_split, split_config

    cache = tmp_path / "cache"
    train = load_split("train", split_config("train", "cpu"), cache)
    test = load_split("test", split_config("test", "cpu"), cache)
    train_texts = [d.text for d in train.world.documents]
    held_out = sorted(test.world.names())

    fitted = build_project_tokenizer([train])
    generic = build_generator_tokenizer()
    unseen_fitted = _unseen_share(fitted, train_texts, held_out)
    unseen_generic = _unseen_share(generic, train_texts, held_out)
    assert unseen_fitted > 0.5, unseen_fitted  # the failure this tokenizer exists to avoid
    assert unseen_generic < 0.3, unseen_generic
    # Same pieces on both sides: names of either world cost about the same number of tokens.
    def mean_len(tok, names):
        return sum(len(tok.encode(" " + n)) for n in names) / len(names)

    assert abs(mean_len(generic, held_out) - mean_len(generic, sorted(train.world.names()))) < 1.0
    # Deterministic: the shipped base model's vocabulary can be rebuilt.
    assert build_generator_tokenizer().get_vocab() == generic.get_vocab()
