#!/usr/bin/env bash
# One-shot GPU check (under 9 minutes on one GPU; each step has its own time limit):
#   1. engine_parity: the engine on CUDA with the Triton LoRA kernels against PEFT, issue 3's
#      three-adapter workload (benchmarks/gpu_engine_check.py);
#   2. lora_overhead: benchmarks/lora_overhead.py on a random-weight model of the default
#      model's shapes (its config and tokenizer in $MODEL_LIKE, default .gpu/smollm2: the
#      weights do not travel), (a) decode step LoRA / base plus a CUDA-graph probe, (b) against
#      HF PEFT on the same GPU;
#   3. correctness: lora_shrink / lora_expand (triton and torch backends) vs the fp32
#      reference, fp16 / bf16 / fp32, tiny + SmolLM2 widths, ranks 1-64, 1-133 tokens;
#   4. timings at Llama-3-8B shapes: triton vs the torch path, achieved bandwidth as a
#      fraction of the device copy bandwidth measured in the same run;
#   5. engine_throughput: benchmarks/engine_throughput.py (no LoRA) against HF generate.
# Run from anywhere on a fresh machine that has torch, triton, transformers and peft:
#   bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run   # CPU, triton interpreter, tiny shapes
# Before: mkdir -p .gpu/smollm2 and copy config.json, generation_config.json, tokenizer*.json
# and chat_template.jinja of ~/.cache/raylora/models/SmolLM2-135M-Instruct into it.
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
    step dry_run 120 env TRITON_INTERPRET=1 "$PY" benchmarks/lora_kernels.py --tiny --interpret
    STEPS=(dry_run)
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "FAIL: no CUDA device visible (use --dry-run on CPU)"; exit 2; }
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    MODEL_LIKE=${MODEL_LIKE:-.gpu/smollm2}
    RANDOM_MODEL=/tmp/raylora-gpu-model
    step engine_parity 90 "$PY" benchmarks/gpu_engine_check.py
    STEPS=(engine_parity)
    if [[ -f $MODEL_LIKE/config.json ]]; then
        "$PY" benchmarks/random_model.py --like "$MODEL_LIKE" --out "$RANDOM_MODEL"
        step lora_overhead 150 "$PY" benchmarks/lora_overhead.py --model "$RANDOM_MODEL"
        STEPS+=(lora_overhead)
    else
        echo "no $MODEL_LIKE/config.json: lora_overhead and engine_throughput skipped"
    fi
    step correctness 150 "$PY" benchmarks/lora_kernels.py --check
    step timings 60 "$PY" benchmarks/lora_kernels.py --no-check --model llama3-8b --dtype bfloat16
    step timings_ranks 60 "$PY" benchmarks/lora_kernels.py --no-check --model llama3-8b \
        --dtype bfloat16 --adapter-rank 8
    STEPS+=(correctness timings timings_ranks)
    if [[ -f $MODEL_LIKE/config.json ]]; then
        step engine_throughput 60 "$PY" benchmarks/engine_throughput.py --model "$RANDOM_MODEL"
        STEPS+=(engine_throughput)
    fi
fi

echo "=== summary (logs in $LOG_DIR)"
status=0
for name in "${STEPS[@]}"; do
    echo "  $name: ${RESULT[$name]}"
    [[ ${RESULT[$name]} == PASS* ]] || status=1
done
grep -h "FAIL" "$LOG_DIR"/*.log | head -20
grep -h "device copy bandwidth\|ratio\|PASS\|identical" "$LOG_DIR"/*.log
exit $status
