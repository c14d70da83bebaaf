"""Difficulty calibration: how many searches and sessions a k-hop question needs.

An expert makes ``searches_per_hop`` searches per hop (the gold query), each a
turn of ``think_tokens`` of notes plus the call, answered by the real
``format_hits`` of the real index. The context follows docs/algorithm.md §2: before a turn,
if ``context + max_new_tokens > context_budget`` the main session ends and a new
one starts from ``system + question + summary`` (summary = ``summary_base +
summary_per_hop`` × hops solved so far). The final turn writes the answer. We
count *main* sessions (compaction sessions come between them).

Token counts: ``tokenizer="proxy"`` (default) counts words and punctuation marks
(regex ``\\w+|[^\\w\\s]``), roughly one token per word or short name piece, as a
small project tokenizer would; ``tokenizer="bpe"`` trains a byte-level BPE
(HF ``tokenizers``, ``bpe_vocab`` entries) on the world's documents and questions
and counts its tokens (syllable names then cost several tokens each).

:func:`calibration_table` is what ``mosaic data calibrate`` prints; the trainer
can re-run it with its own budget and tokenizer (pass ``count_tokens``).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Callable, Literal

from mosaic.envs.export import SYSTEM_PROMPT
from mosaic.envs.questions import Task
from mosaic.envs.search import SearchIndex, format_hits
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_PROXY = re.compile(r"\w+|[^\w\s]")


def proxy_count(text: str) -> int:
    return len(_PROXY.findall(text))


@dataclass(frozen=True)
class CalibrationConfig:
    context_budget: int = 512
    """Tokens a session's context may hold (the CPU preset's default)."""
    max_new_tokens: int = 64
    """Tokens reserved for the next assistant turn (compaction trigger)."""
    k: int = 3
    """Snippets per search."""
    think_tokens: int = 16
    """Notes the expert writes per search turn, besides the call itself."""
    message_overhead: int = 4
    """Chat-template tokens per message (role markers)."""
    summary_base: int = 24
    """Summary tokens carried into a new session, plus ``summary_per_hop`` per solved hop."""
    summary_per_hop: int = 12
    searches_per_hop: int = 1
    """Searches an expert spends per hop (>= 1)."""
    tokenizer: Literal["proxy", "bpe"] = "proxy"
    bpe_vocab: int = 2048


def train_bpe(texts: list[str], vocab_size: int) -> Callable[[str], int]:

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return lambda text: len(tok.encode(text).ids)


def simulate(task: Task, index: SearchIndex, cfg: CalibrationConfig,
             count: Callable[[str], int]) -> dict:
    """One expert run on ``task``: searches, main sessions, tokens per search turn."""
    ov = cfg.message_overhead
    base = count(SYSTEM_PROMPT) + count(task.question) + 2 * ov
    ctx, sessions, turn_tokens = base, 1, []
    for solved, hop in enumerate(task.gold_chain):
        for _ in range(cfg.searches_per_hop):
            if ctx + cfg.max_new_tokens > cfg.context_budget:
                sessions += 1
                ctx = base + cfg.summary_base + cfg.summary_per_hop * solved + ov
            call = cfg.think_tokens + count(f'<search>{hop.query}</search>') + ov
            response = count(format_hits(index.search(hop.query, cfg.k))) + ov
            ctx += call + response
            turn_tokens.append(call + response)
    if ctx + cfg.max_new_tokens > cfg.context_budget:  # the answer turn
        sessions += 1
    return {"searches": len(turn_tokens), "sessions": sessions, "turn_tokens": turn_tokens,
            "prompt_tokens": base}


def calibration_table(index: SearchIndex, tasks: list[Task], cfg: CalibrationConfig = CalibrationConfig(),
                      count_tokens: Callable[[str], int] | None = None) -> list[dict]:
    """One row per hop count: tasks, searches, tokens per search, sessions (mean, median,
    share needing >= 2), and how many searches fit in a first session."""
    if count_tokens is None:
        if cfg.tokenizer == "bpe":
            texts = [d.text for d in index.docs] + [t.question for t in tasks] + [SYSTEM_PROMPT]
            count_tokens = train_bpe(texts, cfg.bpe_vocab)
        else:
            count_tokens = proxy_count
    by_k: dict[int, list[dict]] = {}
    for t in tasks:
        by_k.setdefault(t.hops, []).append(simulate(t, index, cfg, count_tokens))
    rows = []
    for k in sorted(by_k):
        runs = by_k[k]
        turns = [x for r in runs for x in r["turn_tokens"]]
        sessions = [r["sessions"] for r in runs]
        prompt = statistics.mean(r["prompt_tokens"] for r in runs)
        per_turn = statistics.mean(turns)
        rows.append({
            "hops": k, "tasks": len(runs), "searches": statistics.mean(r["searches"] for r in runs),
            "prompt_tokens": round(prompt, 1), "tokens_per_search": round(per_turn, 1),
            "searches_first_session": max(0, int((cfg.context_budget - cfg.max_new_tokens - prompt)
                                                 // per_turn) + 1),
            "sessions_mean": round(statistics.mean(sessions), 2),
            "sessions_median": statistics.median(sessions),
            "share_ge2_sessions": round(sum(s >= 2 for s in sessions) / len(sessions), 3),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    cols = ["hops", "tasks", "searches", "prompt_tokens", "tokens_per_search",
            "searches_first_session", "sessions_mean", "sessions_median", "share_ge2_sessions"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(lines)
