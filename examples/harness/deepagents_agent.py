"""deepagents (LangChain's agent harness, from PyPI) as the rollout source of `mosaic train`.

Its own ``SummarizationMiddleware`` compacts the history and its ``SubAgentMiddleware`` forks helpers
through the ``task`` tool: the sessions Mosaic credits are the ones deepagents makes. It runs in its own
environment (deepagents and LangChain are not Mosaic dependencies), as a shell command that gets the
rollout from ``MOSAIC_*`` variables and prints its answer last. Build the environment and train:

    python bench/_peers.py deepagents          # .venv-deepagents, pinned by constraints-deepagents.txt
    mosaic train rollout.source=harness \\
        "rollout.harness=.venv-deepagents/bin/python examples/harness/deepagents_agent.py"

The prompts are short and in the embedded model's format (its 2,048 positions cannot hold deepagents'
default prompts and tool descriptions), and the server is asked not to append the tools' JSON schemas
(``tools_in_prompt``: the system prompt documents them; with the schemas appended the embedded model
wrote malformed calls). ``DA_SUBAGENTS`` picks the sub-agents: ``delegate`` (default) is the helper
tool the embedded model was trained with, a LangChain agent with a fresh context per call, as
deepagents' own sub-agents are; ``task`` is deepagents' ``SubAgentMiddleware`` (the embedded model
does not know that tool and keeps calling ``delegate``; a model that knows tool calling uses it);
``none``. ``DA_TRIGGER`` (approximate tokens, default 700) sets when deepagents summarises.
"""

import json
import os
import re
import sys
import time

import httpx
from deepagents.backends import StateBackend
from deepagents.middleware.subagents import SubAgentMiddleware
from deepagents.middleware.summarization import SummarizationMiddleware
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

SEARCH_DOC = ('- search(query): the best-matching encyclopedia passages. '
              'Example: <tool_call>{"name": "search", "arguments": {"query": "NAME relation"}}</tool_call>')
TASK_DOC = ('- task(description, subagent_type): a helper answers a sub-question with its own searches. Example: '
            '<tool_call>{"name": "task", "arguments": {"description": "Who is the founder of NAME?", '
            '"subagent_type": "helper"}}</tool_call>')
DELEGATE_DOC = ('- delegate(question): a helper answers a sub-question with its own searches and returns its '
                'answer. Example: <tool_call>{"name": "delegate", "arguments": {"question": "Who is the founder of '
                'NAME?"}}</tool_call>')
SYSTEM = ("You answer questions about a fictional world by searching its encyclopedia.\nTools:\n{tools}\n"
          "Make one tool call per turn. Each question needs several searches, one per step of its chain; search "
          "for an entity name plus a relation word. When you know the answer, reply with <answer>NAME</answer>, "
          "giving the entity's full name.")
HELPER = ("You are a helper. Answer one sub-question about a fictional world by searching its encyclopedia.\n"
          "Tools:\n" + SEARCH_DOC + "\nMake one tool call per turn. When you know the answer, reply with "
          "<answer>NAME</answer>.")
SUMMARY = ("Messages to summarize:\n{messages}\n\nYour context is full and will be cleared. Write a short summary "
           "for yourself: the entities you have found so far and the next search to make. Do not call tools.")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def main() -> int:
    env = os.environ
    deadline = float(env["MOSAIC_DEADLINE"])
    # tools_in_prompt false (a `mosaic serve` extension): SYSTEM documents the tools in the model's own
    # format, so the server does not append their JSON schemas; it still parses the replies' tool calls
    llm = ChatOpenAI(model=env["MOSAIC_MODEL"], base_url=env["MOSAIC_BASE_URL"], api_key="local", max_retries=0,
                     timeout=max(1.0, deadline - time.time()), extra_body={"tools_in_prompt": False})

    @tool
    def search(query: str) -> str:
        """The best-matching encyclopedia passages for a query."""
        r = httpx.post(env["MOSAIC_TOOLS_URL"], json={"name": "search", "arguments": {"query": query}}, timeout=60)
        body = r.json()
        return body["content"] if r.status_code == 200 else f"Error: {body['error']['message']}"

    middleware = [SummarizationMiddleware(model=llm, backend=StateBackend(), summary_prompt=SUMMARY,
                                          trigger=("tokens", int(env.get("DA_TRIGGER", "700"))), keep=("messages", 2))]
    tools, docs, subagents = [search], SEARCH_DOC, env.get("DA_SUBAGENTS", "delegate")
    if subagents == "task":  # deepagents' own sub-agents: its `task` tool
        helper = {"name": "helper", "description": "answers a sub-question", "system_prompt": HELPER, "model": llm,
                  "tools": [search]}
        middleware.insert(0, SubAgentMiddleware(backend=StateBackend(), subagents=[helper],
                                                task_description="A helper answers a sub-question."))
        docs += "\n" + TASK_DOC
    elif subagents == "delegate":  # the helper tool the embedded model knows; a sub-agent with a fresh context
        sub = create_agent(llm, tools=[search], system_prompt=HELPER)

        @tool
        def delegate(question: str) -> str:
            """A helper answers a sub-question with its own searches."""
            out = sub.invoke({"messages": [{"role": "user", "content": question}]}, config={"recursion_limit": 16})
            m = ANSWER.search(str(out["messages"][-1].content))
            return m.group(1).strip() if m else "no answer"

        tools.append(delegate)
        docs += "\n" + DELEGATE_DOC
    elif subagents != "none":
        sys.exit(f"DA_SUBAGENTS must be delegate, task or none, not {subagents!r}")
    agent = create_agent(llm, tools=tools, system_prompt=SYSTEM.replace("{tools}", docs), middleware=middleware)
    out = agent.invoke({"messages": [{"role": "user", "content": env["MOSAIC_QUESTION"]}]},
                       config={"recursion_limit": int(env.get("DA_RECURSION_LIMIT", "40"))})
    text = out["messages"][-1].content
    m = ANSWER.search(text if isinstance(text, str) else json.dumps(text))
    print(m.group(1).strip() if m else "")  # the last stdout line is the answer the trainer scores
    return 0


if __name__ == "__main__":
    sys.exit(main())
