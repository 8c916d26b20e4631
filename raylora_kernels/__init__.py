"""LoRA kernels: punica-style shrink/expand over tokens grouped by adapter slot.

(Not `kernels`: that import name belongs to Hugging Face's `kernels`, which transformers >= 5.25
requires and imports; tests/test_packaging.py keeps every top-level name of ours unique.)

    meta = LoRABatchMeta.build(token_slots, max_loras)   # once per forward step
    buf = lora_shrink(x, [a_q, a_k, a_v], meta)          # [3, T, R] fp32
    lora_expand(buf, [b_q, b_k, b_v], meta, y)           # y[:, q|k|v] += ...

    backend = make_lora_backend(device, dtype, "auto")   # once per engine (raylora_kernels/backends)
    step = backend.prepare(meta)                         # once per step
    y = step.linear(x, weight, bias, slot_weights)       # per linear: base GEMM + its LoRA

    lora_linear(x, y, slot_weights, meta)                # per-call forms (benchmarks, tests)
    y = linear_with_lora(x, weight, bias, slot_weights, meta)
    y = base_linear(x, weight, bias)                     # F.linear (C++ GEMMs on the CPU)

Each op has a Triton implementation (CUDA, or CPU under TRITON_INTERPRET=1) and a
torch implementation (the CPU path); `*_ref` are slow fp32 references for tests.
"""

from raylora_kernels.backends import LoRABackend, lora_backend_name, make_lora_backend
from raylora_kernels.lora_expand import lora_expand
from raylora_kernels.lora_linear import SlotWeights, base_linear, linear_with_lora, lora_linear
from raylora_kernels.lora_shrink import lora_shrink
from raylora_kernels.metadata import LoRABatchMeta
from raylora_kernels.torch_ops import lora_expand_ref, lora_shrink_ref

__all__ = [
    "LoRABackend",
    "LoRABatchMeta",
    "SlotWeights",
    "base_linear",
    "linear_with_lora",
    "lora_backend_name",
    "lora_expand",
    "lora_expand_ref",
    "lora_linear",
    "lora_shrink",
    "lora_shrink_ref",
    "make_lora_backend",
]
