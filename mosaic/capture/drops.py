"""What a reader of capture records left out, and why: one report for every path that reads records.

``mosaic proxy export``, offline replay (``rollout.source=records``) and the trainer's live harness
source all read the proxy's records; each rollout one of them leaves out is named here with its
reason (``bad_record`` for a record with a missing or wrongly typed field, then the reader's own:
``no_reward``, ``unbuildable``, ``no_logprobs``, ``invalid``, ...) and where (``file:line`` and the
field, or what failed), so they all count and print drops the same way (issue 33). Texts made safe
(a lone surrogate replaced by U+FFFD, by the proxy on arrival or by the reader) are counted too.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["RecordReport"]


class RecordReport:
    """Rollouts dropped while reading records (first reason per rollout wins) and texts made safe."""

    def __init__(self, source: str = "") -> None:
        self.source = source
        self.dropped: dict[str, tuple[str, str]] = {}  # rollout id -> (reason, detail)
        self.bad_records: list[tuple[str, str]] = []  # (rollout id, "file:line: field ...") of every bad record
        self.sanitized_text = 0

    def drop(self, rollout_id: str, reason: str, detail: str = "") -> None:
        self.dropped.setdefault(rollout_id, (reason, detail))

    def bad_record(self, rollout_id: str, message: str) -> None:
        """A record with a bad field: its whole rollout is dropped (it would be rebuilt wrong)."""
        self.bad_records.append((rollout_id, message))
        self.drop(rollout_id, "bad_record", message)

    def counts(self) -> Counter:
        """Dropped rollouts by reason."""
        return Counter(reason for reason, _ in self.dropped.values())

    def __len__(self) -> int:
        return len(self.dropped)

    def rows(self) -> list[dict[str, str]]:
        """One dict per dropped rollout (rollout_id, reason, detail), in the order they were found."""
        return [{"rollout_id": rid, "reason": r, "detail": d} for rid, (r, d) in self.dropped.items()]

    def summary(self, limit: int = 5) -> str:
        """One line: how many rollouts were dropped, by reason, and the first ``limit`` of them named
        with where and why; ``none`` when nothing was dropped."""
        if not self.dropped:
            text = "none"
        else:
            by = ", ".join(f"{r} {n}" for r, n in self.counts().items())
            named = "; ".join(f"{rid!r} {r}" + (f" ({d[:300]})" if d else "")
                              for rid, (r, d) in list(self.dropped.items())[:limit])
            more = len(self.dropped) - limit
            text = f"{len(self.dropped)} rollout(s) ({by}): {named}" + (f"; and {more} more" if more > 0 else "")
        if self.sanitized_text:
            text += f"; {self.sanitized_text} text(s) with lone surrogates made safe (U+FFFD)"
        return text
