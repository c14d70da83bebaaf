"""Storage for trajectories: append-only JSONL while rolling out, Parquet for datasets.

JSONL: one trajectory per line, each line self-describing
(``{"schema": "mosaic.trajectory", "schema_version": 1, "trajectory": {...}}``),
appended and flushed as each trajectory finishes so a crash loses at most the
in-flight ones. A torn last line (a crash mid-write) is skipped with a warning;
a broken line anywhere else, a foreign schema or a newer version is an error
that names the file and line.

Parquet: one row per trajectory, sessions as a nested list column; the schema
version is stored in the file's key-value metadata and checked on load.

Both readers decode strictly (types are checked, never coerced: ``"false"`` is
not a mask value, ``1.9`` not a token id) and validate ranges (ids in
``[0, 2**31)``, finite log-probs ``<= 0``) and unique trajectory ids; the first
bad record fails with :class:`StorageError` naming ``file:line`` (JSONL) or
``file: row`` (Parquet) and the field. ``lenient=True`` skips each bad record
instead, with a :class:`BadRecordWarning` per record and one summary warning
that counts them.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

from mosaic.trace.graph import StateRef, TraceError, Trajectory, validate
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = "mosaic.trajectory"
SCHEMA_VERSION = 1
_PARQUET_META_KEY = b"mosaic.schema"


class StorageError(TraceError):
    """A file that cannot be read as Mosaic trajectories (corrupt, foreign or incompatible)."""


class TornLineWarning(UserWarning):
    """The last line of a JSONL file was incomplete (a crash mid-write) and was skipped."""


class BadRecordWarning(UserWarning):
    """``lenient=True``: a record that does not decode or validate was skipped (the message says why)."""


class _Skipper:
    """Strict: raise the error. Lenient: warn per skipped record and count them."""

    def __init__(self, path, lenient: bool):
        self.path, self.lenient, self.skipped = path, lenient, 0

    def bad(self, exc: StorageError) -> None:
        if not self.lenient:
            raise exc
        self.skipped += 1
        warnings.warn(f"{exc} (skipped: lenient)", BadRecordWarning, stacklevel=4)

    def summary(self, total: int) -> None:
        if self.skipped:
            warnings.warn(f"{self.path}: skipped {self.skipped} bad record(s) of {total} (lenient)",
                          BadRecordWarning, stacklevel=4)


def _check_unique(traj: Trajectory, where: str, seen: dict[str, str]) -> None:
    first = seen.get(traj.id)
    if first is not None:
        raise StorageError(f"{where}: trajectory field 'id': duplicate id {traj.id!r} (first at {first})")
    seen[traj.id] = where


# --------------------------------------------------------------------------- JSONL


def cut_torn_tail(path: str | os.PathLike) -> int:
    """Before appending to a JSONL file: cut off a torn last line (a crash mid-write).

    Appending after a torn line would glue a good record onto garbage. The torn
    bytes are kept in ``<file>.torn`` for inspection and a warning is issued.
    Returns the number of bytes cut (0 when the file ends cleanly or is absent).
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return 0
        cut = data.rfind(b"\n") + 1  # 0 when the whole file is one torn line
        with open(path.with_name(path.name + ".torn"), "ab") as torn:
            torn.write(data[cut:] + b"\n")
        fh.truncate(cut)
    warnings.warn(f"{path}: cut a torn last line ({len(data) - cut} bytes, saved to .torn) before appending",
                  TornLineWarning, stacklevel=3)
    return len(data) - cut


class LineAppender:
    """Append lines to a file, one flushed write each (thread-safe): the mechanics every
    append-only JSONL writer here shares (trajectories, proxy call records).

    Opening cuts a torn tail first (:func:`cut_torn_tail`). ``fsync=True`` forces each
    line to disk (durable against power loss, slower); the default flush survives a
    process crash. ``fsync_on_close`` forces the file to disk when it is closed.
    """

    closed_error: type[Exception] = StorageError
    """Raised by :meth:`append` after :meth:`close`."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, fsync_on_close: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._fsync_on_close = fsync_on_close
        self._lock = threading.Lock()
        cut_torn_tail(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")
        self.count = 0

    def append(self, line: str) -> None:
        with self._lock:
            if self._fh.closed:
                raise self.closed_error(f"{self.path}: writer is closed")
            self._fh.write(line + "\n")
            self._fh.flush()
            if self._fsync:
                os.fsync(self._fh.fileno())
            self.count += 1

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
                if self._fsync_on_close:
                    os.fsync(self._fh.fileno())
                self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class JsonlWriter(LineAppender):
    """Append trajectories to a JSONL file, one validated, flushed line each (thread-safe)."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, validate_records: bool = True):
        super().__init__(path, fsync=fsync)
        self._validate = validate_records

    def write(self, traj: Trajectory) -> None:
        if self._validate:
            validate(traj)
        self.append(json.dumps(
            {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "trajectory": traj.to_dict()},
            separators=(",", ":"),
        ))


def _decode_record(obj: object, where: str) -> Trajectory:
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise StorageError(f"{where}: not a Mosaic trajectory record (schema {SCHEMA!r} expected)")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StorageError(
            f"{where}: schema_version {version!r} is not supported by this Mosaic "
            f"(reads version {SCHEMA_VERSION})"
        )
    try:
        return validate(Trajectory.from_dict(obj.get("trajectory")))
    except TraceError as exc:
        raise StorageError(f"{where}: {exc}") from None


def iter_json_lines(path: str | os.PathLike, *, error: type[Exception] | None = None,
                    on_error: Any = None) -> Iterator[tuple[str, Any]]:
    """``(where, object)`` for each JSON line of an append-only file (``where`` = ``file:line``).

    Only the very last line, not terminated by a newline, can be torn by a crash:
    it is skipped with a :class:`TornLineWarning`. A broken line anywhere else
    raises ``error`` (default :class:`StorageError`) naming file and line, or, when
    ``on_error`` is given, is passed to it (which may raise) and skipped.
    """
    error = error or StorageError
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    # A file written by an appending writer ends with "\n", so the last split piece is b"".
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    for i, raw in enumerate(lines[: last + 1]):
        if not raw.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if i == last and not data.rstrip(b" \t\r").endswith(b"\n"):
                warnings.warn(f"{where}: skipped a torn last line ({len(raw)} bytes)", TornLineWarning, stacklevel=3)
                return
            if on_error is None:
                raise error(f"{where}: corrupted line ({exc})") from None
            on_error(error(f"{where}: corrupted line ({exc})"))
            continue
        yield where, obj


def iter_jsonl(path: str | os.PathLike, *, lenient: bool = False) -> Iterator[Trajectory]:
    """Yield trajectories from a JSONL file, skipping (with a warning) a torn last line.

    A bad record (corrupt line, wrong type, out-of-range value, duplicate id) raises
    :class:`StorageError` naming ``file:line`` and the field; ``lenient=True`` skips it with a
    :class:`BadRecordWarning` and ends with a warning counting the skipped records."""
    path = Path(path)
    if not path.exists():
        raise StorageError(f"{path}: no such file")
    if path.is_dir():
        raise StorageError(f"{path}: is a directory, not a JSONL file")
    skip = _Skipper(path, lenient)
    seen: dict[str, str] = {}
    total = 0

    def corrupt(exc: StorageError) -> None:
        nonlocal total
        total += 1
        skip.bad(exc)

    for where, obj in iter_json_lines(path, on_error=corrupt):
        total += 1
        try:
            traj = _decode_record(obj, where)
            _check_unique(traj, where, seen)
        except StorageError as exc:
            skip.bad(exc)
            continue
        yield traj
    skip.summary(total)


def read_jsonl(path: str | os.PathLike, *, lenient: bool = False) -> list[Trajectory]:
    return list(iter_jsonl(path, lenient=lenient))


def write_jsonl(path: str | os.PathLike, trajs: Iterable[Trajectory]) -> int:
    with JsonlWriter(path) as w:
        for t in trajs:
            w.write(t)
        return w.count


# --------------------------------------------------------------------------- Parquet


def _arrow_schema():

    ref = pa.struct([("session", pa.int32()), ("upto", pa.int64()), ("state", pa.int32())])
    session = pa.struct(
        [
            ("id", pa.int32()),
            ("kind", pa.string()),
            ("parent", pa.int32()),
            ("edge", pa.string()),
            ("prompt_ids", pa.list_(pa.int32())),
            ("completion_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.bool_())),
            ("logprobs", pa.list_(pa.float32())),
            ("end_reason", pa.string()),
            ("is_final", pa.bool_()),
            ("state_before", ref),
            ("state_after", ref),
            ("num_turns", pa.int32()),
            ("meta", pa.string()),
            ("detached", pa.string()),  # JSON, like meta: rare, and absent from older files
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("reward", pa.float64()),
            ("success", pa.bool_()),
            ("answer", pa.string()),
            ("ground_truth", pa.string()),
            ("end_reason", pa.string()),
            ("sessions", pa.list_(session)),
            ("states", pa.list_(pa.list_(pa.int32()))),
            ("meta", pa.string()),
        ],
        metadata={_PARQUET_META_KEY: json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION}).encode()},
    )


def _ref_row(ref: StateRef | None):
    if ref is None:
        return None
    return {"session": ref.session, "upto": ref.upto, "state": ref.state}


def write_parquet(path: str | os.PathLike, trajs: Iterable[Trajectory]) -> int:
    """Write trajectories to a Parquet file (atomically: temp file, then rename)."""

    rows = []
    for t in trajs:
        validate(t)
        d = t.to_dict()
        for s_obj, s in zip(d["sessions"], t.sessions):
            s_obj["meta"] = json.dumps(s.meta)
            s_obj["detached"] = json.dumps(s_obj.get("detached", []))
            s_obj["state_before"] = _ref_row(s.state_before)
            s_obj["state_after"] = _ref_row(s.state_after)
        d["meta"] = json.dumps(t.meta)
        rows.append(d)
    table = pa.Table.from_pylist(rows, schema=_arrow_schema())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return len(rows)


_REQUIRED_COLUMNS = ("id", "task_id", "group_id", "sessions")


def _parquet_row(d: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row (nested Arrow structs) → the JSON record layout; TraceError names the field."""
    sessions = d.get("sessions")
    if isinstance(sessions, list):
        for k, s in enumerate(sessions):
            if not isinstance(s, dict):
                continue  # Session.from_dict names it
            try:
                s["meta"] = json.loads(s.get("meta") or "{}")
            except (TypeError, ValueError) as exc:
                raise TraceError(f"session {k} field 'meta': not a JSON object ({exc})") from None
            try:
                s["detached"] = json.loads(s.get("detached") or "[]")
            except (TypeError, ValueError) as exc:
                raise TraceError(f"session {k} field 'detached': not JSON ({exc})") from None
            for key in ("state_before", "state_after"):
                ref = s.get(key)
                if isinstance(ref, dict):
                    s[key] = {"state": ref.get("state")} if ref.get("state") is not None else {
                        "session": ref.get("session"), "upto": ref.get("upto")}
    try:
        d["meta"] = json.loads(d.get("meta") or "{}")
    except (TypeError, ValueError) as exc:
        raise TraceError(f"field 'meta': not a JSON object ({exc})") from None
    return d


def read_parquet(path: str | os.PathLike, *, lenient: bool = False) -> list[Trajectory]:
    """Trajectories from a Parquet file written by :func:`write_parquet`.

    Foreign or broken files (no or bad Mosaic metadata, a missing column) raise
    :class:`StorageError`; a bad row raises it naming ``file: row i`` and the field, or is skipped
    with a :class:`BadRecordWarning` when ``lenient=True``."""

    path = Path(path)
    if not path.exists():
        raise StorageError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise StorageError(f"{path}: not a readable Parquet file ({exc})") from None
    meta = (table.schema.metadata or {}).get(_PARQUET_META_KEY)
    if meta is None:
        raise StorageError(f"{path}: Parquet file carries no Mosaic schema metadata")
    try:
        info = json.loads(meta)
    except (UnicodeDecodeError, ValueError):
        info = None
    if not isinstance(info, dict):
        raise StorageError(f"{path}: Parquet metadata {_PARQUET_META_KEY.decode()!r} is not a JSON object "
                           f"({meta[:80]!r})")
    if info.get("schema") != SCHEMA or info.get("schema_version") != SCHEMA_VERSION:
        raise StorageError(
            f"{path}: schema {info.get('schema')!r} version {info.get('schema_version')!r} is not "
            f"supported (reads {SCHEMA!r} version {SCHEMA_VERSION})"
        )
    missing = [c for c in _REQUIRED_COLUMNS if c not in table.schema.names]
    if missing:
        raise StorageError(f"{path}: missing column(s) {', '.join(map(repr, missing))} "
                           f"(has {', '.join(table.schema.names)})")
    try:
        rows = table.to_pylist()
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise StorageError(f"{path}: cannot decode the rows ({exc})") from None
    skip = _Skipper(path, lenient)
    seen: dict[str, str] = {}
    out = []
    for i, d in enumerate(rows):
        where = f"{path}: row {i}"
        try:
            traj = validate(Trajectory.from_dict(_parquet_row(d)))
            _check_unique(traj, where, seen)
        except TraceError as exc:
            skip.bad(exc if isinstance(exc, StorageError) else StorageError(f"{where}: {exc}"))
            continue
        out.append(traj)
    skip.summary(len(rows))
    return out


def load_trajectories(path: str | os.PathLike, *, lenient: bool = False) -> list[Trajectory]:
    """Read a ``.jsonl`` or ``.parquet`` file of trajectories (by suffix); ``lenient``: see the readers."""
    p = Path(path)
    if p.suffix == ".parquet":
        return read_parquet(p, lenient=lenient)
    if p.suffix in (".jsonl", ".json"):
        return read_jsonl(p, lenient=lenient)
    raise StorageError(f"{p}: unknown trajectory file type {p.suffix!r} (use .jsonl or .parquet)")
