"""The project tokenizer: a small byte-level BPE with ChatML special tokens.

Byte-level (every byte is in the base alphabet), so any text the model can emit
round-trips through ``decode``/``encode`` and any byte sequence has ids. Special
tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos: end of
turn); the tool/answer tags are added as single, non-special tokens so that
``decode(..., skip_special_tokens=True)`` keeps them.

Saving (:func:`save_tokenizer`, used by every model Mosaic writes) makes the directory load
with ``AutoTokenizer`` too, with the same ids, and checks it: next to a ``qwen2`` model config,
transformers 5 otherwise swaps in ``Qwen2Tokenizer``, which rebuilds the pre-tokenizer from its
own regex (different ids from the same files). What is saved to prevent that:

- ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (the stock class that reads
  ``tokenizer.json`` as it is) and carries an ``auto_map`` entry. transformers 5 does not apply
  its ``qwen2`` override when a tokenizer declares an ``auto_map``, and without
  ``trust_remote_code`` it then loads the declared stock class: no code of ours runs.
- ``tokenization_mosaic.py``, the module that entry names: a subclass of the stock fast
  tokenizer with no code of its own, so ``trust_remote_code=True`` (verl, many scripts) loads
  the same tokenizer.

Each save is checked: ``AutoTokenizer`` is loaded back from the directory and must give the
in-memory tokenizer's ids on :data:`CHECK_TEXTS`, else :class:`TokenizerRoundTripError`. The
probe's ids go to ``mosaic_tokenizer_check.json``, which loaders verify.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>")

# Plain ChatML, Qwen-style: every role (system, user, assistant, tool) renders the same way.
# The harness wraps tool output in <tool_response> tags itself (see mosaic.agent.chat).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, *, min_frequency: int = 2,
                    tag_tokens: Sequence[str] = TAG_TOKENS, chat_template: str = CHAT_TEMPLATE,
                    isolate_newlines: bool = False):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` includes the 256 byte symbols, the 3 special and the tag tokens.
    ``isolate_newlines``: split at every newline before byte-level pre-tokenization, so a text
    tokenised whole gives the ids of its lines tokenised one by one (the scripted upstream of
    :mod:`mosaic.capture.scripted` renders chats segment by segment).
    """
    # lazy: `import mosaic.agent` (which re-exports this module) stays free of transformers (seconds)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_fixed = 256 + len(SPECIAL_TOKENS) + len(tag_tokens)
    if vocab_size < n_fixed + 1:
        raise ValueError(f"vocab_size must be > {n_fixed} (bytes + special + tag tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if isolate_newlines:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex("\n"), behavior="isolated"), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tag_tokens),  # tags are added after training
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t for t in texts if t), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in tag_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = chat_template
    return fast


CHECK_FILE = "mosaic_tokenizer_check.json"
"""Written next to a saved tokenizer: a probe text, its ids and the vocabulary size."""
PROBE_TEXT = "<|im_start|>user\nProbe: search(Vel Oranthi) -> 42, x_y z.<|im_end|>\n"
CHECK_TEXTS = (
    PROBE_TEXT,
    "<|im_start|>assistant\n<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"Ama Rell born\"}}"
    "</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>[1] Ama Rell was born in 1987 in Tessaly."
    "</tool_response><|im_end|>\n<|im_start|>assistant\n<answer>Tessaly</answer><|im_end|>",
    " 42 4242 3.14 -7 1,000,000 x_y  z\t\ttabs\n\n\nnewlines   spaces ",
    "Ünïcödé café naïve 日本語 emoji 🙂 — dashes ‘quotes’ I'm we'll they've",
    "<|endoftext|>a<|im_start|>b<|im_end|>c<answer></answer>",
)
"""Texts every save is checked on: ChatML, tool and answer tags, digits, whitespace runs,
contractions and non-ASCII: where ``Qwen2Tokenizer``'s and a GPT-2-style pre-tokenizer differ."""
AUTO_MODULE = "tokenization_mosaic"
_AUTO_CLASS = "MosaicTokenizer"
_AUTO_MODULE_SOURCE = f'''"""Written by Mosaic next to a saved tokenizer; loaded only with ``trust_remote_code=True``.

The stock fast tokenizer reading ``tokenizer.json`` as saved; it adds no code. It exists because
``tokenizer_config.json`` carries an ``auto_map`` entry, which keeps transformers from swapping in
a model-specific tokenizer class that pre-tokenises differently (other token ids).
"""

from transformers import PreTrainedTokenizerFast


class {_AUTO_CLASS}(PreTrainedTokenizerFast):
    """``PreTrainedTokenizerFast``, under a name the ``auto_map`` entry can point at."""
'''


class TokenizerRoundTripError(ValueError):
    """A saved tokenizer that does not load back (with ``AutoTokenizer``) to the same ids."""


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def save_tokenizer(tok, directory: str | Path, *, check_texts: Sequence[str] = CHECK_TEXTS) -> Path:
    """Save ``tok`` (files + chat template) to ``directory`` so that ``AutoTokenizer`` loads it
    with the same ids, and check that it does (see the module docstring).

    Save the model's config first when there is one: ``AutoTokenizer`` reads it, so the check
    covers what a user of the whole directory gets. Raises :class:`TokenizerRoundTripError`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    make_auto_loadable(directory)
    check = {"text": PROBE_TEXT, "ids": _ids(tok, PROBE_TEXT), "vocab_size": len(tok)}
    (directory / CHECK_FILE).write_text(json.dumps(check))
    check_auto_tokenizer(directory, tok, check_texts)
    return directory


def make_auto_loadable(directory: str | Path) -> None:
    """Make the tokenizer files in ``directory`` load with ``AutoTokenizer`` as the stock fast
    tokenizer of their ``tokenizer.json`` (see the module docstring); ``tokenizer.json`` itself
    is left as it is. Idempotent."""
    directory = Path(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for loader_state in ("is_local", "local_files_only"):  # how it was last loaded, not what it is
        config.pop(loader_state, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["auto_map"] = {"AutoTokenizer": [None, f"{AUTO_MODULE}.{_AUTO_CLASS}"]}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / f"{AUTO_MODULE}.py").write_text(_AUTO_MODULE_SOURCE)


def check_auto_tokenizer(directory: str | Path, reference, texts: Sequence[str] = CHECK_TEXTS, *,
                         trust_remote_code: bool = False):
    """Load ``AutoTokenizer`` from ``directory`` and require ``reference``'s ids on every text
    (and its vocabulary size, eos and pad tokens); returns the loaded tokenizer.

    Raises :class:`TokenizerRoundTripError` naming the first text that differs.
    """
    from transformers import AutoTokenizer  # lazy: see train_tokenizer

    auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True,
                                         trust_remote_code=trust_remote_code)
    where = f"{directory}: AutoTokenizer loads {type(auto).__name__}"
    if len(auto) != len(reference):
        raise TokenizerRoundTripError(f"{where} with {len(auto)} ids, the saved tokenizer has {len(reference)}")
    for name in ("eos_token", "pad_token"):
        if getattr(auto, name) != getattr(reference, name):
            raise TokenizerRoundTripError(
                f"{where} with {name} {getattr(auto, name)!r}, the saved tokenizer has {getattr(reference, name)!r}")
    for text in texts:
        got, want = _ids(auto, text), _ids(reference, text)
        if got != want:
            raise TokenizerRoundTripError(
                f"{where}, which tokenises {text[:60]!r} to {len(got)} ids instead of the saved "
                f"tokenizer's {len(want)} (first difference at position "
                f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))})")
    return auto


def load_tokenizer(directory: str | Path, *, fallback_template: str | None = CHAT_TEMPLATE):
    """Load a tokenizer saved by :func:`save_tokenizer` (or any HF tokenizer directory) as a
    ``PreTrainedTokenizerFast``: the ids ``tokenizer.json`` defines whatever the directory's
    model config says (``AutoTokenizer`` gives the same only for directories this module saved).

    ``fallback_template``: the chat template set when the files carry none (None: leave it unset,
    e.g. for a served model's own tokenizer, whose template must not be guessed).
    """
    from transformers import PreTrainedTokenizerFast  # lazy: see train_tokenizer

    tok = PreTrainedTokenizerFast.from_pretrained(str(directory))
    if tok.chat_template is None and fallback_template is not None:
        tok.chat_template = fallback_template
    return tok
