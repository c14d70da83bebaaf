"""Hand-made multi-session trajectories for the scorer tests and the benchmark."""

from __future__ import annotations

import random

from mosaic.trace.graph import Session, StateRef, Trajectory, validate


def _turns(rng: random.Random, n_turns: int, sampled: int, inserted: int, vocab: int, last_inserted: bool = True):
    ids, mask = [], []
    for t in range(n_turns):
        a = rng.randint(max(1, sampled // 2), sampled)
        ids += [rng.randrange(3, vocab) for _ in range(a)]
        mask += [True] * a
        if last_inserted or t < n_turns - 1:
            b = rng.randint(max(1, inserted // 2), inserted)
            ids += [rng.randrange(3, vocab) for _ in range(b)]
            mask += [False] * b
    return ids, mask


def _session(sid, kind, prompt, ids, mask, **kw) -> Session:
    lp = [-1.0 if m else 0.0 for m in mask]
    return Session(id=sid, kind=kind, prompt_ids=prompt, completion_ids=ids, loss_mask=mask, logprobs=lp,
                   num_turns=sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])), **kw)


def compaction_chain(rng: random.Random, k: int, *, vocab: int = 400, prompt_len: int = 20, turns: int = 3,
                     sampled: int = 12, inserted: int = 20, tid: str = "t", answer: str = "Velmora Quint",
                     reward: float = 1.0) -> Trajectory:
    """main → (compaction → main) × k; the last main is final."""
    sys_task = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    sessions: list[Session] = []
    prompt = list(sys_task)
    for c in range(k + 1):
        mid = len(sessions)
        final = c == k
        ids, mask = _turns(rng, turns, sampled, inserted, vocab, last_inserted=not final)
        s = _session(mid, "main", prompt, ids, mask, parent=None if mid == 0 else mid - 1,
                     edge=None if mid == 0 else "continues", is_final=final,
                     state_before=StateRef(session=mid, upto=len(prompt)), state_after=StateRef(session=mid))
        sessions.append(s)
        if final:
            break
        instr = [rng.randrange(3, vocab) for _ in range(6)]
        summ, smask = _turns(rng, 1, 2 * sampled, 0, vocab, last_inserted=False)
        cid = mid + 1
        prompt_next = sys_task + summ
        sessions.append(_session(cid, "compaction", s.tokens() + instr, summ, smask, parent=mid, edge="continues",
                                 state_before=StateRef(session=mid), state_after=StateRef(session=cid + 1,
                                                                                            upto=len(prompt_next))))
        prompt = prompt_next
    t = Trajectory(id=tid, task_id="task", group_id="g", sessions=sessions, reward=reward, success=reward >= 1,
                   answer=answer, ground_truth=answer)
    return validate(t)


def fork(rng: random.Random, *, vocab: int = 400, mode: str = "merge", tid: str = "f",
         answer: str = "Brandor Lusk") -> Trajectory:
    """A final main session that delegates once after its second turn (subagent merged as a tool response)."""
    prompt = [rng.randrange(3, vocab) for _ in range(16)]
    a_ids, a_mask = _turns(rng, 2, 10, 15, vocab)  # two turns, the last one's call is the delegate call
    before = len(prompt) + len(a_ids)
    call = [rng.randrange(3, vocab) for _ in range(7)]
    result = [rng.randrange(3, vocab) for _ in range(9)]
    b_ids, b_mask = _turns(rng, 2, 10, 15, vocab, last_inserted=False)
    ids = a_ids + call + result + b_ids
    mask = a_mask + [True] * len(call) + [False] * len(result) + b_mask
    after = len(prompt) + len(a_ids) + len(call) + len(result)
    main = _session(0, "main", prompt, ids, mask, is_final=True,
                    state_before=StateRef(session=0, upto=len(prompt)), state_after=StateRef(session=0))
    sub_prompt = [rng.randrange(3, vocab) for _ in range(12)]
    s_ids, s_mask = _turns(rng, 2, 10, 12, vocab, last_inserted=False)
    states: list[list[int]] = []
    if mode == "merge":
        sb, sa = StateRef(session=0, upto=before), StateRef(session=0, upto=after)
    else:  # "own": explicit states (exercise the Trajectory.states path)
        sub_tokens = sub_prompt + s_ids
        states = [sub_prompt, sub_tokens]
        sb, sa = StateRef(state=0), StateRef(state=1)
    sub = _session(1, "subagent", sub_prompt, s_ids, s_mask, parent=0, edge="forks", state_before=sb, state_after=sa)
    t = Trajectory(id=tid, task_id="task2", group_id="g2", sessions=[main, sub], reward=0.0, answer=None,
                   ground_truth=answer, states=states)
    return validate(t)
