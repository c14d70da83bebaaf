"""Training corpora for the project tokenizer: world documents, questions, harness prompts and
scripted-expert texts (what the model will see), and the tokenizers trained on them.

Kept here, next to the models, so that :mod:`mosaic.agent.tokenizer` only defines, saves and
loads tokenizers and imports nothing of the harness (it is imported by :mod:`mosaic.agent.chat`).
"""

from __future__ import annotations

from typing import Iterable

from mosaic.agent.expert import sample_texts
from mosaic.agent.tools import error_texts
from mosaic.config.harness import TOOL_DOCS, HarnessConfig
from mosaic.agent.tokenizer import train_tokenizer
from mosaic.envs.questions import make_tasks
from mosaic.envs.world import WorldConfig, generate_world

# Tokenizer-only worlds: seeds far from every split's (splits use 3 * seed + index, seed small).
GENERATOR_SEED_BASE = 1_000_000


def prompt_texts(cfg: HarnessConfig) -> list[str]:
    """Every fixed text the harness shows the model: system prompts, the compaction prompt, the
    resume template, the tools' descriptions and a sample of every error response."""
    # The tools the shipped tokenizer was trained with: adding reset mode's docs here would change the
    # project tokenizer, so the shipped base model would no longer match its recipe.
    return [cfg.system_text(0), cfg.system_text(1), cfg.compaction_prompt,
            cfg.resume_text("", ""), TOOL_DOCS["search"], TOOL_DOCS["delegate"], *error_texts()]


def corpus_texts(documents: Iterable[str] = (), questions: Iterable[str] = (),
                 extra: Iterable[str] = ()) -> list[str]:
    """The training corpus: documents, questions, prompt texts and sample model outputs.

    ``extra`` holds the harness prompts (:func:`prompt_texts`)
    and scripted-expert outputs (:func:`mosaic.agent.expert.sample_texts`), so everything
    the model sees tokenises compactly.
    """
    return [t for t in (*documents, *questions, *extra) if t]


def build_project_tokenizer(splits, *, vocab_size: int = 2048, harness_config: HarnessConfig | None = None):
    """Train the project tokenizer on ``splits`` (``Split`` objects: their documents and questions),
    the harness prompts and the scripted expert's sample outputs."""
    cfg = harness_config or HarnessConfig()
    docs, questions, extra = [], [], prompt_texts(cfg)
    for sp in splits:
        if getattr(sp, "family", "deepsearch") == "service":  # episodes: every visit's text, the rules and tools
            from mosaic.envs.service import SERVICE_RULES, tool_docs

            questions += [v.text for e in sp.tasks for v in e.visits]
            extra += [SERVICE_RULES, tool_docs()]
            continue
        docs += [d.text for d in sp.world.documents]
        questions += [t.question for t in sp.tasks]
        extra += sample_texts(sp.tasks)
    return train_tokenizer(corpus_texts(docs, questions, extra), vocab_size=vocab_size)


def generator_corpus(n_worlds: int = 40, *, n_entities: int = 60, tasks_per_world: int = 40,
                     name_partition: tuple[int, int] = (0, 3), seed: int = 0,
                     harness_config: HarnessConfig | None = None) -> list[str]:
    """A world-agnostic corpus: documents, questions and expert texts of ``n_worlds`` freshly
    generated worlds in the *training* name partition, plus the harness prompts.

    Why not the training world's own documents: a BPE trained on one small world merges that
    world's names into whole tokens, so the names of any other world (a held-out split) fall
    apart into pieces the model never saw in training (measured: 88 % of the test world's name
    tokens never occur in the CPU preset's training text). Over many random worlds no single
    name is frequent, so names split into syllable-sized pieces shared by every world.
    """
    cfg = harness_config or HarnessConfig()
    docs, questions, extra = [], [], prompt_texts(cfg)
    for k in range(n_worlds):
        world = generate_world(WorldConfig(seed=GENERATOR_SEED_BASE + 1000 * seed + k, n_entities=n_entities,
                                           name_partition=name_partition))
        tasks = make_tasks(world, tasks_per_world, {2: 0.5, 3: 0.5}, seed=k, split="tokenizer")
        docs += [d.text for d in world.documents]
        questions += [t.question for t in tasks]
        extra += sample_texts(tasks)
    return corpus_texts(docs, questions, extra)


def build_generator_tokenizer(*, vocab_size: int = 1024, n_worlds: int = 40, seed: int = 0,
                              harness_config: HarnessConfig | None = None):
    """The project tokenizer trained on :func:`generator_corpus` (no split's world shapes it)."""
    return train_tokenizer(generator_corpus(n_worlds, seed=seed, harness_config=harness_config),
                           vocab_size=vocab_size)
