"""Capture sessions from any agent harness: a recording OpenAI-compatible proxy and session reconstruction.

- :mod:`mosaic.capture.proxy`: the proxy (``ProxyConfig``, ``create_proxy_app``, ``serve``);
- :mod:`mosaic.capture.records`: interface call records and their JSONL file (``read_records``);
- :mod:`mosaic.capture.drops`: what a reader of records dropped, and why (``RecordReport``);
- :mod:`mosaic.capture.reconstruct`: records → ``mosaic.trace.Trajectory`` session graphs;
- :mod:`mosaic.capture.sessions`: reconstruction settings (``ReconstructionRules``), drafts, rule 2;
- :mod:`mosaic.capture.linking`: reconstruction rules 3–6, one method per rule;
- :mod:`mosaic.capture.wire`: request checks, stream parsing and re-tokenization;
- ``mosaic proxy ...`` on the command line (:mod:`mosaic.capture.cli`).

Importing this package stays light (no web framework); the proxy imports FastAPI when used.
"""

from mosaic.capture.reconstruct import ReconstructionRules, reconstruct, reconstruct_rollout
from mosaic.capture.drops import RecordReport
from mosaic.capture.records import (
    CallRecord, RecordError, RecordWriter, RewardRecord, iter_records, load_records, read_records,
)

__all__ = [
    "CallRecord", "RecordError", "RecordReport", "RecordWriter", "RewardRecord", "ReconstructionRules",
    "iter_records", "load_records", "read_records", "reconstruct", "reconstruct_rollout",
]
