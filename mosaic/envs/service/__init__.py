"""The service family: multi-visit customer-service episodes where what the agent knew goes stale.

A second task family beside deep search (issue 29). One user's account lives in an in-process SQLite
database; between the user's visits the world changes (orders ship, the plan lapses, the user moves),
some changes announced by the user, some visible only in the backend. Each visit asks for consequential
actions whose correct form depends on the state at that moment; the last visit ends with a question.

- ``state``    the account model in plain Python: the service rules, required actions, answers, the
               fields an action relies on
- ``world``    :class:`ServiceConfig` (the knobs) and the seeded generator of :class:`Episode`
- ``text``     visit messages, announcements, lookup formats (and their parsers)
- ``backend``  the SQLite backend and its business rules
- ``tools``    the tools (JSON arguments, text results, counted errors) and :class:`ServiceEnv`
- ``rewards``  success, visits handled, stale actions (:class:`StaleTracker`)
- ``expert``   the revalidating and the trusting scripted experts; :func:`run_episode`
- ``splits``   train / validation / test, disjoint by user and entity names
"""

from mosaic.envs.service.expert import ServiceExpert, parse_call, run_episode, tool_call_text
from mosaic.envs.service.rewards import ServiceOutcome, StaleTracker
from mosaic.envs.service.state import SERVICE_RULES, Call, Request, call
from mosaic.envs.service.tools import TOOLS, ServiceEnv, ToolError, check_args, tool_docs
from mosaic.envs.service.world import Episode, Event, ServiceConfig, Visit, generate_episodes

__all__ = [
    "ServiceExpert", "parse_call", "run_episode", "tool_call_text", "ServiceOutcome", "StaleTracker",
    "SERVICE_RULES", "Call", "Request", "call", "TOOLS", "ServiceEnv", "ToolError", "check_args", "tool_docs",
    "Episode", "Event", "ServiceConfig", "Visit", "generate_episodes",
]
