"""Scripted external harnesses for tests/train/test_external.py (loaded by ``module:function``)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx


def _chat(task, messages, max_tokens=6):
    # a temperature of its own, which the trainer's proxy replaces with the trainer's
    r = httpx.post(task.base_url + "/chat/completions", timeout=max(1.0, task.deadline - time.time()),
                   json={"model": task.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.25})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"] or ""


def scripted(task):
    """main → sub-agent → main → compaction → main; answers 'right' on even samples."""
    h = task.harness
    head = [{"role": "system", "content": h.system_text(0)}, {"role": "user", "content": task.question}]
    msgs = list(head)
    call = {"id": "call-1", "type": "function",
            "function": {"name": "delegate", "arguments": json.dumps({"question": "Who founded it?"})}}
    msgs.append({"role": "assistant", "content": _chat(task, msgs), "tool_calls": [call]})
    sub = [{"role": "system", "content": h.system_text(1)}, {"role": "user", "content": "Who founded it?"}]
    sub_answer = _chat(task, sub)
    msgs.append({"role": "tool", "tool_call_id": "call-1", "content": sub_answer or "no answer"})
    msgs.append({"role": "assistant", "content": _chat(task, msgs)})
    msgs.append({"role": "tool", "content": task.search(task.question[:40])})
    summary = _chat(task, msgs + [{"role": "user", "content": h.compaction_prompt}], max_tokens=12)
    # the summary as a message of its own: linked by equality however short (the random test model's is)
    msgs = head + [{"role": "user", "content": summary}]
    _chat(task, msgs)
    return "right" if task.sample % 2 == 0 else "wrong"


def right_is_one(task, answer):
    return 1.0 if answer == "right" else 0.0


def faulty(task):
    """Sample k: 0 ok, 1 crashes, 2 hangs past the deadline, 3 posts twice, 4 posts none, 5 uses another id."""
    k = task.sample
    msgs = [{"role": "system", "content": task.harness.system_text(0)}, {"role": "user", "content": task.question}]
    if k == 5:
        r = httpx.post(task.base_url.replace(task.rollout_id, "not-mine") + "/chat/completions", timeout=30,
                       json={"model": task.model, "messages": msgs, "max_tokens": 4})
        return {"answer": "x"} if r.status_code == 200 else None
    _chat(task, msgs)
    if k == 1:
        raise RuntimeError("harness bug")
    if k == 2:
        time.sleep(task.deadline - time.time() + 2)
        return None
    if k == 4:
        return "x"
    for _ in range(2 if k == 3 else 1):
        httpx.post(task.reward_url, json={"reward": 1.0 if k == 0 else 0.0, "answer": "x"}, timeout=30).raise_for_status()
    return "x"


async def async_ok(task):
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(task.base_url + "/chat/completions",
                         json={"model": task.model, "max_tokens": 4,
                               "messages": [{"role": "user", "content": task.question}]})
        r.raise_for_status()
    await asyncio.sleep(0)
    return "right" if task.sample == 0 else "wrong"


EPISODES: dict = {}
"""Service episodes by id, for :func:`service_expert` (the test fills it from the training split)."""


def service_expert(task):
    """The revalidating service expert played through the trainer's tool endpoint (the account tools of this
    rollout's backend), after one model call; returns its answer. Sample 1 also makes a bad tool call first."""
    from mosaic.envs.service import ServiceExpert, parse_call
    from mosaic.envs.rewards import extract_answer

    episode = EPISODES[task.task_id]
    _chat(task, [{"role": "user", "content": task.question}])
    if task.sample == 1:
        try:
            task.call_tool("cancel_order", {"order_id": "not an id"})
        except ValueError:
            pass
    expert, transcript = ServiceExpert(True), [("user", task.question)]
    for _ in range(60):
        text = expert.act(episode, transcript)
        transcript.append(("assistant", text))
        answer, status = extract_answer(text)
        if status == "ok":
            return answer
        transcript.append(("tool", task.call_tool(*parse_call(text))))
    return None
