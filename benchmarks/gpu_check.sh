#!/usr/bin/env bash
# One-shot GPU check of the LoRA kernels (under 5 minutes on one GPU):
#   1. lora_shrink / lora_expand (triton and torch backends) vs the fp32 reference,
#      fp16 / bf16 / fp32, tiny + SmolLM2 widths, ranks 1-64, 1-133 tokens;
#   2. timings at Llama-3-8B shapes: triton vs the torch path, achieved bandwidth as a
#      fraction of the device copy bandwidth measured in the same run.
# Run from anywhere on a fresh machine that has torch + triton (nothing is installed):
#   bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run   # CPU, triton interpreter, tiny shapes
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
LOG_DIR=${OUT:-/tmp}/gpu_check
mkdir -p "$LOG_DIR"
declare -A RESULT

step() {  # step NAME TIMEOUT_S CMD...: run, tee the log, remember pass/fail
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $* (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    RESULT[$name]="$([[ $rc == 0 ]] && echo PASS || echo "FAIL (rc=$rc)") in $((SECONDS - t0))s"
}

"$PY" - <<'EOF' || { echo "FAIL: torch/triton not importable with $PY"; exit 2; }
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda={torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}")
EOF

if [[ "${1:-}" == "--dry-run" ]]; then
    step dry_run 120 env TRITON_INTERPRET=1 "$PY" benchmarks/kernels.py --tiny --interpret
    STEPS=(dry_run)
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "FAIL: no CUDA device visible (use --dry-run on CPU)"; exit 2; }
    step correctness 150 "$PY" benchmarks/kernels.py --check
    step timings 150 "$PY" benchmarks/kernels.py --no-check --model llama3-8b --dtype bfloat16
    STEPS=(correctness timings)
fi

echo "=== summary (logs in $LOG_DIR)"
status=0
for name in "${STEPS[@]}"; do
    echo "  $name: ${RESULT[$name]}"
    [[ ${RESULT[$name]} == PASS* ]] || status=1
done
grep -h "FAIL" "$LOG_DIR"/*.log | head -20
grep -h "device copy bandwidth" "$LOG_DIR"/*.log
exit $status
