"""The agent loop (docs/algorithm.md §2): batched multi-session rollouts with exact token records.

Many trajectories run at once (all tasks × ``group_size``). Each trajectory has
at most one session waiting for a turn at a time (a parent waits while its
subagent works), so a step collects one request per unfinished trajectory, sends
them all to ``policy.generate`` in one call, then applies each result: append the
sampled ids (trainable) and whatever the harness inserts (end-of-turn if the
turn hit its length cap, tool responses, generation headers: not trainable).

Records are token-in, token-out: a session's ``prompt_ids`` are exactly its first
request's ids; every later request is ``prompt_ids + completion_ids`` at that
moment. Nothing is decoded and re-encoded, except a compaction summary, whose
text is put into the *next* session's prompt (that prompt is recorded as fed).

States (docs/algorithm.md §4.4), all at message boundaries:
- main: before = its prompt without the generation header; after = its whole
  context at its end;
- compaction: before = the previous main's end (the same reference, so the
  scorer probes it once); after = the next main's ``state_before``;
- subagent (``subagent_states=merge``, the default): before = the parent's context before the
  assistant turn that called ``delegate``; after = the parent's context right after the
  result was appended; (``own``): its own prompt without the header, and its own end.
  Either way ``meta["merged_at"]`` records where its result lies in the parent (the
  downstream credit of docs/algorithm.md §4.10 replaces it by an empty result);
- reset (``harness.mode=reset``, :mod:`mosaic.agent.reset`): before = its prompt without the
  generation header; after = the next reset session's (the updated notes).
The turn-level probe points (docs/algorithm.md §4.7) are derived from the recorded tokens by
:func:`mosaic.trace.turn_boundaries` (the prompt without the header, then the end
of each turn's tool response). A session cut off mid-turn (policy error) ends at
the boundary before its pending generation header.

Text from outside is made safe once, where it enters (issue 11): a tool call's
argument (:func:`~mosaic.agent.tools.parse_action`), a tool's result, a task's
question and answer, a policy's error message. Lone surrogates (a JSON
``"\\udfff"`` escape in a call) become U+FFFD, so no string can crash
tokenisation, storage or JSON; each text replaced is counted in the
trajectory's ``meta["sanitized_text"]``. A tool that returns something other
than text is a counted ``tool_error``.

Simplifications (ours): one tool call per turn (extra calls in the same message
are ignored and counted); a compaction turn may exceed ``context_budget`` by the
instruction and ``summary_max_new_tokens`` (the model's positional limit must
allow it); subagents do not compact — a subagent that would overflow stops and
its parent receives an error; a main session that hits its turn cap ends the
trajectory.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from tqdm.auto import tqdm

from mosaic.agent.chat import ChatFormat
from mosaic.config.harness import (  # noqa: F401  (re-exported: the harness API)
    DEFAULT_COMPACTION_PROMPT, DEFAULT_RESUME_TEMPLATE, DEFAULT_SUBAGENT_PROMPT, DEFAULT_SYSTEM_PROMPT, MODES,
    TOOL_DOCS, HarnessConfig, Mode,
)
from mosaic.agent.policy import GenRequest, GenResult, Policy
from mosaic.agent.envcalls import EnvCalls
from mosaic.agent.forks import ForkSessions
from mosaic.agent.reset import RESET_TOOLS, ResetSessions
from mosaic.agent.tools import Action, parse_action
from mosaic.envs.rewards import score_answer
from mosaic.trace.graph import Session, StateRef, Trajectory, validate
from mosaic.agent.episode import (  # noqa: F401  (DeepSearchEnv, StateScorer re-exported: the harness API)
    DeepSearchEnv, EnvHooks, LiveSession, RunState, StateScorer, check_result,
)


class Harness(EnvCalls, ForkSessions, ResetSessions):
    """Runs trajectories of ``policy`` on ``env``'s tasks; see the module docstring."""

    def __init__(self, policy: Policy, chat: ChatFormat, env, config: HarnessConfig | None = None, *,
                 state_scorer: StateScorer | None = None, partner: Policy | None = None):
        """``state_scorer``: told, as each main session closes and before its cache is released, the
        states (docs/algorithm.md §4.4) that lie in that session, so it can probe them off the policy's live cache."""
        self.policy = policy
        self.chat = chat
        self.env = env
        self.hooks = EnvHooks(env)  # a multi-tool environment's optional hooks (none for deep search)
        self.config = config or HarnessConfig()
        self.state_scorer = state_scorer
        self.partner = partner  # (mode=reset) plays the partner's role's sessions; see mosaic.agent.reset
        if self.config.partner != "self" and partner is None:
            raise ValueError(f"harness.partner={self.config.partner!r}: give the harness its partner policy")
        if self.config.resets:
            self._check_reset_fits()

    # ------------------------------------------------------------------ public
    def run(self, tasks: Sequence, group_size: int = 1, seed: int = 0, *,
            on_trajectory: Callable[[Trajectory], None] | None = None, progress: bool | str = False,
            step: int | str | None = None) -> list[Trajectory]:
        """Roll out every task ``group_size`` times; returns validated trajectories (task-major).

        ``progress``: a progress bar over trajectories (a string: the bar's label, else ``rollout``)."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError("tasks contain duplicate ids; group ids would collide")
        runs = [self._start(task, g, step) for task in tasks for g in range(group_size)]
        self._seed = seed
        bar = None
        if progress:
            bar = tqdm(total=len(runs), desc=progress if isinstance(progress, str) else "rollout", unit="traj")
        pending = list(runs)
        try:
            while pending:
                reqs, owners = [], []
                for run in pending:
                    req = self._prepare(run)
                    if req is not None:
                        reqs.append(req)
                        owners.append(run)
                if reqs:
                    results = self._generate(reqs)
                    for run, req, res in zip(owners, reqs, results):
                        self._apply(run, req, res)
                still = []
                for run in pending:
                    if run.done:
                        self._finish(run)
                        if on_trajectory is not None:
                            on_trajectory(run.traj)
                        if bar is not None:
                            bar.update(1)
                    else:
                        still.append(run)
                pending = still
                if self.state_scorer is not None:
                    self.state_scorer.flush()
        finally:
            if bar is not None:
                bar.close()
        return [r.traj for r in runs]

    def _generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        """One round of turns: the trained policy's requests and the partner's, each in one call."""
        mine = [i for i, r in enumerate(reqs) if not r.meta.get("partner")]
        theirs = [i for i, r in enumerate(reqs) if r.meta.get("partner")]
        out: list[GenResult | None] = [None] * len(reqs)
        for pol, idx in ((self.policy, mine), (self.partner, theirs)):
            if not idx:
                continue
            results = pol.generate([reqs[i] for i in idx])
            if len(results) != len(idx):
                raise RuntimeError(f"policy returned {len(results)} results for {len(idx)} requests")
            for i, res in zip(idx, results):
                out[i] = res
        return out  # type: ignore[return-value]

    def _start(self, task, g: int, step: int | str | None) -> RunState:
        """Rollout ``g`` of ``task``: its trajectory and first session."""
        gid = task.id if step is None else f"{step}/{task.id}"
        traj = Trajectory(id=f"{gid}/{g}", task_id=task.id, group_id=gid, sessions=[], ground_truth=task.answer)
        run = RunState(traj, task, g)
        run.question = self._safe(run, task.question)
        if isinstance(task.answer, str):
            traj.ground_truth = self._safe(run, task.answer)
        self.hooks.open(traj.id, task)
        if self.config.resets:
            self._open_reset(run, parent=None)
        else:
            self._open_main(run, run.question, parent=None)
        return run

    # ------------------------------------------------------------------ sessions
    def _new_session(self, run: RunState, kind: str, prompt: list[int], parent: int | None, edge: str | None,
                     depth: int, question: str) -> LiveSession:
        s = Session(id=len(run.traj.sessions), kind=kind, prompt_ids=list(prompt), parent=parent, edge=edge)
        s.meta["depth"] = depth
        run.traj.sessions.append(s)
        live = LiveSession(s, f"{run.traj.id}/{s.id}", depth, question)
        run.stack.append(live)
        return live

    def _open_main(self, run: RunState, user: str, parent: int | None) -> LiveSession:
        prompt, boundary = self.chat.initial_prompt(self.hooks.system_text(self.config, 0, TOOL_DOCS["delegate"]), user)
        live = self._new_session(run, "main", prompt, parent, None if parent is None else "continues", 0,
                                 run.question)
        live.session.state_before = StateRef(session=live.session.id, upto=boundary)
        live.turn_start = boundary
        return live

    def _close(self, run: RunState, live: LiveSession, reason: str, *, ends: bool = False, handoff: str | None = None) -> None:
        """End ``live``. ``ends``: it ends the trajectory (its own end state is never probed); ``handoff``: the
        session key of a new session whose prompt extends this one's context (it takes over the cache)."""
        s = live.session
        s.end_reason = reason
        # A session cut off while a turn was pending ends after a generation header: its end state
        # is the boundary before that header.
        end = live.length if live.at_boundary else live.turn_start
        if s.kind == "main" or (s.kind == "reset" and ends):  # (a reset session's that goes on: the next one's start)
            s.state_after = StateRef(session=s.id, upto=None if end == live.length else end)
        if self.state_scorer is not None:
            own = s.kind == "subagent" and self.config.subagent_states == "own"
            cuts = self._hosted_cuts(run.traj, s, ends and not own) if s.kind in ("main", "reset") or own else []
            self.state_scorer.session_closed(run.traj, s, live.key, cuts, next_key=handoff)
        run.stack.remove(live)
        pol = self.partner if s.meta.get("partner") else self.policy
        give = getattr(pol, "handoff", None)
        if handoff is not None and give is not None:
            give(live.key, handoff)
        else:
            pol.release(live.key)

    @staticmethod
    def _hosted_cuts(traj: Trajectory, host: Session, ends: bool) -> list[int]:
        """Lengths of the states (docs/algorithm.md §4.4) that are prefixes of ``host``: its own start and end,
        the fork and merge points of its subagents, the compaction that ends it. All are known when it closes (its
        subagents closed before it). A session that ends the trajectory is final: its own states are unused
        (its start is still probed when the compaction before it ends there)."""
        cuts: set[int] = set()
        for s in traj.sessions:
            for ref in (s.state_before, s.state_after):
                if ref is None or (s is host and ends):  # (a compaction's end = its start: still counted)
                    continue
                key = traj.state_key(ref)
                if key[0] == "session" and key[1] == host.id and key[2] >= 1:
                    cuts.add(key[2])
        return sorted(cuts)

    def _append(self, run: RunState, live: LiveSession, ids: list[int], mask: list[bool] | None = None,
                logprobs: list[float] | None = None, inserted: int | None = None) -> None:
        """Append tokens to a live session; ``inserted`` counts the harness's own tokens among them when the
        mask cannot tell (a partner's sampled turn is masked out but was sampled, not inserted)."""
        s = live.session
        mask = [False] * len(ids) if mask is None else mask
        s.completion_ids += ids
        s.loss_mask += mask
        s.logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        run.counters["tokens_inserted"] += sum(1 for m in mask if not m) if inserted is None else inserted

    def _end_trajectory(self, run: RunState, reason: str, *, reward: float = 0.0, answer: str | None = None) -> None:
        top = run.stack[-1] if run.stack else None
        for live in reversed(list(run.stack)):
            if live.session.kind == "compaction" and live.session.state_after is None:
                # its summary reached no session (the trajectory ended during it, e.g. a policy error): gain 0
                live.session.state_after = live.session.state_before
            if live.session.kind == "subagent":  # aborted: its result never reached the parent
                live.session.meta["aborted"] = True
                live.session.state_after = self._own_end(live) if self.config.subagent_states == "own" else \
                    StateRef(session=live.session.parent, upto=live.fork_boundary)
            self._close(run, live, reason if live is top else "aborted", ends=True)
        if self.hooks.finishes:
            self._env_finish(run, None)  # (no-op after an answer: already scored)
        run.traj.end_reason = reason
        run.traj.reward = float(reward)
        run.traj.success = reward >= self.config.success_threshold
        run.traj.answer = answer
        run.done = True

    # ------------------------------------------------------------------ one step
    def _prepare(self, run: RunState) -> GenRequest | None:
        """The next request of ``run``'s active session, after caps and compaction; None if it ended."""
        cfg = self.config
        live = run.stack[-1]
        budget = cfg.budget(live.session.kind)
        if live.session.kind == "compaction":
            return self._request(run, live, cfg.summary_max_new_tokens, budget)
        if live.session.kind == "reset":
            reason = self._reset_limit(run, live, budget)
            if reason == "reset":
                self._rotate(run, live, live.session.meta["reset_reason"])
                return self._prepare(run)
        else:
            reason = self._limit_reason(run, live, budget)
        if reason is None:
            self._open_turn(run, live)
            return self._request(run, live, cfg.max_new_tokens, budget)
        if live.session.kind == "subagent" and reason in ("turn_cap", "context_overflow"):
            self._return_to_parent(run, live, None, reason)
            return self._prepare(run)
        if reason == "compact":
            return self._request(run, self._start_compaction(run, live), cfg.summary_max_new_tokens, budget)
        self._end_trajectory(run, reason)
        return None

    def _limit_reason(self, run: RunState, live: LiveSession, budget: int) -> str | None:
        """Why a main or subagent session cannot take another turn as it is: a cap or an overflow
        (``"compact"`` when a compaction resolves it); None when it can."""
        cfg, s = self.config, live.session
        if run.total_turns >= cfg.max_total_turns:
            return "total_turn_cap"
        if cfg.max_total_tokens and run.counters["tokens_sampled"] >= cfg.max_total_tokens:
            return "token_cap"
        if s.num_turns >= (cfg.max_turns if s.kind == "main" else cfg.subagent_max_turns):
            return "turn_cap"
        header = len(self.chat.generation_header_ids) if live.at_boundary else 0
        if live.length + header + cfg.max_new_tokens <= budget:
            return None
        if s.kind == "subagent" or not cfg.compacts or s.num_turns == 0:
            # (a fresh main session that already overflows cannot be helped by compacting)
            return "context_overflow"
        if len(run.traj.sessions) + 2 > cfg.max_sessions:
            return "session_cap"
        return "compact"

    def _open_turn(self, run: RunState, live: LiveSession) -> None:
        """Append the generation header if the context rests at a message boundary."""
        if not live.at_boundary:
            return
        live.turn_start = live.length
        self._append(run, live, list(self.chat.generation_header_ids))
        live.at_boundary = False

    def _request(self, run: RunState, live: LiveSession, max_new: int, budget: int) -> GenRequest:
        cfg, s = self.config, live.session
        meta = {
            "task_id": run.task.id, "traj_id": run.traj.id, "sample": run.sample, "seed": self._seed,
            "kind": s.kind, "session": s.id, "turn": s.num_turns, "depth": live.depth,
            "question": live.question, "mode": cfg.mode,
            "tools": list(cfg.tools(live.depth)) if s.kind != "compaction" else [],
        }
        if s.kind == "reset":
            meta.update(calls_left=cfg.reset_k - s.num_turns, role=s.meta.get("role"), partner=s.meta.get("partner"))
        return GenRequest(live.key, s.prompt_ids + s.completion_ids, max_new, meta, context_budget=budget)

    def _start_compaction(self, run: RunState, main: LiveSession) -> LiveSession:
        prompt = main.session.tokens() + self.chat.user_delta(self.config.compaction_prompt) + list(
            self.chat.generation_header_ids)
        live = self._new_session(run, "compaction", prompt, main.session.id, "continues", 0, main.question)
        live.session.state_before = StateRef(session=main.session.id, upto=None)
        # Its prompt extends the main session's context: it takes over the main session's cache.
        self._close(run, main, "compaction", handoff=live.key)
        live.turn_start = len(prompt) - len(self.chat.generation_header_ids)
        run.counters["compactions"] += 1
        return live

    def _apply(self, run: RunState, req: GenRequest, res: GenResult) -> None:
        live = run.stack[-1]
        if res.finish_reason == "error":
            run.traj.meta["error"] = self._safe(run, str(res.error or "policy error"))
            self._end_trajectory(run, "policy_error")
            return
        check_result(req, res)
        text = self._record_turn(run, live, res)
        if live.session.kind == "compaction":
            summary = text.replace("<|im_end|>", "").strip()  # (other specials: sanitised in the prompt)
            self._close(run, live, "summary")
            question = self._safe(run, self.hooks.question(run.traj.id, run.question))
            new = self._open_main(run, self.config.resume_text(question, summary), parent=live.session.id)
            live.session.state_after = new.session.state_before
            return
        self._act(run, live, self._parse(live, text), text)

    def _record_turn(self, run: RunState, live: LiveSession, res: GenResult) -> str:
        """Append a sampled turn (and the tokens that close it); returns its text."""
        s = live.session
        sampled = list(res.token_ids)
        s.num_turns += 1
        if s.kind != "compaction":
            run.total_turns += 1
        run.counters["tokens_sampled"] += len(sampled)
        if res.finish_reason == "length":
            run.counters["length_stops"] += 1
        turn = self.chat.close_turn(sampled)
        lp = list(res.logprobs) + [0.0] * (len(turn.ids) - len(sampled))
        if s.meta.get("partner"):  # the partner's tokens: in the record, never trained
            self._append(run, live, turn.ids, [False] * len(turn.ids), [0.0] * len(turn.ids),
                         inserted=len(turn.ids) - len(sampled))
            run.counters["partner_tokens"] += len(sampled)
        else:
            self._append(run, live, turn.ids, turn.loss_mask, lp)
        live.at_boundary = True
        body = sampled[:-1] if sampled and sampled[-1] == self.chat.im_end_id else sampled
        return self.chat.decode(body)

    def _parse(self, live: LiveSession, text: str) -> Action:
        cfg = self.config
        allowed = (("search", "delegate") if cfg.forks else ("search", *RESET_TOOLS) if cfg.resets
                   else ("search",)) + self.hooks.tools
        action = parse_action(text, allowed, max_arg_chars=cfg.max_arg_chars, json_tools=self.hooks.tools)
        if action.kind == "call" and action.name == "delegate" and live.depth >= cfg.max_depth:
            action = Action("invalid", error="delegate_depth", sanitized=action.sanitized, message=(
                f"Error (delegate_depth): helpers at depth {live.depth} cannot delegate (limit "
                f"{cfg.max_depth}); search yourself."))
        return action

    def _act(self, run: RunState, live: LiveSession, action: Action, text: str) -> None:
        """Carry out a main or subagent session's action: answer, invalid, search or delegate."""
        if action.sanitized:  # its argument was made safe by parse_action
            run.counters["sanitized_text"] += 1
        if action.kind == "answer":
            if live.session.kind == "subagent":
                self._return_to_parent(run, live, action.answer or "", "answer")
                return
            score = score_answer(text, run.task.answer, self.config.reward_metric)
            run.traj.meta["answer_status"] = score.status
            reward = self._env_finish(run, text)["reward"] if self.hooks.finishes else score.reward
            self._end_trajectory(run, "answer", reward=reward, answer=score.answer)
        elif action.kind == "invalid":
            run.invalid[action.error] += 1
            self._append(run, live, self.chat.tool_delta(action.message))
        else:
            run.tool_calls[action.name] += 1
            run.counters["extra_tool_calls"] += action.extra_calls
            if action.name == "search":
                self._append(run, live, self.chat.tool_delta(self._search(run, action.argument)))
            elif action.name in self.hooks.tools:
                self._append(run, live, self.chat.tool_delta(self._env_call(run, action)))
            elif action.name in RESET_TOOLS:
                self._reset_act(run, live, action.name, action.argument)
            else:
                self._delegate(run, live, action.argument)

    def _finish(self, run: RunState) -> None:
        traj = run.traj
        mains = [s for s in traj.sessions if s.kind in ("main", "reset")]
        mains[-1].is_final = True
        if self.config.resets:
            self._keep_bare_prompt(run, mains[-1])
            mains[-1].meta.setdefault("notes_after", list(run.notes))
            traj.meta["notes"] = list(run.notes)
            traj.meta.update({k: run.counters[k] for k in ("resets", "notes_written", "workspace_full", "partner_tokens")})
        kinds = Counter(s.kind for s in traj.sessions)
        traj.meta.update({
            "mode": self.config.mode,
            "hops": getattr(run.task, "hops", None),
            "turns": run.total_turns,
            "sessions": dict(kinds),
            "compactions": run.counters["compactions"],
            "forks": run.counters["forks"],
            "tool_calls": dict(run.tool_calls),
            "invalid_actions": dict(run.invalid),
            "num_invalid": sum(run.invalid.values()),
            "tokens_sampled": run.counters["tokens_sampled"],
            "tokens_inserted": run.counters["tokens_inserted"],
            "length_stops": run.counters["length_stops"],
            "extra_tool_calls": run.counters["extra_tool_calls"],
            "subagent_answers": run.counters["subagent_answers"],
            "subagent_failures": run.counters["subagent_failures"],
            "tool_errors": run.counters["tool_errors"],
            "sanitized_text": run.counters["sanitized_text"],
        })
        hook = getattr(self.policy, "trajectory_meta", None)
        if callable(hook):
            extra = hook(traj.id)
            if extra:
                traj.meta["policy"] = extra
        validate(traj)
