"""A detached stretch: sampled tokens trained on the exact context they were sampled from, apart from
their session's row (drift repair at turn boundaries; see :class:`Stretch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mosaic.trace.fields import TraceError, as_bool_list, as_float_list, as_int_list, check_ids, check_logprobs, show_value

__all__ = ["Stretch", "ids_outside"]


@dataclass
class Stretch:
    """Sampled tokens kept apart from their session's row, on the exact context they were sampled from:
    a harness re-sent an earlier turn with other tokens than were sampled, the later turns (and the row)
    follow the re-sent tokens (capture reconstruction, rule 3b). Trained as a row of their own with the
    session's advantage; ``prompt_ids`` is their context, the rest as in a :class:`Session`."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "completion_ids": list(self.completion_ids),
                "loss_mask": [bool(m) for m in self.loss_mask], "logprobs": [float(x) for x in self.logprobs]}

    @staticmethod
    def from_dict(d: Any) -> "Stretch":
        if not isinstance(d, dict):
            raise TraceError(f"a detached stretch must be an object, got {show_value(d)}")
        try:
            return Stretch(prompt_ids=as_int_list(d["prompt_ids"], "prompt_ids"),
                           completion_ids=as_int_list(d["completion_ids"], "completion_ids"),
                           loss_mask=as_bool_list(d["loss_mask"], "loss_mask"),
                           logprobs=as_float_list(d["logprobs"], "logprobs"))
        except KeyError as exc:
            raise TraceError(f"a detached stretch is missing field {exc.args[0]!r}") from None

    def check(self, where: str) -> None:
        n = len(self.completion_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise TraceError(f"{where}: loss_mask / logprobs lengths {len(self.loss_mask)} / {len(self.logprobs)} "
                             f"!= {n} completion tokens")
        try:
            check_ids(self.prompt_ids, "prompt_ids")
            check_ids(self.completion_ids, "completion_ids")
            check_logprobs(self.logprobs, "logprobs")
        except TraceError as exc:
            raise TraceError(f"{where} {exc}") from None


def ids_outside(traj, vocab_size: int) -> str | None:
    """Where ``traj`` holds a token id outside ``[0, vocab_size)`` (a record or file made for another
    vocabulary, or hand-edited), as one line naming the session and the id; None when every id fits.
    Training on such ids would fail inside the embedding lookup (an IndexError after the model loaded)."""
    for s in traj.sessions:
        parts = [("prompt_ids", s.prompt_ids), ("completion_ids", s.completion_ids)]
        parts += [(f"detached[{k}].{name}", ids) for k, st in enumerate(s.detached)
                  for name, ids in (("prompt_ids", st.prompt_ids), ("completion_ids", st.completion_ids))]
        for name, ids in parts:
            if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                bad = next(i for i in ids if i < 0 or i >= vocab_size)
                return f"session {s.id} {name} holds token id {bad}, outside the model's vocabulary [0, {vocab_size})"
    return None
