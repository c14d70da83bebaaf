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

Every reader reports what it left out the same way: :func:`read_records` returns a
:class:`~mosaic.capture.drops.RecordReport` naming each dropped rollout, its reason and where; the
export, offline replay and the trainer's live source add their own reasons to it. Text is made safe
where it enters: a lone surrogate (JSON's ``"\\udfff"``; no UTF-8 form) in any string of a record
becomes U+FFFD and is counted (``sanitized_text`` on the record when the proxy writes it, the
report's count when a reader meets one in an older file), as the harness does (issue 33).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from mosaic.agent.tools import safe_json
from mosaic.capture.drops import RecordReport
from mosaic.trace.fields import (
    TraceError, check_ids, check_logprobs, as_dict, as_float_list, as_int, as_int_list, as_list, as_number, as_str,
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
        as_str(d[name], name)
    as_int(d["seq"], "seq")
    for name in ("prompt_ids", "completion_ids"):
        if name in d:
            check_ids(as_int_list(d[name], name), name)
    if "logprobs" in d:
        check_logprobs(as_float_list(d["logprobs"], "logprobs"), "logprobs")
    for name in ("model", "text"):
        if name in d:
            as_str(d[name], name)
    for name in ("prompt", "finish_reason", "error"):
        if name in d:
            as_str(d[name], name, optional=True)
    for name in ("messages", "tools", "tool_calls"):
        if name in d:
            as_list(d[name], name)
    for name in ("request_params", "headers"):
        if name in d:
            as_dict(d[name], name)
    # times order the calls (reconstruct sorts by t_start) and go into the trajectory's meta
    for name in ("t_start", "t_first", "t_end", "upstream_s"):
        if name in d and not (name == "t_first" and d[name] is None) and not math.isfinite(as_number(d[name], name)):
            raise TraceError(f"field {name!r}: must be a finite number, got {d[name]!r}")
    for name in ("status", "sanitized_text"):
        if name in d:
            as_int(d[name], name)
    if d.get("policy_version") is not None:
        as_int(d["policy_version"], "policy_version")
    for name in ("retokenized", "stream", "context_overflow"):
        if name in d and not isinstance(d[name], bool):
            raise TraceError(f"field {name!r}: must be true or false, got {d[name]!r}")


NO_ROLLOUT_ID = "no-rollout-id"
"""The rollout id the proxy records a call under when the call names none (no ``/rollouts/{id}``
base URL, no ``X-Mosaic-Rollout`` header): such calls are kept, in one bucket that says so."""


@dataclass
class CallRecord:
    """One model call seen by the proxy.

    Attributes:
        call_id: unique id (the proxy's, ``<proxy start>-<seq>``).
        rollout_id: the rollout (``/rollouts/{id}/v1/...`` or ``X-Mosaic-Rollout``); a call that
            names none is recorded under :data:`NO_ROLLOUT_ID` (older records: "").
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
        sanitized_text: texts of the request or response in which the proxy replaced lone surrogates.
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
    sanitized_text: int = 0

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
        sanitized_text: texts of the POST in which the proxy replaced lone surrogates.
    """

    rollout_id: str
    reward: float
    ground_truth: str | None = None
    answer: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    t: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    sanitized_text: int = 0

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
            as_str(d["rollout_id"], "rollout_id")
            r = as_number(d["reward"], "reward")
            if not 0.0 <= r <= 1.0:  # (NaN too)
                raise TraceError(f"field 'reward': {r} is not a number in [0, 1]")
            for name in ("ground_truth", "answer", "task_id", "group_id"):
                as_str(d.get(name), name, optional=True)
            if not math.isfinite(as_number(d.get("t", 0.0), "t")):
                raise TraceError("field 't': must be finite")
            as_dict(d.get("meta"), "meta")
            as_int(d.get("sanitized_text", 0), "sanitized_text")
        except TraceError as exc:
            raise RecordError(f"reward record {exc}") from None
        return RewardRecord(**{k: v for k, v in d.items() if k in names})


def make_record_safe(rec: CallRecord | RewardRecord) -> int:
    """Replace every lone surrogate in the record's texts (messages, tools, text, answer, ...) by U+FFFD,
    in place; add the number of texts changed to ``rec.sanitized_text`` and return it."""
    n = 0
    for f in fields(rec):
        v = getattr(rec, f.name)
        if isinstance(v, (str, list, dict)):
            v2, k = safe_json(v)
            if k:
                setattr(rec, f.name, v2)
                n += k
    rec.sanitized_text += n
    return n


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
            try:
                yield parse_record(obj, where)
            except RecordError as exc:
                if on_bad is None or obj.get("type") not in ("call", "reward"):
                    raise
                on_bad(exc, obj)


def parse_record(obj: Any, where: str) -> CallRecord | RewardRecord:
    """One record line's object as a record, its fields checked; :class:`RecordError` naming ``where``."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    try:
        if kind == "call":
            return CallRecord.from_dict(obj)
        if kind == "reward":
            return RewardRecord.from_dict(obj)
        raise RecordError(f"unknown record type {kind!r}")
    except (RecordError, TypeError) as exc:
        raise RecordError(f"{where}: {exc}") from None


def read_records(path: str | os.PathLike) -> tuple[list[CallRecord], dict[str, RewardRecord], RecordReport]:
    """All good call records (in file order), the last reward posted per rollout, and the report of what
    was left out: a call or reward record with a bad field drops its whole rollout (named with
    ``file:line`` and the field; a rollout missing a call or its reward would be rebuilt wrong). Texts
    with lone surrogates (an older file) are made safe and counted. A bad record whose rollout cannot
    be told, a broken line or a foreign file raises :class:`RecordError`."""
    report = RecordReport(str(path))

    def skip(exc: RecordError, obj: dict) -> None:
        rid = obj.get("rollout_id")
        if not isinstance(rid, str):
            raise exc
        report.bad_record(rid, str(exc))

    calls: list[CallRecord] = []
    rewards: dict[str, RewardRecord] = {}
    for rec in iter_records(path, on_bad=skip):
        make_record_safe(rec)  # (an older file's texts; the proxy made its own safe on arrival)
        report.sanitized_text += rec.sanitized_text  # made safe by the proxy or just now
        if isinstance(rec, CallRecord):
            calls.append(rec)
        else:
            rewards[rec.rollout_id] = rec
    if report.dropped:
        calls = [c for c in calls if c.rollout_id not in report.dropped]
        rewards = {k: v for k, v in rewards.items() if k not in report.dropped}
    return calls, rewards, report


def load_records(path: str | os.PathLike, *, lenient: bool = False) -> tuple[list[CallRecord], dict[str, RewardRecord]]:
    """All call records (in file order) and the last reward posted per rollout.

    ``lenient``: :func:`read_records`, with a :class:`BadRecordWarning` per bad record naming
    ``file:line`` and the field, and one with the report's summary; otherwise a bad record raises
    :class:`RecordError`.
    """
    if not lenient:
        calls: list[CallRecord] = []
        rewards: dict[str, RewardRecord] = {}
        for rec in iter_records(path):
            make_record_safe(rec)
            if isinstance(rec, CallRecord):
                calls.append(rec)
            else:
                rewards[rec.rollout_id] = rec
        return calls, rewards
    calls, rewards, report = read_records(path)
    for rid, msg in report.bad_records:
        warnings.warn(f"{msg} (skipped with rollout {rid!r})", BadRecordWarning, stacklevel=2)
    if report.dropped:
        warnings.warn(f"{path}: dropped {report.summary()}", BadRecordWarning, stacklevel=2)
    return calls, rewards
