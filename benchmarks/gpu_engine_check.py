"""The engine on a GPU against PEFT: issue 3's three-adapter workload (rank 4 q/v, rank 16 all
linears with rslora, rank 8 MLP, plus base requests; max_loras=2, so adapters are deferred and
swapped), greedy, on CUDA with the Triton LoRA kernels.

    python benchmarks/gpu_engine_check.py      # needs CUDA; run by benchmarks/gpu_check.sh
    TRITON_INTERPRET=1 python benchmarks/gpu_engine_check.py --device cpu   # dry run

1. dtype float32: every request must equal PEFT's fp32 greedy output (the near-tie rule of
   tests/reference.py), exactly as tests/test_lora_engine.py checks on the CPU. Exit 1 if not.
2. dtype bfloat16 (the CUDA default): how many requests equal the fp32 reference (reported;
   bf16 rounding moves near-ties, so no bound is asserted).
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import LLMEngine, SamplingParams  # noqa: E402
from tests.lora_fixtures import make_adapter_set  # noqa: E402
from tests.model_fixtures import make_tiny_llama  # noqa: E402
from tests.test_lora_engine import (  # noqa: E402
    check_parity,
    lora_requests,
    parity_engine,
    peft_references,
    run_checked,
    workload,
)


def engine_for(model_dir: str, dtype: str, device: str) -> LLMEngine:
    return parity_engine(model_dir, device=device, dtype=dtype, lora_backend="triton")


def main(argv: list[str] | None = None) -> int:
    device = (argv or sys.argv[1:] or ["--device", "cuda"])[-1]
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 2
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (triton interpreter)"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_llama(Path(tmp) / "tiny"))
        adapters = {k: str(v) for k, v in make_adapter_set(model_dir, Path(tmp) / "ad").items()}
        engine = engine_for(model_dir, "float32", device)
        assert engine.model_runner.lora_backend.name == "triton"
        check_parity(model_dir, adapters, engine)  # asserts
        print(f"PASS fp32 parity with PEFT on {where} (triton LoRA)")
        # the fp32 engine planned 90% of the GPU for its KV cache: free it before the next
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

        engine = engine_for(model_dir, "bfloat16", device)
        reqs = workload(lora_requests(adapters))
        ours = run_checked(engine, reqs, SamplingParams(temperature=0, max_tokens=10), 2)
        refs = peft_references(
            model_dir, adapters, reqs, engine.tokenizer, 10, engine.output_processor.eos_token_ids
        )
        same = sum(ours[rid] == ref for rid, (_, _, ref) in refs.items())
        print(f"bf16 engine: {same}/{len(reqs)} requests identical to PEFT fp32 (reported only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
