#!/usr/bin/env bash
# One-shot GPU check (each step has its own time limit; all of them add up to ~11 minutes, more
# than one 10-minute device call: pick steps with ONLY, e.g. ONLY="engine_parity gpu_decode",
# about 5 minutes, the check that matters most):
#   1. engine_parity: the engine on CUDA with the Triton LoRA kernels against PEFT, issue 3's
#      three-adapter workload (benchmarks/gpu_engine_check.py);
#   0. cold_start: a fresh engine's first requests with and without the start-up warm-up
#      (benchmarks/gpu_cold_start.py, ~1.5 min: four processes, each with an empty Triton cache);
#   2. gpu_decode: issue 17's GPU-grade decode (benchmarks/gpu_decode_check.py, at most ~4.5
#      minutes, a time limit per part, every figure in $LOG_DIR/gpu_decode_check.json): paged
#      attention and graph-safe LoRA kernels replayed from graphs against their references;
#      the engine's decode graphs replayed under other batches, contexts, tables and adapter
#      mixes against eager steps; a random SmolLM2-shaped model (graph step against the bare
#      graph forward, 16 adapters against base, against HF generate and PEFT); Llama-3-8B
#      shapes with random weights made on the GPU (tok/s at batch 1/16/64 and context
#      512/2048, KV blocks at 0.9, capture time, bandwidth); the top kernels of one replay;
#   3. correctness: lora_shrink / lora_expand (triton and torch backends) vs the fp32
#      reference, fp16 / bf16 / fp32, tiny + SmolLM2 widths, ranks 1-64, 1-133 tokens;
#   4. timings at Llama-3-8B shapes: triton vs the torch path, achieved bandwidth as a
#      fraction of the device copy bandwidth measured in the same run.
# With FULL=1 also (superseded by gpu_decode's smollm2 part, which runs them under graphs):
#   lora_overhead: benchmarks/lora_overhead.py on a random-weight model of the default
#      model's shapes (its config and tokenizer in $MODEL_LIKE, default .gpu/smollm2: the
#      weights do not travel), (a) decode step LoRA / base plus a CUDA-graph probe, (b) against
#      HF PEFT on the same GPU; engine_throughput: benchmarks/engine_throughput.py (no LoRA)
#      against HF generate.
# Run from anywhere on a fresh machine that has torch, triton, transformers and peft:
#   bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run   # CPU, triton interpreter, tiny shapes
# For FULL=1, before: mkdir -p .gpu/smollm2 and copy config.json, generation_config.json,
# tokenizer*.json and chat_template.jinja of ~/.cache/raylora/models/SmolLM2-135M-Instruct.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
LOG_DIR=${OUT:-/tmp}/gpu_check
mkdir -p "$LOG_DIR"
declare -A RESULT

ONLY=${ONLY:-}  # e.g. ONLY="engine_parity gpu_decode": run just these steps (a 10-minute call)
step() {  # step NAME TIMEOUT_S CMD...: run, tee the log, remember pass/fail
    local name=$1 limit=$2
    shift 2
    if [[ -n $ONLY && " $ONLY " != *" $name "* ]]; then RESULT[$name]="PASS (skipped: ONLY)"; return; fi
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

DECODE_JSON="$LOG_DIR/gpu_decode_check.json"
if [[ "${1:-}" == "--dry-run" ]]; then
    step dry_run 120 env TRITON_INTERPRET=1 "$PY" benchmarks/lora_kernels.py --tiny --interpret
    step dry_run_decode 150 env TRITON_INTERPRET=1 RAYLORA_CPU_KERNEL=0 \
        "$PY" benchmarks/gpu_decode_check.py --dry-run --json "$DECODE_JSON"
    STEPS=(dry_run dry_run_decode)
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "FAIL: no CUDA device visible (use --dry-run on CPU)"; exit 2; }
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    step cold_start 150 "$PY" benchmarks/gpu_cold_start.py --json "$LOG_DIR/gpu_cold_start.json"
    step engine_parity 90 "$PY" benchmarks/gpu_engine_check.py
    # its parts' limits add up to 260 s; the rest is start-up
    step gpu_decode 290 "$PY" benchmarks/gpu_decode_check.py --json "$DECODE_JSON"
    STEPS=(cold_start engine_parity gpu_decode)
    step correctness 150 "$PY" benchmarks/lora_kernels.py --check
    step timings 60 "$PY" benchmarks/lora_kernels.py --no-check --model llama3-8b --dtype bfloat16
    step timings_ranks 60 "$PY" benchmarks/lora_kernels.py --no-check --model llama3-8b \
        --dtype bfloat16 --adapter-rank 8
    STEPS+=(correctness timings timings_ranks)
    MODEL_LIKE=${MODEL_LIKE:-.gpu/smollm2}
    RANDOM_MODEL=/tmp/raylora-gpu-model
    if [[ "${FULL:-0}" == 1 && -f $MODEL_LIKE/config.json ]]; then
        "$PY" benchmarks/random_model.py --like "$MODEL_LIKE" --out "$RANDOM_MODEL"
        step lora_overhead 150 "$PY" benchmarks/lora_overhead.py --model "$RANDOM_MODEL"
        step engine_throughput 60 "$PY" benchmarks/engine_throughput.py --model "$RANDOM_MODEL"
        STEPS+=(lora_overhead engine_throughput)
    elif [[ "${FULL:-0}" == 1 ]]; then
        echo "no $MODEL_LIKE/config.json: lora_overhead and engine_throughput skipped"
    fi
fi

echo "=== summary (logs in $LOG_DIR)"
status=0
for name in "${STEPS[@]}"; do
    echo "  $name: ${RESULT[$name]}"
    [[ ${RESULT[$name]} == PASS* ]] || status=1
done
grep -h "FAIL" "$LOG_DIR"/*.log | head -20
grep -h "device copy bandwidth\|ratio\|PASS\|identical\|MET\|MISSED" "$LOG_DIR"/*.log
exit $status
