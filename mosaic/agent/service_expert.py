"""The service family's scripted experts as a harness :class:`~mosaic.agent.policy.Policy`.

Wraps :class:`mosaic.envs.service.ServiceExpert` (revalidating or trusting): each request's prompt is
decoded into the transcript the expert reads (the first user message, its own turns, the tool
responses), its next message is tokenised (log-probs 0.0). A compaction session writes the actions done
in the current visit as tool calls and the visit's plan (:meth:`mosaic.envs.service.ServiceExpert.summary`); the resumed
session's message restates the current visit (the env's ``current_question``) with that summary, and
the expert reads the carried actions back, so it neither redoes nor skips them.
"""

from __future__ import annotations

from typing import Sequence

from mosaic.agent.policy import GenRequest, GenResult
from mosaic.envs.service import ServiceExpert
from mosaic.envs.service.expert import progress_summary

_TOOL_OPEN, _TOOL_CLOSE = "<tool_response>\n", "\n</tool_response>"
_TURN_ROOM = 160
"""Tokens a reset-mode turn and its tool response take at most (a call with JSON arguments, an order list):
when less than this plus ``max_new_tokens`` is left of the context, the expert treats the turn as the
session's last."""


def transcript_of(text: str) -> list[tuple[str, str]]:
    """``(role, content)`` of a decoded ChatML context, without the system message; tool responses
    (rendered as ``tool`` or later ``user`` messages) are unwrapped and given the role ``tool``."""
    out: list[tuple[str, str]] = []
    for chunk in text.split("<|im_start|>")[1:]:
        role, _, rest = chunk.partition("\n")
        content, role = rest.split("<|im_end|>")[0], role.strip()
        if role == "system" or not role:
            continue
        if content.startswith(_TOOL_OPEN) and content.endswith(_TOOL_CLOSE):
            role, content = "tool", content[len(_TOOL_OPEN):-len(_TOOL_CLOSE)]
        elif role == "user" and out:
            role = "tool"
        out.append((role, content))
    if out and out[-1] == ("assistant", ""):  # the open generation header
        out.pop()
    return out


class ServiceExpertPolicy:
    """A scripted service agent behind the harness (see the module docstring).

    Args:
        tokenizer: encodes the expert's text and decodes prompts.
        episodes: the episodes it may be asked about (looked up by ``meta["task_id"]``).
        revalidate: True: the revalidating expert; False: the trusting one.
    """

    def __init__(self, tokenizer, episodes, *, revalidate: bool = True):
        self.tok = tokenizer
        self.episodes = {e.id: e for e in episodes}
        self.expert = ServiceExpert(revalidate)
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        return [self._one(r) for r in requests]

    def release(self, session_key: str) -> None:
        pass

    def _one(self, req: GenRequest) -> GenResult:
        episode = self.episodes.get(req.meta.get("task_id"))
        if episode is None:
            text = "<answer>unknown</answer>"
        else:
            decoded = self.tok.decode(list(req.prompt_ids), skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
            if req.meta.get("kind") == "compaction":  # what this visit has done, as tool calls to read back
                transcript = transcript_of(decoded)
                text = self.expert.summary(episode, transcript)
                if len(self.tok(text, add_special_tokens=False)["input_ids"]) >= req.max_new_tokens:
                    text = progress_summary(transcript)  # the plan does not fit the summary's cap: calls only
            elif req.meta.get("kind") == "reset":  # a fresh context each session: notes carry the actions
                left = int(req.meta.get("calls_left", 1))
                if req.context_budget and req.context_budget - len(req.prompt_ids) < req.max_new_tokens + _TURN_ROOM:
                    left = 1  # the context resets after this turn: its last chance to note
                text = self.expert.act_reset(episode, transcript_of(decoded), left)
            elif req.meta.get("kind") == "subagent":  # (fork modes) the audit its parent delegated
                text = self.expert.audit(transcript_of(decoded))
            else:
                text = self.expert.act(episode, transcript_of(decoded), delegate="delegate" in req.meta.get("tools", ()))
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + [self.im_end_id]
        finish = "stop"
        if len(ids) > req.max_new_tokens:
            ids, finish = ids[: req.max_new_tokens], "length"
        return GenResult(ids, [0.0] * len(ids), finish)
