"""A plain-Python agent harness on the `openai` client, with compaction and a sub-agent.

Train it:  mosaic train rollout.source=harness rollout.harness=examples/harness/plain.py:run
It knows nothing of Mosaic's trainer: it gets a base URL, a question, a search tool and a deadline,
and returns its answer. Its prompts mirror the built-in harness's (task.harness) so the embedded
model, trained on those, is in its own format; a harness of your own uses its own.
"""

import json
import re
import time

from openai import DefaultHttpxClient, OpenAI

CALL, ANSWER = re.compile(r"<tool_call>(.*?)</tool_call>", re.S), re.compile(r"<answer>(.*?)</answer>", re.S)


def agent(llm, task, system, question, depth=0):
    h = task.harness
    head = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    msgs, used = list(head), 0
    for _ in range(h.max_turns if depth == 0 else h.subagent_max_turns):
        if used + h.max_new_tokens > h.context_budget:  # compaction: summarise, start a fresh context
            if depth > 0 or not h.compacts:
                return None
            summary = llm(msgs + [{"role": "user", "content": h.compaction_prompt}], h.summary_max_new_tokens)[0]
            msgs = head[:1] + [{"role": "user", "content": h.resume_text(question, summary)}]
        text, used, per_char = llm(msgs, h.max_new_tokens)
        msgs.append({"role": "assistant", "content": text})
        if m := ANSWER.search(text):
            return m.group(1).strip()
        try:
            call = json.loads(CALL.search(text).group(1))
            name, arg = call["name"], next(iter(call["arguments"].values()))
            if name == "delegate" and depth < h.max_depth:  # a sub-agent with a context of its own
                result = agent(llm, task, h.system_text(depth + 1), arg, depth + 1) or "no answer"
            else:
                result = task.search(arg)
        except (AttributeError, ValueError, KeyError, TypeError, StopIteration):
            result = 'Error: call a tool (<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>) or answer (<answer>NAME</answer>).'
        msgs.append({"role": "tool", "content": result})
        used += round(len(result) * per_char)  # its tokens, estimated (the next reply's usage says exactly)
    return None


HTTP = DefaultHttpxClient()  # one HTTP client for every rollout: its connection pool and TLS set-up are shared


def run(task):
    client = OpenAI(base_url=task.base_url, api_key="local", max_retries=0, http_client=HTTP,
                    timeout=max(1.0, task.deadline - time.time()))

    def llm(messages, max_tokens):
        r = client.chat.completions.create(model=task.model, messages=messages, max_tokens=max_tokens)
        u = r.usage  # exact context so far, and this conversation's tokens per character of text
        per_char = u.prompt_tokens / max(1, sum(len(m["content"] or "") for m in messages))
        return r.choices[0].message.content or "", u.prompt_tokens + u.completion_tokens, per_char

    return agent(llm, task, task.harness.system_text(0), task.question)
