"""The project tokenizer: a small byte-level BPE with ChatML special tokens.

Byte-level (every byte is in the base alphabet), so any text the model can emit
round-trips through ``decode``/``encode`` and any byte sequence has ids. Special
tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos: end of
turn); the tool/answer tags are added as single, non-special tokens so that
``decode(..., skip_special_tokens=True)`` keeps them.

Load a saved tokenizer with :func:`load_tokenizer` (``PreTrainedTokenizerFast``),
never ``AutoTokenizer``: next to a ``qwen2`` model config, ``AutoTokenizer``
silently builds a different tokenizer from the same files (see the project notes).
"""

from __future__ import annotations

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
    :mod:`mosaic.testing` renders chats segment by segment).
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


def save_tokenizer(tok, directory: str | Path) -> Path:
    """Save ``tok`` (files + chat template) to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    return directory


def load_tokenizer(directory: str | Path, *, fallback_template: str | None = CHAT_TEMPLATE):
    """Load a tokenizer saved by :func:`save_tokenizer` (or any HF tokenizer directory) as a
    ``PreTrainedTokenizerFast``, never with AutoTokenizer (see the module docstring).

    ``fallback_template``: the chat template set when the files carry none (None: leave it unset,
    e.g. for a served model's own tokenizer, whose template must not be guessed).
    """
    from transformers import PreTrainedTokenizerFast  # lazy: see train_tokenizer

    tok = PreTrainedTokenizerFast.from_pretrained(str(directory))
    if tok.chat_template is None and fallback_template is not None:
        tok.chat_template = fallback_template
    return tok
