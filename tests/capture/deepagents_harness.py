"""Run deepagents (a real third-party harness) against an OpenAI-compatible base URL.

Executed with the interpreter of ``<repo>/.venv-deepagents`` (deepagents and
langchain live there, not in the core environment). Arguments: a JSON object
with ``proxy`` (the proxy's root URL), ``rollouts`` (list of
``{"id", "task", "stream"}``), ``trigger`` and ``keep`` (message counts for
deepagents' ``SummarizationMiddleware``). Prints one JSON line per rollout:
its id, final answer, and the message counts the harness ended with.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    args = json.loads(sys.argv[1])
    from deepagents import create_deep_agent
    from deepagents.backends import StateBackend
    from deepagents.middleware.summarization import SummarizationMiddleware
    from langchain_openai import ChatOpenAI

    for r in args["rollouts"]:
        llm = ChatOpenAI(model="scripted", base_url=f"{args['proxy']}/rollouts/{r['id']}/v1", api_key="sk-none",
                         temperature=0, max_retries=0, streaming=bool(r.get("stream")), timeout=120)
        summ = SummarizationMiddleware(model=llm, backend=StateBackend(),
                                       trigger=("messages", args["trigger"]), keep=("messages", args["keep"]))
        agent = create_deep_agent(model=llm, system_prompt="You are a research agent. Delegate, then answer.",
                                  middleware=[summ])
        out = agent.invoke({"messages": [{"role": "user", "content": r["task"]}]},
                           config={"recursion_limit": 200})
        msgs = out["messages"]
        print(json.dumps({"id": r["id"], "answer": msgs[-1].content, "messages": len(msgs)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
