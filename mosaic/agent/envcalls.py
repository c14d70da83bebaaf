"""The harness's calls out to its environment (a mixin of :class:`~mosaic.agent.harness.Harness`): text
made safe where it enters, the search tool, a multi-tool environment's calls and its final scoring.
Every failure is a counted tool error the model can read, never a lost trajectory."""

from __future__ import annotations

from mosaic.agent.episode import RunState
from mosaic.agent.tools import Action, safe_text

__all__ = ["EnvCalls"]


class EnvCalls:
    """Uses the harness's ``env``, ``hooks`` and ``config``."""

    def _safe(self, run: RunState, text: str) -> str:
        """``text`` from outside made safe (:func:`safe_text`); a replacement is counted."""
        text, changed = safe_text(text)
        if changed:
            run.counters["sanitized_text"] += 1
        return text

    def _search(self, run: RunState, query: str) -> str:
        try:
            out = self.env.search(query, self.config.search_k)
            if not isinstance(out, str):
                raise TypeError(f"the environment returned {type(out).__name__}, not text")
        except Exception as exc:  # a tool failure is visible to the model and in metrics
            run.counters["tool_errors"] += 1
            out = f"Error (tool_error): search failed: {type(exc).__name__}: {exc}"
        return self._safe(run, out)

    def _env_call(self, run: RunState, action: Action) -> str:
        """A multi-tool environment's call; an exception (bad arguments included) is a counted tool error."""
        try:
            out = self.hooks.call(run.traj.id, action.name, action.meta["arguments"])
            if not isinstance(out, str):
                raise TypeError(f"the environment returned {type(out).__name__}, not text")
        except Exception as exc:
            run.counters["tool_errors"] += 1
            out = f"Error (tool_error): {action.name}: {exc}"
        return self._safe(run, out)

    def _env_finish(self, run: RunState, text: str | None) -> dict:
        """Score and free the environment's rollout (once); its outcome lands in ``traj.meta["env"]``."""
        if "env" not in run.traj.meta:
            try:
                run.traj.meta["env"] = self.hooks.finish(run.traj.id, text)
            except Exception as exc:  # a scoring failure is counted, never a lost trajectory
                run.counters["tool_errors"] += 1
                run.traj.meta["env"] = {"reward": 0.0, "error": self._safe(run, f"{type(exc).__name__}: {exc}")}
        return run.traj.meta["env"]
