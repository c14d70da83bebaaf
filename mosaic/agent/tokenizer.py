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
from typing import Iterable

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


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, *, min_frequency: int = 2):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` includes the 256 byte symbols, the 3 special and 6 tag tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_fixed = 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    if vocab_size < n_fixed + 1:
        raise ValueError(f"vocab_size must be > {n_fixed} (bytes + special + tag tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),  # tags are added after training
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t for t in texts if t), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in TAG_TOKENS])
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
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tok, directory: str | Path) -> Path:
    """Save ``tok`` (files + chat template) to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    return directory


def load_tokenizer(directory: str | Path):
    """Load a tokenizer saved by :func:`save_tokenizer` (``PreTrainedTokenizerFast``, not AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(directory))
    if tok.chat_template is None:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def corpus_texts(documents: Iterable[str] = (), questions: Iterable[str] = (),
                 extra: Iterable[str] = ()) -> list[str]:
    """The training corpus: documents, questions, prompt texts and sample model outputs.

    ``extra`` holds the harness prompts (:meth:`mosaic.agent.harness.HarnessConfig.prompt_texts`)
    and scripted-expert outputs (:func:`mosaic.agent.expert.sample_texts`), so everything
    the model sees tokenises compactly.
    """
    return [t for t in (*documents, *questions, *extra) if t]


def build_project_tokenizer(splits, *, vocab_size: int = 2048, harness_config=None):
    """Train the project tokenizer on ``splits`` (``Split`` objects: their documents and questions),
    the harness prompts and the scripted expert's sample outputs."""
    from mosaic.agent.expert import sample_texts
    from mosaic.agent.harness import HarnessConfig

    cfg = harness_config or HarnessConfig()
    docs, questions, extra = [], [], list(cfg.prompt_texts())
    for sp in splits:
        docs += [d.text for d in sp.world.documents]
        questions += [t.question for t in sp.tasks]
        extra += sample_texts(sp.tasks)
    return train_tokenizer(corpus_texts(docs, questions, extra), vocab_size=vocab_size)


# Tokenizer-only worlds: seeds far from every split's (splits use 3 * seed + index, seed small).
GENERATOR_SEED_BASE = 1_000_000


def generator_corpus(n_worlds: int = 40, *, n_entities: int = 60, tasks_per_world: int = 40,
                     name_partition: tuple[int, int] = (0, 3), seed: int = 0,
                     harness_config=None) -> list[str]:
    """A world-agnostic corpus: documents, questions and expert texts of ``n_worlds`` freshly
    generated worlds in the *training* name partition, plus the harness prompts.

    Why not the training world's own documents: a BPE trained on one small world merges that
    world's names into whole tokens, so the names of any other world (a held-out split) fall
    apart into pieces the model never saw in training (measured: 88 % of the test world's name
    tokens never occur in the CPU preset's training text). Over many random worlds no single
    name is frequent, so names split into syllable-sized pieces shared by every world.
    """
    from mosaic.agent.expert import sample_texts
    from mosaic.agent.harness import HarnessConfig
    from mosaic.envs.questions import make_tasks
    from mosaic.envs.world import WorldConfig, generate_world

    cfg = harness_config or HarnessConfig()
    docs, questions, extra = [], [], list(cfg.prompt_texts())
    for k in range(n_worlds):
        world = generate_world(WorldConfig(seed=GENERATOR_SEED_BASE + 1000 * seed + k, n_entities=n_entities,
                                           name_partition=name_partition))
        tasks = make_tasks(world, tasks_per_world, {2: 0.5, 3: 0.5}, seed=k, split="tokenizer")
        docs += [d.text for d in world.documents]
        questions += [t.question for t in tasks]
        extra += sample_texts(tasks)
    return corpus_texts(docs, questions, extra)


def build_generator_tokenizer(*, vocab_size: int = 1024, n_worlds: int = 40, seed: int = 0,
                              harness_config=None):
    """The project tokenizer trained on :func:`generator_corpus` (no split's world shapes it)."""
    return train_tokenizer(generator_corpus(n_worlds, seed=seed, harness_config=harness_config),
                           vocab_size=vocab_size)
