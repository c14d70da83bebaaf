"""Interface call records: what the recording proxy writes, one JSON line per event.

Two record types share one append-only JSONL file (``records.jsonl`` in the
proxy's output directory), each line self-describing:

- ``{"type": "call", ...}``: one model call that went through the proxy (a
  :class:`CallRecord`): the rollout it belongs to, the request messages and
  tools as the harness sent them, the exact prompt and completion token ids
  (from the upstream, or re-tokenised and marked ``retokenized``), sampling
  log-probs, finish reason, timings, and an ``error`` for calls that failed.
- ``{"type": "reward", ...}``: an outcome attached to a rollout by
  ``POST /rollouts/{id}/reward`` (a :class:`RewardRecord`).

Lines are flushed one by one as calls finish, so a killed proxy loses at most
the line being written; a torn last line is cut off (kept in ``.torn``) before
appending and skipped with a warning when reading, exactly as
``mosaic.trace.storage`` does for trajectories.

Reading checks each record's fields strictly (types never coerced: ``"abc"`` is
not a token id list, ``"1"`` not a reward; token ids in ``[0, 2**31)``, finite
log-probs ``<= 0``, a reward in ``[0, 1]``): the first bad one raises
:class:`RecordError` naming ``file:line`` and the field, or, with
``load_records(path, lenient=True)`` (what ``mosaic proxy export`` uses), is
skipped with a :class:`BadRecordWarning` naming them, together with every other
record of its rollout (a rollout missing a call or its reward would be rebuilt
wrong).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from mosaic.trace.graph import (
    TraceError, _check_ids, _check_logprobs, _dict, _float_list, _int, _int_list, _list, _number, _str,
)
from mosaic.trace.storage import LineAppender, iter_json_lines

RECORD_SCHEMA = "mosaic.capture"
RECORD_SCHEMA_VERSION = 1
RECORDS_FILE = "records.jsonl"


def content_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string, None, or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


class RecordError(ValueError):
    """A records file or line that cannot be read; the message names the file and line."""


class BadRecordWarning(UserWarning):
    """``lenient=True``: a record with a bad field was skipped with its rollout (the message says where)."""


def _check_call(d: dict[str, Any]) -> None:
    """Strict types and ranges of a call record's fields (:class:`TraceError` naming the field)."""
    for name in ("call_id", "rollout_id", "endpoint"):
        _str(d[name], name)
    _int(d["seq"], "seq")
    for name in ("prompt_ids", "completion_ids"):
        if name in d:
            _check_ids(_int_list(d[name], name), name)
    if "logprobs" in d:
        _check_logprobs(_float_list(d["logprobs"], "logprobs"), "logprobs")
    for name in ("model", "text"):
        if name in d:
            _str(d[name], name)
    for name in ("prompt", "finish_reason", "error"):
        if name in d:
            _str(d[name], name, optional=True)
    for name in ("messages", "tools", "tool_calls"):
        if name in d:
            _list(d[name], name)
    for name in ("request_params", "headers"):
        if name in d:
            _dict(d[name], name)
    # times order the calls (reconstruct sorts by t_start) and go into the trajectory's meta
    for name in ("t_start", "t_first", "t_end", "upstream_s"):
        if name in d and not (name == "t_first" and d[name] is None) and not math.isfinite(_number(d[name], name)):
            raise TraceError(f"field {name!r}: must be a finite number, got {d[name]!r}")
    if "status" in d:
        _int(d["status"], "status")
    if d.get("policy_version") is not None:
        _int(d["policy_version"], "policy_version")
    for name in ("retokenized", "stream", "context_overflow"):
        if name in d and not isinstance(d[name], bool):
            raise TraceError(f"field {name!r}: must be true or false, got {d[name]!r}")


@dataclass
class CallRecord:
    """One model call seen by the proxy.

    Attributes:
        call_id: unique id (the proxy's, ``<proxy start>-<seq>``).
        rollout_id: the rollout (``/rollouts/{id}/v1/...`` or ``X-Mosaic-Rollout``); "" when none.
        seq: arrival order within one proxy process; ``t_start`` orders across restarts.
        endpoint: ``chat`` (``/v1/chat/completions``) or ``completions`` (``/v1/completions``).
        model: the requested model name.
        messages / tools: the request's chat messages and tool schemas, as sent (chat only).
        prompt: the request's prompt string (completions only).
        request_params: the other sampling parameters as forwarded (the client's, with the proxy's
            ``force_params`` applied: what the upstream sampled with).
        prompt_ids: exact token ids of the prompt the upstream fed the model.
        completion_ids: sampled token ids of the first choice.
        logprobs: (len(completion_ids),) sampling log-probs; empty when the upstream gave none.
        text: the first choice's text content; tool_calls: its tool calls (OpenAI format).
        finish_reason: ``stop``, ``length``, ``tool_calls``, ... as the upstream reported.
        retokenized: True when the ids came from the proxy's tokenizer, not the upstream.
        context_overflow: the upstream refused the prompt as longer than the model's context; the
            record keeps the prompt's ids (asked of the upstream's ``/tokenize``, else the proxy's
            tokenizer, then ``retokenized``) so reconstruction can put that prompt in its session.
        stream: whether the client asked for a streamed response.
        status: HTTP status returned to the client; error: why the call failed (None if it did not).
        t_start / t_first / t_end: wall-clock times (s since epoch) of arrival, first upstream
            byte, and completion; upstream_s: time spent waiting on the upstream.
        headers: the ``X-Mosaic-*`` headers of the request (task / group ids, ...).
        policy_version: the version of the weights that answered, when the upstream says
            (``mosaic serve`` stamps ``policy_version`` on each response; a trainer bumps it at each
            update); None otherwise.
    """

    call_id: str
    rollout_id: str
    seq: int
    endpoint: str
    model: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | None = None
    request_params: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    retokenized: bool = False
    context_overflow: bool = False
    stream: bool = False
    status: int = 200
    error: str | None = None
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    upstream_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    policy_version: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status < 400 and bool(self.prompt_ids)

    def tip(self) -> list[int]:
        """The context after this call: prompt + completion ids."""
        return list(self.prompt_ids) + list(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        # Shallow: json.dumps walks the lists itself (dataclasses.asdict deep-copies every token id).
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["type"] = "call"
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "CallRecord":
        names = {f.name for f in fields(CallRecord)}
        missing = [k for k in ("call_id", "rollout_id", "seq", "endpoint") if k not in d]
        if missing:
            raise RecordError(f"call record is missing field(s) {missing}")
        try:
            _check_call(d)
        except TraceError as exc:
            raise RecordError(f"call record {exc}") from None
        return CallRecord(**{k: v for k, v in d.items() if k in names})


@dataclass
class RewardRecord:
    """An outcome attached to a rollout (the last one posted for a rollout wins).

    Attributes:
        rollout_id: the rollout; reward: outcome in [0, 1].
        ground_truth: the gold answer (the information-gain scorer needs it).
        answer: the extracted final answer, if the caller has one.
        task_id / group_id: the task and GRPO group; default to the rollout id / task id.
        t: wall-clock time the reward arrived; meta: free-form extras.
    """

    rollout_id: str
    reward: float
    ground_truth: str | None = None
    answer: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    t: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = "reward"
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RewardRecord":
        names = {f.name for f in fields(RewardRecord)}
        if "rollout_id" not in d or "reward" not in d:
            raise RecordError("reward record needs 'rollout_id' and 'reward'")
        try:
            _str(d["rollout_id"], "rollout_id")
            r = _number(d["reward"], "reward")
            if not 0.0 <= r <= 1.0:  # (NaN too)
                raise TraceError(f"field 'reward': {r} is not a number in [0, 1]")
            for name in ("ground_truth", "answer", "task_id", "group_id"):
                _str(d.get(name), name, optional=True)
            if not math.isfinite(_number(d.get("t", 0.0), "t")):
                raise TraceError("field 't': must be finite")
            _dict(d.get("meta"), "meta")
        except TraceError as exc:
            raise RecordError(f"reward record {exc}") from None
        return RewardRecord(**{k: v for k, v in d.items() if k in names})


class RecordWriter(LineAppender):
    """Append records to a JSONL file, one flushed line each (thread-safe).

    Opening a file whose last line is torn (a crash mid-write) cuts that line
    off first, saving its bytes in ``<file>.torn``, so new records never glue
    onto garbage. ``fsync=True`` also forces each line to disk; closing always does.
    """

    closed_error = RecordError

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False):
        super().__init__(path, fsync=fsync, fsync_on_close=True)

    def write(self, record: CallRecord | RewardRecord) -> None:
        obj = record.to_dict()
        obj["schema"] = RECORD_SCHEMA
        obj["schema_version"] = RECORD_SCHEMA_VERSION
        line = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (JSON's "\udfff" decodes to one) has no UTF-8 form: escape every
            # non-ASCII character instead, which reads back to the same strings.
            line = json.dumps(obj, separators=(",", ":"), ensure_ascii=True)
        self.append(line)


def _is_records_file(file: Path) -> bool:
    """Whether a file's first line is a capture record (an empty file counts: a proxy that recorded
    nothing yet); other JSONL files in a records directory (an export written there) are not."""
    with open(file, "rb") as fh:
        first = fh.readline(1 << 20)
    if not first.strip():
        return True
    try:
        obj = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return True  # let the reader name the broken line
    return not (isinstance(obj, dict) and isinstance(obj.get("schema"), str) and obj["schema"] != RECORD_SCHEMA)


def _record_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl"))
        if not files:
            raise RecordError(f"{path}: no *.jsonl record files in this directory")
        kept = [f for f in files if _is_records_file(f)]
        for f in files:
            if f not in kept:
                warnings.warn(f"{f}: not a capture records file (skipped)", BadRecordWarning, stacklevel=3)
        if not kept:
            raise RecordError(f"{path}: none of its *.jsonl files holds capture records")
        return kept
    if not path.exists():
        raise RecordError(f"{path}: no such file or directory")
    return [path]


def iter_records(path: str | os.PathLike, *, on_bad=None) -> Iterator[CallRecord | RewardRecord]:
    """Yield the records of a file, or of every ``*.jsonl`` file in a directory.

    A torn last line is skipped with a :class:`TornLineWarning`; a broken line
    anywhere else, a foreign schema or a newer version raises :class:`RecordError`.
    A record whose fields are missing or bad raises :class:`RecordError` naming
    ``file:line`` and the field, or, when ``on_bad`` is given, is passed to
    ``on_bad(error, raw_object)`` (which may raise) and skipped.
    """
    for file in _record_files(Path(path)):
        for where, obj in iter_json_lines(file, error=RecordError):
            if not isinstance(obj, dict) or obj.get("schema") != RECORD_SCHEMA:
                raise RecordError(f"{where}: not a Mosaic capture record (schema {RECORD_SCHEMA!r} expected)")
            if obj.get("schema_version") != RECORD_SCHEMA_VERSION:
                raise RecordError(f"{where}: schema_version {obj.get('schema_version')!r} is not supported "
                                  f"(reads version {RECORD_SCHEMA_VERSION})")
            kind = obj.get("type")
            try:
                if kind == "call":
                    yield CallRecord.from_dict(obj)
                elif kind == "reward":
                    yield RewardRecord.from_dict(obj)
                else:
                    raise RecordError(f"unknown record type {kind!r}")
            except (RecordError, TypeError) as exc:
                if on_bad is None or kind not in ("call", "reward"):
                    raise RecordError(f"{where}: {exc}") from None
                on_bad(RecordError(f"{where}: {exc}"), obj)


def load_records(path: str | os.PathLike, *, lenient: bool = False) -> tuple[list[CallRecord], dict[str, RewardRecord]]:
    """All call records (in file order) and the last reward posted per rollout.

    ``lenient``: a call or reward record with a bad field is skipped with a :class:`BadRecordWarning`
    naming ``file:line`` and the field, and so is every record of its rollout (one summary warning
    counts them); a bad record whose rollout cannot be told still raises :class:`RecordError`.
    """
    bad: dict[str, str] = {}  # rollout id -> where its first bad record is

    def skip(exc: RecordError, obj: dict) -> None:
        rid = obj.get("rollout_id")
        if not lenient or not isinstance(rid, str):
            raise exc
        bad.setdefault(rid, str(exc).split(": ", 1)[0])
        warnings.warn(f"{exc} (skipped with rollout {rid!r})", BadRecordWarning, stacklevel=3)

    calls: list[CallRecord] = []
    rewards: dict[str, RewardRecord] = {}
    for rec in iter_records(path, on_bad=skip):
        if isinstance(rec, CallRecord):
            calls.append(rec)
        else:
            rewards[rec.rollout_id] = rec
    if bad:
        calls = [c for c in calls if c.rollout_id not in bad]
        rewards = {k: v for k, v in rewards.items() if k not in bad}
        warnings.warn(f"{path}: skipped {len(bad)} rollout(s) with a bad record: "
                      + ", ".join(f"{rid!r} ({where})" for rid, where in list(bad.items())[:5]),
                      BadRecordWarning, stacklevel=2)
    return calls, rewards
