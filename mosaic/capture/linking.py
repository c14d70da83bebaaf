"""Rules 3–6 of session reconstruction, one method per rule (stated in the docstring of
:mod:`mosaic.capture.reconstruct`): calls into sessions, sessions into a graph, the final session.

Each link is decided by evidence found in the records (a token prefix, a reply's text reappearing,
a request reproducing another session's history, a tool call's argument opening a subagent). Where
the evidence is missing or ambiguous the rule still decides, and says so in the session's ``meta``.
"""

from __future__ import annotations

from mosaic.capture.records import CallRecord, content_text
from mosaic.capture.sessions import (
    TAIL_ADDED, ReconstructionRules, SessionDraft, is_prefix, RolloutCalls, history_tail, history_texts, loose,
    message_key, tool_call_keys, tool_call_strings,
)


def link_sessions(calls: list[CallRecord], rules: ReconstructionRules,
                  answer: str | None = None) -> tuple[list[SessionDraft], int]:
    """Rules 3–6 over a rollout's ordered, usable calls: the sessions and the final one's index.
    ``answer``: the answer posted with the reward, if any (evidence for rule 6)."""
    linker = Linker(calls, rules, answer)
    final = linker.run()
    return linker.sessions, final


def chain_end(sessions: list[SessionDraft], x: SessionDraft) -> SessionDraft:
    """The last session of x's compaction chain (x → compaction → successor → ...; the latest-started
    compaction where there are several)."""
    seen = {x.idx}
    while True:
        nxt = [c for c in sessions if c.parent == x.idx and c.kind == "compaction"
               and c.successor is not None and c.successor not in seen]
        if not nxt:
            return x
        x = sessions[max(nxt, key=lambda c: c.calls[0]).successor]
        seen.add(x.idx)


class Linker:
    """The session graph of one rollout, built rule by rule."""

    def __init__(self, calls: list[CallRecord], rules: ReconstructionRules, answer: str | None = None):
        self.calls, self.rules, self.answer = calls, rules, loose(answer or "")
        self.ro = RolloutCalls(calls, rules)
        self.sessions: list[SessionDraft] = []
        self.call_sess: list[int] = []  # the session of each call

    def run(self) -> int:
        for i in range(len(self.calls)):
            self.assign_call(i)  # rules 3, 3b, 4
        sessions = self.sessions
        # The first session is the root: the agent working on the task.
        sessions[0].kind, sessions[0].parent, sessions[0].edge = "main", None, None
        sessions[0].meta.pop("by", None)
        hit = self.output_hits()
        self.link_summaries(hit)  # 5a
        self.find_output_compactions(hit)  # 5b
        self.parent_compactions()  # 5d (before 5c: a compaction's own history is no result)
        successor_of = {x.successor: x.idx for x in sessions if x.successor is not None}
        hit = self.output_hits()
        via = self.link_subagents(hit, successor_of)  # 5c
        self.link_forward()  # 5e
        self.resolve_via(via)  # 5c, continued
        self.link_resets()  # 5f
        for x in sorted(sessions, key=lambda s: s.calls[0]):
            if x.successor is not None:
                p = x.parent
                sessions[x.successor].kind = sessions[p].kind if p is not None else "main"
        self.fork_results(hit)
        for x in sessions[1:]:
            if x.parent is None and x.kind != "compaction":
                x.kind = "main"
                x.meta["unlinked"] = True
        return self.final()

    # -- helpers ---------------------------------------------------------------------------------
    def _opens(self, j: int) -> bool:
        return self.sessions[self.call_sess[j]].calls[0] == j

    def _first_message(self, sess: SessionDraft):
        c = self.calls[sess.calls[0]]
        return c.messages[0] if c.endpoint == "chat" and c.messages else None

    def _pick(self, cands: list[int]) -> int:
        return cands[0] if self.rules.tie_break == "oldest" else cands[-1]

    # -- rules 3, 3b and 4: which session each call belongs to -----------------------------------
    def assign_call(self, i: int) -> None:
        """Rule 3: continue the session whose tip is the longest prefix of the call's prompt; 3b: else
        the session whose last request and reply the call's messages repeat; 4: a compaction
        instruction always opens a compaction session; anything else opens a new session."""
        c, sessions = self.calls[i], self.sessions
        best: list[int] = []
        best_len = -1
        for s in sessions:
            if len(s.tip) >= best_len and is_prefix(s.tip, c.prompt_ids):
                if len(s.tip) > best_len:
                    best, best_len = [s.idx], len(s.tip)
                else:
                    best.append(s.idx)
        compaction = self.ro.is_compaction_call(c)
        if best and not compaction:
            pick = self._pick(best)
            s = sessions[pick]
            if len(best) > 1:
                s.meta.setdefault("ambiguous_with", []).append(
                    {"call_id": c.call_id, "sessions": [b for b in best if b != pick]})
            s.add(i, c, c.prompt_ids[len(s.tip):], self.calls)
            self.call_sess.append(pick)
            return
        if not compaction and not best and self.rules.message_match and self.continue_by_messages(i):
            return
        new = SessionDraft.open(len(sessions), i, c)
        if compaction:
            new.kind = "compaction"
            new.meta["by"] = "instruction"
            p = sessions[self._pick(best)] if best else self._resent_by(i)
            if p is not None:
                new.parent, new.edge = p.idx, "continues"
                self._history_tail(c, p, new)  # (a re-rendered reply: the tail stays put, flagged)
                new.parent_upto = len(p.prompt) + len(p.comp)
                new.meta["parent_by"] = "prefix" if best else "messages"
        else:
            for s in sessions:
                first = self.calls[s.calls[0]]
                if is_prefix(first.prompt_ids, c.prompt_ids) and len(first.prompt_ids) < len(c.prompt_ids):
                    new.meta["diverged_from"] = s.idx
        sessions.append(new)
        self.call_sess.append(new.idx)

    def _history_tail(self, c: CallRecord, p: SessionDraft, new: SessionDraft, k: int | None = None) -> bool:
        """:func:`~mosaic.capture.sessions.history_tail` of compaction call ``c`` and its parent (reply to call
        ``k``, default the last), its outcome in ``new.meta["history_tail"]``; whether the tail was added."""
        k = len(p.calls) - 1 if k is None else k
        flag = history_tail(self.rules, c, p, len(self.calls[p.calls[k]].messages), last=k == len(p.calls) - 1)
        if flag:
            new.meta["history_tail"] = flag
        return flag == TAIL_ADDED

    def continue_by_messages(self, i: int) -> bool:
        """Rule 3b: the call repeats, message by message (loosely), the last request of a session
        plus that request's reply, and goes on from there: it continues that session, whose row is
        rebuilt to follow the call's prompt (:meth:`SessionDraft.rebase`: the tokens sampled on the
        earlier rendering are kept, detached, on the context they were sampled on)."""
        c = self.calls[i]
        found = self._resending(i)
        if not found:
            return False
        pick = self._pick([f[0] for f in found])
        s = self.sessions[pick]
        prev = self.calls[s.calls[-1]]
        if len(found) > 1:
            s.meta.setdefault("ambiguous_with", []).append(
                {"call_id": c.call_id, "sessions": [f[0] for f in found if f[0] != pick]})
        moved = s.rebase(i, c, dict(found)[pick])
        s.meta.setdefault("resent", []).append(
            {"call_id": c.call_id, "sampled": len(prev.completion_ids), "detached_tokens": moved})
        self.call_sess.append(pick)
        return True

    def _resending(self, i: int) -> list[tuple[int, int | None]]:
        """The sessions (not compactions) whose last request and reply call ``i`` re-sends, each with where the
        re-rendered reply ends in its prompt (:meth:`_resends`)."""
        c = self.calls[i]
        if c.endpoint != "chat" or not c.messages:
            return []
        keys = [message_key(m) for m in c.messages]
        hits = [(s.idx, self._resends(keys, c, self.calls[s.calls[-1]]))
                for s in self.sessions if s.kind != "compaction"]
        return [(k, hit) for k, hit in hits if hit is not False]

    def _resent_by(self, i: int) -> SessionDraft | None:
        """Rule 4, a compaction call that extends no tip: the session whose last request and reply it re-sends
        (as 3b: the reply re-rendered), or None."""
        found = self._resending(i) if self.rules.message_match else []
        return self.sessions[self._pick([k for k, _ in found])] if found else None

    @staticmethod
    def _resends(keys: list[tuple], c: CallRecord, p: CallRecord) -> int | None | bool:
        """Whether call c re-sends call p's request and reply (False if not); if it does, where p's
        re-rendered reply ends in c's prompt: after the first occurrence of the reply's last token
        when the reply ended with its end-of-turn token, else None (a reply cut at ``max_tokens``)."""
        n = len(p.messages)
        if p.endpoint != "chat" or not n or len(keys) <= n or not p.completion_ids:
            return False
        if keys[:n] != [message_key(m) for m in p.messages] or not is_prefix(p.prompt_ids, c.prompt_ids):
            return False
        role, text, tcs = keys[n]
        # tool calls: the reply's own, or, for a reply that had none, those the harness parsed out of its text
        if role != "assistant" or text != loose(p.text) or (p.tool_calls and tcs != tool_call_keys(p.tool_calls)):
            return False
        if p.finish_reason not in ("stop", "tool_calls"):
            return None
        try:
            return c.prompt_ids.index(p.completion_ids[-1], len(p.prompt_ids)) + 1
        except ValueError:
            return False

    # -- rule 5: links ---------------------------------------------------------------------------
    def output_hits(self) -> dict[int, int]:
        """``hit[x]``: the earliest later call of another session whose non-assistant messages hold
        session x's returned text, leaving out x's own compactions (they repeat x's history)."""
        calls, ro, sessions, call_sess = self.calls, self.ro, self.sessions, self.call_sess
        hit: dict[int, int] = {}
        if not self.rules.link_by_output:
            return hit
        for x in sessions[1:]:
            own = {c.idx for c in sessions if c.parent == x.idx and c.kind == "compaction"}
            last_i = x.calls[-1]
            text = calls[last_i].text
            for j in range(last_i + 1, len(calls)):
                if call_sess[j] != x.idx and call_sess[j] not in own and ro.appears_in(text, j):
                    hit[x.idx] = j
                    break
        return hit

    def link_summaries(self, hit: dict[int, int]) -> None:
        """5a: an instruction compaction's successor is the new session its summary opens."""
        sessions, call_sess = self.sessions, self.call_sess
        for x in sessions:
            if x.kind == "compaction" and x.idx in hit and self._opens(hit[x.idx]):
                y = sessions[call_sess[hit[x.idx]]]
                if y.idx > x.idx and y.parent is None and y.kind != "compaction":
                    x.successor, y.parent, y.edge = y.idx, x.idx, "continues"

    def find_output_compactions(self, hit: dict[int, int]) -> None:
        """5b: a new session Y that restarts an agent (its first message is an earlier session's) and
        whose first prompt holds earlier sessions' text: the latest-started of them wrote the summary."""
        sessions, first_message = self.sessions, self._first_message
        for y in sessions[1:]:
            if y.parent is not None or y.kind == "compaction":
                continue
            fm = first_message(y)
            if fm is None or not any(first_message(s) == fm for s in sessions[: y.idx]):
                continue
            cands = [x for x in sessions[1: y.idx] if x.kind != "compaction" and x.parent is None
                     and x.successor is None and hit.get(x.idx) == y.calls[0]]
            if cands:
                x = max(cands, key=lambda s: s.calls[0])
                x.kind, x.successor = "compaction", y.idx
                x.meta.setdefault("by", "output")
                y.parent, y.edge = x.idx, "continues"

    def parent_compactions(self) -> None:
        """5d: a compaction that extends no session's tip belongs to the session whose request history
        its prompt reproduces best (share of that history's text, by characters), among the sessions
        still open when it started (not compactions, not already compacted, not finished with a reply
        and no later call). Below ``min_parent_score``: the agent session active most recently."""
        sessions, calls = self.sessions, self.calls
        for x in sorted(sessions, key=lambda s: s.calls[0]):
            if x.kind != "compaction":
                continue
            if x.successor is None and not any(s.parent == x.idx for s in sessions):
                x.meta["no_successor"] = True
            if x.parent is not None:
                continue
            first = x.calls[0]
            scored = []
            for s in sessions:
                before = [k for k, ci in enumerate(s.calls) if ci < first]
                if s.kind == "compaction" or not before or self._closed(s, first):
                    continue
                k = before[-1]
                scored.append((self._reproduced(calls[s.calls[k]], first), calls[s.calls[k]].t_start, s.idx, k))
            if not scored:
                continue
            scored.sort(key=lambda t: (t[0], t[1]))
            score, _, p, k = scored[-1]
            if score >= self.rules.min_parent_score:
                x.meta["parent_by"] = "history"
                x.meta["parent_score"] = round(score, 4)
                ties = [t[2] for t in scored[:-1] if abs(t[0] - score) < 1e-9]
                if ties:
                    x.meta["parent_ambiguous"] = ties
            else:  # no evidence: the agent (the root or a compaction's successor) active most recently
                agents = {0} | {c.successor for c in sessions if c.successor is not None}
                recent = [t for t in scored if t[2] in agents]
                if not recent:
                    continue
                _, _, p, k = max(recent, key=lambda t: (self.calls[sessions[t[2]].calls[t[3]]].t_start, t[2]))
                x.meta["parent_by"] = "recency"
            x.parent, x.edge = p, "continues"
            added = x.meta["parent_by"] == "history" and self._history_tail(self.calls[x.calls[0]], sessions[p], x, k)
            x.parent_upto = len(sessions[p].prompt) + len(sessions[p].comp) if added else sessions[p].end_of(k, calls)

    def _closed(self, s: SessionDraft, first: int) -> bool:
        """Whether session s was over when call ``first`` started: compacted already, or its last call
        came before and ended with a reply (no tool call left to answer)."""
        if s.idx == 0:
            return any(c.parent == 0 and c.kind == "compaction" and c.calls[0] < first for c in self.sessions)
        if any(c.parent == s.idx and c.kind == "compaction" and c.calls[0] < first for c in self.sessions):
            return True
        last = self.calls[s.calls[-1]]
        return s.calls[-1] < first and last.finish_reason == "stop" and not last.tool_calls

    def _reproduced(self, c: CallRecord, j: int) -> float:
        """Share (by characters) of call c's history texts found in call j's request text."""
        texts = history_texts(c)
        total = sum(len(t) for t in texts)
        if not total:
            return 0.0
        hay = f" {self.ro.loose_request(j)} "
        return sum(len(t) for t in texts if f" {t} " in hay) / total

    def link_subagents(self, hit: dict[int, int], successor_of: dict[int, int]) -> dict[int, int]:
        """5c: subagents, by where their result reappears: a later turn of a running session (a tool
        result), or the first prompt of a compaction or of its successor (the result was in the
        history that got summarised or kept; the parent is resolved by :meth:`resolve_via`)."""
        sessions, call_sess = self.sessions, self.call_sess
        via: dict[int, int] = {}
        for x in sessions[1:]:
            if x.kind == "compaction" or x.parent is not None:
                continue
            j = hit.get(chain_end(self.sessions, x).idx)
            if j is None:
                continue
            y = sessions[call_sess[j]]
            if not self._opens(j):
                x.kind, x.parent, x.edge = "subagent", y.idx, "forks"
                pos = y.calls.index(j)
                x.fork_before, x.fork_after = y.offsets[pos - 1], y.offsets[pos]
                x.meta["parent_by"] = "result"
            elif y.kind == "compaction":
                x.kind, via[x.idx] = "subagent", y.idx
            elif y.idx in successor_of:
                x.kind, via[x.idx] = "subagent", successor_of[y.idx]
        return via

    def link_resets(self) -> None:
        """5f: a session still without a parent that restarts the agent — its first message (the system
        prompt) equals that of an agent session (the root's lineage: main or reset) that had finished before
        it started and has no successor yet — is that session's context reset: both become ``reset``
        sessions, the new one ``continues`` the old (the latest such; ``meta["by"] = "reset"``). What carries
        over (notes) is in its prompt, like a compaction's summary, but no model call wrote it as a summary."""
        sessions = self.sessions
        taken = {x.parent for x in sessions if x.edge == "continues"}
        for y in sorted(sessions[1:], key=lambda s: s.calls[0]):
            if y.parent is not None or y.kind == "compaction":
                continue
            first = self._first_message(y)
            cands = [x for x in sessions if x is not y and x.kind in ("main", "reset") and x.idx not in taken
                     and (x.idx == 0 or x.parent is not None) and x.calls[-1] < y.calls[0]
                     and first is not None and self._first_message(x) == first]  # fmt: skip
            if not cands:
                continue
            x = max(cands, key=lambda s: s.calls[-1])
            x.kind, y.kind, y.parent, y.edge = "reset", "reset", x.idx, "continues"
            y.meta["by"] = "reset"
            taken.add(x.idx)

    def link_forward(self) -> None:
        """5e: a session still without a parent whose first user message is, loosely, a string argument
        of an earlier tool call of another session was opened by that call: a subagent forked by it
        (the latest such call; others are listed in ``meta["ambiguous_with"]``)."""
        sessions, calls = self.sessions, self.calls
        for x in sessions[1:]:
            if x.kind == "compaction" or x.parent is not None:
                continue
            c = calls[x.calls[0]]
            users = [loose(content_text(m.get("content"))) for m in c.messages
                     if isinstance(m, dict) and m.get("role") == "user"]
            if c.endpoint != "chat" or not users or not users[0]:
                continue
            cands = [j for j in range(x.calls[0]) if self.call_sess[j] != x.idx
                     and sessions[self.call_sess[j]].kind != "compaction"
                     and users[0] in tool_call_strings(calls[j].tool_calls)]
            if not cands:
                continue
            j = cands[-1]
            p = sessions[self.call_sess[j]]
            pos = p.calls.index(j)
            x.kind, x.parent, x.edge = "subagent", p.idx, "forks"
            x.fork_before = p.offsets[pos]
            x.meta["parent_by"] = "tool_call"
            x.meta["forked_by_call"] = calls[j].call_id
            if len(cands) > 1:
                x.meta["ambiguous_with"] = [calls[k].call_id for k in cands[:-1]]

    def resolve_via(self, via: dict[int, int]) -> None:
        """5c, continued: a subagent seen only in a compaction's history forks from the compacted session."""
        sessions = self.sessions
        for xi, ci in via.items():
            x, c = sessions[xi], sessions[ci]
            if x.parent is not None:  # 5e found the call that opened it
                continue
            if c.parent is None:
                x.kind = "main"
                continue
            x.parent, x.edge = c.parent, "forks"
            p = sessions[c.parent]
            # The parent's last turn before the fork; its result was never seen in a parent prompt.
            before = [k for k, ci2 in enumerate(p.calls) if ci2 < x.calls[0]]
            x.fork_before = p.offsets[before[-1]] if before else p.offsets[0]
            x.fork_after = c.parent_upto
            x.meta["result_seen_in"] = "compaction"

    def fork_results(self, hit: dict[int, int]) -> None:
        """States of subagents linked by the call that opened them (5e): the parent's context once the
        result of the subagent's chain was inserted, if a later parent turn shows it; else the context
        right after the calling turn (``meta["result_unseen"]``)."""
        sessions, calls = self.sessions, self.calls
        for x in sessions:
            if x.kind != "subagent" or x.edge != "forks" or x.fork_after is not None or x.fork_before is None:
                continue
            p = sessions[x.parent]
            j = hit.get(chain_end(self.sessions, x).idx)
            seen = sessions[self.call_sess[j]] if j is not None else None
            if j is not None and self.call_sess[j] == p.idx:
                x.fork_after = p.offsets[p.calls.index(j)]
            elif (seen is not None and seen.kind == "compaction" and seen.parent == p.idx and x.fork_before == p.offsets[-1]
                  and seen.meta.get("history_tail") == TAIL_ADDED):  # its result is in the tail now ending p's row
                x.fork_after, x.meta["result_seen_in"] = seen.parent_upto, "compaction"
            else:
                pos = p.offsets.index(x.fork_before)
                x.fork_after = p.end_of(pos, calls)
                x.meta["result_unseen"] = True

    # -- rule 6: the final session ---------------------------------------------------------------
    def final(self) -> int:
        """Rule 6: the last main of the root agent's lineage (root → compaction → successor → ...).
        Where the lineage branches (several compactions of one session), the branch whose end states
        the posted answer wins, else the one whose end replied last; the choice is flagged in the
        final session's ``meta["final_by"]``."""
        sessions, calls = self.sessions, self.calls
        cur, seen = 0, {0}
        while True:
            reset = [s for s in sessions if s.parent == cur and s.edge == "continues" and s.kind == "reset"]
            if reset:  # 5f: the agent's context was reset; its lineage goes on in the next session
                cur = reset[0].idx
                seen.add(cur)
                continue
            nxt = [s for s in sessions if s.parent == cur and s.edge == "continues" and s.kind == "compaction"
                   and s.successor is not None and s.successor not in seen]
            if not nxt:
                break
            if len(nxt) > 1:
                ends = [chain_end(self.sessions, sessions[s.successor]) for s in nxt]
                answer = self.answer

                def says(k: int) -> bool:
                    return bool(answer) and f" {answer} " in f" {loose(calls[ends[k].calls[-1]].text)} "

                pick = max(range(len(nxt)), key=lambda k: (says(k), calls[ends[k].calls[-1]].finish_reason == "stop",
                                                           calls[ends[k].calls[-1]].t_end))
                nxt = [nxt[pick]]
                sessions[ends[pick].idx].meta["final_by"] = "answer" if says(pick) else "latest_reply"
            cur = nxt[0].successor
            seen.add(cur)
        return cur if sessions[cur].kind in ("main", "reset") else 0
