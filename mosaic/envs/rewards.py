"""Outcome rewards (docs/algorithm.md §3): answer extraction, normalisation, exact match, token F1.

Answer format: the harness's final action is an assistant message containing
``<answer>NAME</answer>``. :func:`extract_answer` takes the **last complete**
``<answer>…</answer>`` pair (tags case-insensitive); with nested tags the
innermost content of that last pair is taken. Bad output never raises: it gets
reward 0 and a status, so it can be counted:

- ``ok``        a non-empty answer was extracted;
- ``missing``   no answer tag at all;
- ``malformed`` tags present but no complete pair (unclosed, or a stray close);
- ``empty``     a complete pair with nothing (or only tags/whitespace) inside.

A text with a complete pair followed by an unclosed ``<answer>`` scores the
complete one (status ``ok``): the harness ends on the first answer it can parse.

Bad *ground truth* (not a string, or empty after normalisation) is a data error and
raises: it must never be silently scored 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Literal

OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"
STATUSES = ("ok", "missing", "malformed", "empty")
_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)
_ANY_TAG = re.compile(r"<\s*/?\s*answer\s*>", re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation + "‘’“”–—…"})


@dataclass(frozen=True)
class AnswerScore:
    reward: float  # in [0, 1]
    answer: str | None  # the extracted answer (raw, stripped), None if none
    status: str  # one of STATUSES


def normalize_answer(text: str) -> str:
    """Lowercase, punctuation to spaces, drop articles (a, an, the), collapse spaces.

    Punctuation becomes a space (not deleted) so "Port-Osk" and "Port Osk" agree.
    """
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_answer(text: str) -> tuple[str | None, str]:
    """``(answer, status)`` from a model message; see the module docstring."""
    if not isinstance(text, str):
        return None, "malformed"
    closes = list(_CLOSE.finditer(text))
    opens = list(_OPEN.finditer(text))
    if not closes and not opens:
        return None, "missing"
    for close in reversed(closes):
        before = [o for o in opens if o.end() <= close.start()]
        if before:
            inner = text[before[-1].end():close.start()]
            answer = _ANY_TAG.sub(" ", inner).strip()
            return (answer, "ok") if answer else (None, "empty")
    return None, "malformed"


def exact_match(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def token_f1(prediction: str, ground_truth: str) -> float:
    """SQuAD-style token F1 over normalised whitespace tokens."""
    pred = normalize_answer(prediction).split()
    gold = normalize_answer(ground_truth).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


METRICS = {"em": exact_match, "f1": token_f1}


def score_answer(model_text: str, ground_truth: str, metric: Literal["em", "f1"] = "em") -> AnswerScore:
    """Extract the answer from ``model_text`` and score it against ``ground_truth``."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    if not isinstance(ground_truth, str) or not normalize_answer(ground_truth):
        raise ValueError(f"ground_truth must be a non-empty string, got {ground_truth!r}")
    answer, status = extract_answer(model_text)
    if answer is None:
        return AnswerScore(0.0, None, status)
    return AnswerScore(METRICS[metric](answer, ground_truth), answer, status)


def count_statuses(scores: list[AnswerScore]) -> dict[str, int]:
    """How many scores have each status (all statuses present, zeros included)."""
    counts = dict.fromkeys(STATUSES, 0)
    for s in scores:
        counts[s.status] += 1
    return counts
