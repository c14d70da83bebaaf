#!/usr/bin/env bash
# The broadcast twin of run_mosaic_compaction.sh: the same harness, data, model and budget; every
# session of a trajectory gets its GRPO advantage (docs/algorithm.md §4.2), no session gains are scored.
# DEVICE=cpu runs it on CPU (tested); on GPUs not yet run (see run_mosaic_compaction.sh).
set -euo pipefail
ESTIMATOR=broadcast GAINS=false NAME=${NAME:-broadcast-compaction} \
    exec "$(dirname "$0")/run_mosaic_compaction.sh" "$@"
