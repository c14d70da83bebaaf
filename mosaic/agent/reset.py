"""Context-reset sessions (``harness.mode=reset``; HMA, docs/algorithm.md §2): what the harness does
differently when every session starts from a fresh context.

A reset session's prompt is the system prompt, the question and the **workspace** rendered as text
(:meth:`~mosaic.config.harness.HarnessConfig.reset_text`). The workspace is a list of notes kept in
the trajectory's :class:`~mosaic.agent.episode.RunState`; the policy adds to it with
``note_write(text)`` and ``handoff(note)`` (which also ends the session), and it persists across the
trajectory's sessions. Its size is capped (``harness.workspace_chars``): a note that does not fit is
refused with an error the model reads, counted as ``workspace_full``. A session ends after
``harness.reset_k`` actions (``reset_cap``), at a hand-off (``handoff``), or when its context would
overflow (``context_reset``); the next session is a new ``reset`` session (edge ``continues``) whose
prompt holds the updated notes. The notes a session started from and ended with are recorded in its
``meta`` (``notes_before``, ``notes_after``) and the final notes in ``traj.meta["notes"]``.

Gain states (docs/algorithm.md §4.4): before = the session's own prompt (which includes the
workspace), after = the next session's prompt (the updated workspace) — the same reference, so the
scorer probes it once. The final session is the one that answers (or is cut off).

Two roles (``harness.reset_roles``) alternate from session to session, each told its role in the system
prompt (``meta["role"]``). The second role may be played by a **partner** (``harness.partner``): a frozen
copy of the warm start or the scripted expert, given to the harness as its ``partner`` policy; a partner
session's requests go to it, its sampled tokens get loss mask 0 (``meta["partner"]``: no training row
comes from it, "central-only" training), and it stays in the graph, so its gain is measured.
"""

from __future__ import annotations

from mosaic.agent.episode import LiveSession, RunState
from mosaic.config.harness import TOOL_DOCS
from mosaic.config.values import ConfigError
from mosaic.trace.graph import StateRef

__all__ = ["ResetSessions", "RESET_TOOLS", "reset_counts"]

RESET_TOOLS = ("note_write", "handoff")
"""The workspace tools of reset mode (besides ``search``)."""


def reset_counts(trajs) -> dict[str, float]:
    """Reset mode's counters per trajectory (means over the trajectories that ran in reset mode; {} for
    none): ``resets``, ``notes_written``, ``workspace_full`` (notes refused for the size budget),
    ``partner_sessions`` (sessions played by a frozen or expert partner: no training rows) and
    ``partner_tokens`` (the tokens they sampled)."""
    runs = [t for t in trajs if "resets" in t.meta]
    if not runs:
        return {}
    out = {k: sum(t.meta.get(k, 0) for t in runs) / len(runs)
           for k in ("resets", "notes_written", "workspace_full", "partner_tokens")}
    out["partner_sessions"] = sum(1 for t in runs for s in t.sessions if s.meta.get("partner")) / len(runs)
    return out


class ResetSessions:
    """The reset-mode part of :class:`~mosaic.agent.harness.Harness` (a mixin: it uses the harness's
    ``config``, ``chat``, ``hooks`` and session helpers)."""

    def _check_reset_fits(self) -> None:
        """Refuse (:class:`ConfigError`) a reset budget that cannot hold a fresh session: its prompt with an
        empty question and an empty workspace plus one reply's ``max_new_tokens`` (else every trajectory would
        end at once, ``context_overflow``, and a run would train on nothing)."""
        cfg = self.config
        roles = range(len(cfg.reset_roles)) if cfg.reset_roles else [None]
        prompt = max(len(self.chat.initial_prompt(self._reset_system(r), cfg.reset_text("", []))[0]) for r in roles)
        budget = cfg.budget("reset")
        if prompt + cfg.max_new_tokens > budget:
            raise ConfigError(f"harness.reset_context_budget: a fresh reset session's prompt is {prompt} tokens "
                             f"before any question or note, and a reply may take max_new_tokens="
                             f"{cfg.max_new_tokens}; the reset budget {budget} cannot hold them (raise "
                             f"harness.reset_context_budget, 0 = context_budget, or lower harness.max_new_tokens)")

    def _reset_system(self, role: int | None) -> str:
        system = self.hooks.system_text(self.config, 0, TOOL_DOCS["delegate"])
        return system if role is None else system + f"\nYour role: {self.config.reset_roles[role]}"

    def _keep_bare_prompt(self, run: RunState, final) -> None:
        """For the final reset session of a run with roles: its prompt with an empty workspace (same role),
        kept in ``traj.states`` and named by ``meta["bare_state"]`` — what the downstream credit puts in
        place of the notes (docs/algorithm.md §4.10); without roles the root's prompt is that already."""
        if final.kind != "reset" or final.meta.get("role") is None or final.parent is None:
            return
        ids, boundary = self.chat.initial_prompt(self._reset_system(final.meta["role"]),
                                                 self.config.reset_text(final.meta.get("question", run.question), []))
        run.traj.states.append(ids[:boundary])
        final.meta["bare_state"] = len(run.traj.states) - 1

    def _open_reset(self, run: RunState, parent: int | None) -> LiveSession:
        cfg = self.config
        role = cfg.role_of(sum(1 for s in run.traj.sessions if s.kind == "reset"))
        system = self._reset_system(role)
        question = self._safe(run, self.hooks.question(run.traj.id, run.question))  # a service episode: its visit now
        prompt, boundary = self.chat.initial_prompt(system, self.config.reset_text(question, run.notes))
        live = self._new_session(run, "reset", prompt, parent, None if parent is None else "continues", 0, question)
        if question != run.question:  # (a later visit of a service episode: what the bare prompt restates)
            live.session.meta["question"] = question
        live.session.state_before = StateRef(session=live.session.id, upto=boundary)
        live.session.meta["notes_before"] = list(run.notes)
        if role is not None:
            live.session.meta["role"] = role
            live.session.meta["role_text"] = cfg.reset_roles[role]  # (what its system prompt told it)
            if cfg.partner_plays(role):
                live.session.meta["partner"] = cfg.partner  # its tokens are not trained (loss mask 0)
        live.turn_start = boundary
        return live

    def _reset_limit(self, run: RunState, live: LiveSession, budget: int) -> str | None:
        """Why a reset session cannot take another turn: ``"reset"`` when the next session resolves it
        (its action cap, or a context that would overflow after some work), else a cap that ends the
        trajectory; None when it can go on."""
        cfg, s = self.config, live.session
        if run.total_turns >= cfg.max_total_turns:
            return "total_turn_cap"
        if cfg.max_total_tokens and run.counters["tokens_sampled"] >= cfg.max_total_tokens:
            return "token_cap"
        header = len(self.chat.generation_header_ids) if live.at_boundary else 0
        fits = live.length + header + cfg.max_new_tokens <= budget
        if s.num_turns < cfg.reset_k and fits:
            return None
        if not fits and s.num_turns == 0:
            return "context_overflow"  # a fresh session that already overflows: the notes are too long
        if len(run.traj.sessions) + 1 > cfg.max_sessions:
            return "session_cap"
        live.session.meta["reset_reason"] = "reset_cap" if fits else "context_reset"
        return "reset"

    def _rotate(self, run: RunState, live: LiveSession, reason: str) -> LiveSession:
        """End ``live`` and open the next reset session from the current notes."""
        live.session.meta["notes_after"] = list(run.notes)
        self._close(run, live, reason)
        new = self._open_reset(run, parent=live.session.id)
        live.session.state_after = new.session.state_before
        run.counters["resets"] += 1
        return new

    def _note(self, run: RunState, text: str) -> str:
        """Add ``text`` to the workspace; the tool response (an error when it does not fit)."""
        cfg = self.config
        text = " ".join(text.split())
        used = len("\n".join(run.notes))
        after = len("\n".join([*run.notes, text]))
        if after > cfg.workspace_chars:
            run.counters["workspace_full"] += 1
            return (f"Error (workspace_full): the notes hold {used} of {cfg.workspace_chars} characters; a note "
                    f"of {len(text)} does not fit. Keep notes short; the notes so far are kept.")
        run.notes.append(text)
        run.counters["notes_written"] += 1
        return f"Noted ({after} of {cfg.workspace_chars} characters in the workspace)."

    def _reset_act(self, run: RunState, live: LiveSession, name: str, argument: str) -> None:
        """``note_write`` or ``handoff`` in a reset session."""
        self._append(run, live, self.chat.tool_delta(self._note(run, argument)))
        if name != "handoff":
            return
        live.session.meta["reset_reason"] = "handoff"
        if len(run.traj.sessions) + 1 > self.config.max_sessions:
            self._end_trajectory(run, "session_cap")
        else:
            self._rotate(run, live, "handoff")
