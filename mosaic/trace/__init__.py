"""The session-graph data model (docs/algorithm.md §1) and its storage."""

from mosaic.trace.graph import (
    KIND_CODES,
    Session,
    StateRef,
    Stretch,
    TraceError,
    Trajectory,
    kind_names,
    register_kind,
    validate,
    validate_all,
)
from mosaic.trace.stretch import ids_outside
from mosaic.trace.rows import FlatBatch, TrainingRow, TurnLayout, flatten, to_rows, turn_boundaries, turn_layout, turn_spans
from mosaic.trace.storage import (
    SCHEMA_VERSION,
    BadRecordWarning,
    JsonlWriter,
    StorageError,
    TornLineWarning,
    iter_jsonl,
    load_trajectories,
    read_jsonl,
    read_parquet,
    write_jsonl,
    write_parquet,
)

__all__ = [
    "KIND_CODES", "Session", "StateRef", "Stretch", "TraceError", "Trajectory", "kind_names", "register_kind",
    "validate", "validate_all", "ids_outside", "FlatBatch", "TrainingRow", "TurnLayout", "flatten", "to_rows", "turn_layout",
    "turn_spans", "turn_boundaries", "SCHEMA_VERSION", "BadRecordWarning",
    "JsonlWriter", "StorageError", "TornLineWarning", "iter_jsonl", "load_trajectories", "read_jsonl",
    "read_parquet", "write_jsonl", "write_parquet",
]
