"""A scripted expert policy that follows each question's gold chain, with noise knobs.

It is a :class:`~mosaic.agent.policy.Policy`: it reads ``GenRequest.meta`` (task id,
session kind, turn, depth) and *decodes the prompt* to see what the context holds,
then writes text and tokenises it (log-probs 0.0). Its progress comes from the
context, not from hidden memory: a hop counts as done when its target's name is
in the context (a tool response, a subagent's answer, a summary) or its gold query
was already searched in this context. So a lossy summary really costs work in the
next session, as it would for a model.

Behaviour per session kind:
- main: search the next hop's gold query (fork modes: ``delegate`` one hop per
  subagent); answer the last target once every hop is done;
- subagent: find the hop its question asks about, search it, answer its target;
- compaction: list the hops found so far (``title relation: target``) and the next search;
- reset: note each hop found (``note_write``, or ``handoff`` as the session's last action) before
  searching the next; with one action left and nothing to note, hand off the next search as a plan.

Noise (:class:`ExpertNoise`, each an independent draw per opportunity, deterministic
in (seed, trajectory, session, turn)); occurrences and opportunities per kind are
returned by :meth:`ExpertPolicy.trajectory_meta` and land in ``traj.meta["policy"]``.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Sequence

from mosaic.agent.policy import GenRequest, GenResult
from mosaic.agent.tools import format_call

NOISE_KINDS = ("wrong_query", "redundant_search", "early_guess", "lossy_summary", "extra_session")
_WRONG_WORDS = ("born", "studied", "works", "mentor", "country", "founder", "headquarters", "director",
                "river", "capital", "located")
_FILLER = "Let me think again about what I have found and what is still missing. "
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True)
class ExpertNoise:
    """Mistake rates in [0, 1]; each is the probability per opportunity."""

    wrong_query: float = 0.1
    """Per search decision: search a wrong relation word for the next hop (then redo it)."""
    redundant_search: float = 0.1
    """Per search decision with a hop already done: repeat a done hop's search."""
    early_guess: float = 0.03
    """Per main search decision after the first hop: answer the current entity (wrong) instead."""
    lossy_summary: float = 0.2
    """Per summary with a hop done: drop the latest entity found (the next session redoes that hop); in
    reset mode, per note of a hop found: a note without the entity."""
    extra_session: float = 0.1
    """Per main turn (compaction modes) where padding can force a compaction: pad the turn with
    filler notes so the context fills up and an unnecessary compaction follows."""

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"ExpertNoise.{k}: must be a rate in [0, 1], got {v!r}")

    @staticmethod
    def off() -> "ExpertNoise":
        return ExpertNoise(0.0, 0.0, 0.0, 0.0, 0.0)


def _messages(text: str) -> list[tuple[str, str]]:
    """(role, content) pairs of a decoded ChatML context."""
    out = []
    for chunk in text.split("<|im_start|>")[1:]:
        role, _, rest = chunk.partition("\n")
        out.append((role.strip(), rest.split("<|im_end|>")[0]))
    return out


def _calls(messages: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """``(name, arguments)`` of every well-formed tool call the context's assistant turns made."""
    out = []
    for role, content in messages:
        if role != "assistant":
            continue
        for body in _CALL.findall(content):
            try:
                call = json.loads(body)
            except ValueError:
                continue
            if isinstance(call, dict) and isinstance(call.get("arguments"), dict):
                out.append((str(call.get("name")), call["arguments"]))
    return out


def _searched(messages: list[tuple[str, str]]) -> set[str]:
    return {str(a["query"]) for name, a in _calls(messages) if "query" in a}


def _written_notes(messages: list[tuple[str, str]]) -> list[str]:
    """The notes this context's assistant turns wrote (``note_write`` and ``handoff`` arguments)."""
    return [str(a.get("text", a.get("note", ""))) for name, a in _calls(messages) if name in ("note_write", "handoff")]


def delegate_question(hop) -> str:
    return f"Who or what is the {hop.relation} of {hop.title}?"


class ExpertPolicy:
    """Scripted gold-chain solver; see the module docstring.

    Args:
        tokenizer: encodes the expert's text (and decodes prompts).
        tasks: every task it may be asked about (looked up by ``meta["task_id"]``).
        noise: mistake rates (default: modest, non-zero; ``ExpertNoise.off()`` for none).
        seed: seeds the noise draws.
    """

    def __init__(self, tokenizer, tasks, noise: ExpertNoise | None = None, *, seed: int = 0):
        self.tok = tokenizer
        self.tasks = {t.id: t for t in tasks}
        self.noise = ExpertNoise() if noise is None else noise
        self.seed = seed
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._stats: dict[str, Counter] = {}
        self._filler_ids = len(self._encode(_FILLER))

    # ------------------------------------------------------------------ Policy protocol
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        return [self._one(r) for r in requests]

    def release(self, session_key: str) -> None:
        pass

    def trajectory_meta(self, traj_id: str) -> dict:
        c = self._stats.pop(traj_id, Counter())
        return {"noise": {k: [c[k], c[k + "_opportunities"]] for k in NOISE_KINDS}}

    # ------------------------------------------------------------------ internals
    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _draw(self, meta: dict, what: str, rate: float) -> bool:
        """One Bernoulli(rate) draw for an opportunity of kind ``what`` (counted)."""
        c = self._stats.setdefault(meta["traj_id"], Counter())
        c[what + "_opportunities"] += 1
        rng = random.Random(f"{self.seed}/{meta['traj_id']}/{meta['session']}/{meta['turn']}/{what}")
        hit = rng.random() < rate
        c[what] += hit
        return hit

    def _rng(self, meta: dict, what: str) -> random.Random:
        return random.Random(f"{self.seed}/{meta['traj_id']}/{meta['session']}/{meta['turn']}/{what}/pick")

    def _one(self, req: GenRequest) -> GenResult:
        meta = req.meta
        task = self.tasks.get(meta.get("task_id"))
        if task is None:
            text = "<answer>unknown</answer>"
        else:
            msgs = _messages(self.tok.decode(req.prompt_ids, skip_special_tokens=False))
            kind = meta.get("kind", "main")
            if kind == "compaction":
                text = self._summary(req, task, msgs)
            elif kind == "subagent":
                text = self._subagent(req, task, msgs)
            elif kind == "reset":
                text = self._reset(req, task, msgs)
            else:
                text = self._main(req, task, msgs)
        ids = self._encode(text) + [self.im_end_id]
        finish = "stop"
        if len(ids) > req.max_new_tokens:
            ids, finish = ids[: req.max_new_tokens], "length"
        return GenResult(ids, [0.0] * len(ids), finish)

    def _done(self, task, msgs: list[tuple[str, str]], question: str) -> list[bool]:
        # Evidence: everything after the system prompt, minus the question itself.
        evidence = "\n".join(c for _, c in msgs[1:]).replace(question, " ")
        searched = _searched(msgs)
        return [h.target in evidence or h.query in searched for h in task.gold_chain]

    def _main(self, req: GenRequest, task, msgs) -> str:
        meta, chain = req.meta, task.gold_chain
        done = self._done(task, msgs, task.question)
        if all(done):
            return f"<answer>{chain[-1].target}</answer>"
        nxt = done.index(False)
        hop = chain[nxt]
        forks = "delegate" in meta.get("tools", ())
        if nxt >= 1 and self._draw(meta, "early_guess", self.noise.early_guess):
            return f"<answer>{chain[nxt - 1].target}</answer>"
        if forks:
            action = format_call("delegate", delegate_question(hop))
        else:
            action = self._search_action(meta, chain, done, nxt)
        pad = self._padding(req, action) if meta.get("mode", "").startswith("compaction") else ""
        return pad + action

    def _search_action(self, meta: dict, chain, done: list[bool], nxt: int) -> str:
        hop = chain[nxt]
        known = [i for i, d in enumerate(done) if d]
        if known and self._draw(meta, "redundant_search", self.noise.redundant_search):
            return format_call("search", chain[self._rng(meta, "redundant").choice(known)].query)
        if self._draw(meta, "wrong_query", self.noise.wrong_query):
            words = [w for w in _WRONG_WORDS if w != hop.relation]
            return format_call("search", f"{hop.title} {self._rng(meta, 'wrong').choice(words)}")
        return format_call("search", hop.query)

    def _padding(self, req: GenRequest, action: str) -> str:
        """Filler that makes the context overflow before the next turn (when one turn can)."""
        budget = req.context_budget or 0
        room = req.max_new_tokens - len(self._encode(action)) - 2
        need = budget - req.max_new_tokens - len(req.prompt_ids) + 8  # +8: next header, slack
        if budget <= 0 or need > room or need <= 0:
            return ""
        reps = -(-need // max(self._filler_ids, 1))
        while reps > 0 and len(self._encode(_FILLER * reps + "\n" + action)) > req.max_new_tokens - 1:
            reps -= 1
        if reps == 0 or not self._draw(req.meta, "extra_session", self.noise.extra_session):
            return ""
        return _FILLER * reps + "\n"

    def _subagent(self, req: GenRequest, task, msgs) -> str:
        meta = req.meta
        q = meta.get("question", "")
        hops = [h for h in task.gold_chain if f"of {h.title}?" in q and f" {h.relation} " in q]
        if not hops:
            return "<answer>unknown</answer>"
        hop = hops[0]
        evidence = "\n".join(c for _, c in msgs[2:])
        if hop.target in evidence or hop.query in _searched(msgs):
            return f"<answer>{hop.target}</answer>"
        if self._draw(meta, "wrong_query", self.noise.wrong_query):
            words = [w for w in _WRONG_WORDS if w != hop.relation]
            return format_call("search", f"{hop.title} {self._rng(meta, 'wrong').choice(words)}")
        return format_call("search", hop.query)

    def _reset(self, req: GenRequest, task, msgs) -> str:
        """A reset session: answer once every hop is known; note a hop found in this session before
        anything else (with ``handoff`` when it is the session's last action); otherwise search the next
        hop, or hand off a plan when one action is left (its result would be lost with the context)."""
        meta, chain = req.meta, task.gold_chain
        done = self._done(task, msgs, task.question)
        if all(done):
            return f"<answer>{chain[-1].target}</answer>"
        noted = (msgs[1][1] if len(msgs) > 1 else "") + " ".join(_written_notes(msgs))
        left = int(meta.get("calls_left", 2))
        unnoted = [h for h, d in zip(chain, done) if d and h.target not in noted]
        if unnoted:
            h = unnoted[0]
            lossy = self._draw(meta, "lossy_summary", self.noise.lossy_summary)  # a note that loses the entity
            note = f"{h.title} {h.relation}: " + ("not found yet" if lossy else h.target)
            return format_call("handoff" if left <= 1 else "note_write", note)
        hop = chain[done.index(False)]
        if left <= 1:
            return format_call("handoff", f"next: {hop.query}")
        return self._search_action(meta, chain, done, done.index(False))

    def _summary(self, req: GenRequest, task, msgs) -> str:
        chain = task.gold_chain
        # The compaction prompt's last message is the instruction; the history is before it.
        done = self._done(task, msgs[:-1], task.question)
        known = [i for i, d in enumerate(done) if d]
        if known and self._draw(req.meta, "lossy_summary", self.noise.lossy_summary):
            done[known[-1]] = False
        return summary_text(chain, done)


def summary_text(chain, done: list[bool]) -> str:
    lines = ["Found so far:"] + [f"- {h.title} {h.relation}: {h.target}" for h, d in zip(chain, done) if d]
    if len(lines) == 1:
        lines.append("- nothing yet")
    if all(done):
        lines.append(f"Next: answer {chain[-1].target}.")
    else:
        lines.append(f'Next: search "{chain[done.index(False)].query}".')
    return "\n".join(lines)


def sample_texts(tasks) -> list[str]:
    """Texts the expert writes for ``tasks`` (search and delegate calls, summaries, answers),
    for the tokenizer corpus."""
    out = []
    for t in tasks:
        chain = t.gold_chain
        for i, h in enumerate(chain):
            out.append(format_call("search", h.query))
            out.append(format_call("delegate", delegate_question(h)))
            out.append(summary_text(chain, [j <= i for j in range(len(chain))]))
        out.append(f"<answer>{chain[-1].target}</answer>")
    out.append(_FILLER)
    return out
