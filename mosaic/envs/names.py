"""Fictional names from a syllable grammar.

Names are built from syllables (onset + nucleus + coda) so that no pretrained
knowledge helps: the model has to search. Each entity type has its own name
patterns, several tokens long ("Port Quendar", "Varnel Osk Holdings").

Near-duplicate names (one letter changed, a shared first token) are produced on
purpose so that retrieval has to be precise; uniqueness is enforced on the
*normalised* form (the reward's normalisation), so two names can never be
scored as the same answer.
"""

from __future__ import annotations

import hashlib
import random
import re

ONSETS = (
    "b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p",
    "pr", "r", "s", "st", "t", "th", "tr", "v", "z", "sh", "y", "w", "j", "", "",
)
NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou")
CODAS = ("", "", "", "n", "r", "l", "s", "th", "sk", "m", "nd", "rk", "x", "ll", "st")

# Pattern language: "W" is a generated word, anything else is a literal token.
PATTERNS: dict[str, tuple[tuple[str, ...], ...]] = {
    "person": (("W", "W"), ("W", "W"), ("W", "W"), ("W", "W", "W")),
    "city": (("W", "W"), ("Port", "W"), ("W", "Crossing"), ("Upper", "W"), ("W", "Hollow")),
    "company": (
        ("W", "Holdings"), ("W", "W", "Works"), ("W", "Group"), ("W", "W", "Industries"),
        ("W", "Trading", "House"), ("W", "Labs"),
    ),
    "university": (("University", "of", "W"), ("W", "W", "Institute"), ("W", "College")),
    "river": (("W", "River"), ("River", "W"), ("W", "W", "River")),
    "mountain": (("Mount", "W"), ("W", "Peak"), ("W", "W", "Massif")),
    "country": (("Republic", "of", "W"), ("Kingdom", "of", "W"), ("W", "Federation"), ("W", "W")),
}

_NORM_PUNCT = re.compile(r"[^\w\s]")
_NORM_ARTICLES = re.compile(r"\b(a|an|the)\b")


def name_key(name: str) -> str:
    """The normalised form used for uniqueness (same rules as the reward)."""
    text = _NORM_PUNCT.sub(" ", name.lower())
    return " ".join(_NORM_ARTICLES.sub(" ", text).split())


def in_partition(name: str, partition: tuple[int, int] | None) -> bool:
    """Whether ``name`` belongs to name-space slice ``(index, modulo)``.

    Splits use disjoint slices, so two worlds of different splits can never share
    an entity name, whatever their seeds.
    """
    if partition is None:
        return True
    index, modulo = partition
    digest = hashlib.sha1(name_key(name).encode()).hexdigest()
    return int(digest[:8], 16) % modulo == index


def make_word(rng: random.Random) -> str:
    n_syl = rng.choice((1, 2, 2, 2, 2, 3))
    parts = []
    for i in range(n_syl):
        coda = rng.choice(CODAS) if i == n_syl - 1 else rng.choice(("", "", "n", "r", "l"))
        parts.append(rng.choice(ONSETS) + rng.choice(NUCLEI) + coda)
    word = "".join(parts)
    if len(word) < 3:
        word += rng.choice(("ra", "el", "on", "ith"))
    return word.capitalize()


def make_name(rng: random.Random, kind: str) -> str:
    pattern = rng.choice(PATTERNS[kind])
    return " ".join(make_word(rng) if tok == "W" else tok for tok in pattern)


def near_duplicate(rng: random.Random, name: str, kind: str) -> str:
    """A name one small edit away from ``name`` (same type)."""
    tokens = name.split()
    word_positions = [i for i, t in enumerate(tokens) if t not in _LITERALS]
    if not word_positions:
        return make_name(rng, kind)
    pos = rng.choice(word_positions)
    word = tokens[pos]
    mode = rng.randrange(3)
    if mode == 0:  # change one vowel
        vowels = [i for i, c in enumerate(word) if c.lower() in "aeiou"]
        if vowels:
            i = rng.choice(vowels)
            repl = rng.choice([v for v in "aeiou" if v != word[i].lower()])
            word = word[:i] + (repl.upper() if i == 0 else repl) + word[i + 1:]
        else:
            word = word + "a"
    elif mode == 1:  # add a letter at the end
        word = word + rng.choice("aeiorn")
    else:  # keep this token, replace another one (a shared first name / stem)
        others = [i for i in word_positions if i != pos]
        if others:
            pos = rng.choice(others)
        word = make_word(rng)
    tokens[pos] = word
    return " ".join(tokens)


_LITERALS = frozenset(t for pats in PATTERNS.values() for p in pats for t in p if t != "W")
