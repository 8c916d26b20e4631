"""One LoRA backend per engine (vLLM's PunicaWrapper idea): the route of every LoRA linear is
chosen once per engine (the platform) and once per step (the batch), never per call.

    backend = make_lora_backend(device, dtype, config.lora_backend)  # ModelRunner.__init__
    step = backend.prepare(meta)       # once per step (ForwardContext does it when built)
    y = step.linear(x, weight, bias, slot_weights)   # every LoRA linear: base + LoRA
    step.add_lora(x, y, slot_weights)  # y += LoRA only;  step.base(x, weight, bias): base only

  "torch"   CPULoRABackend (raylora_kernels/backends/cpu.py): the C++ CPU kernels for decode-shaped
            batches where built, one fused routine of torch ops otherwise (also on CUDA tensors)
  "triton"  TritonLoRABackend (raylora_kernels/backends/triton.py): lora_shrink + lora_expand; CUDA,
            or the CPU under TRITON_INTERPRET=1 (tests)

`prepare` returns a new backend bound to the step's metadata and leaves the engine's untouched:
contexts built ahead (a CUDA graph's capture, a benchmark's prepared forward) each keep their
own step, whatever steps run in between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from raylora_kernels.backends.cpu import CppOps, CPULoRABackend, cpp_ops
from raylora_kernels.backends.triton import TritonLoRABackend
from raylora_kernels.utils import BACKENDS, HAS_TRITON, interpret_mode

if TYPE_CHECKING:
    from raylora_kernels.lora_linear import SlotWeights
    from raylora_kernels.metadata import LoRABatchMeta
    from raylora_kernels.packed_weight import PackedWeight


class LoRABackend(Protocol):
    """The LoRA of one engine's linears. Unprepared (or prepared with None / a no_lora batch)
    it runs base GEMMs only."""

    name: str  # "torch" | "triton" (EngineConfig.lora_backend's values)
    meta: LoRABatchMeta | None  # the prepared step's batch; None: no LoRA work this step

    def prepare(self, meta: LoRABatchMeta | None) -> LoRABackend:
        """This backend for one step's batch: the per-step route decided here, once."""
        ...

    def base(
        self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """F.linear(x, weight, bias): x [T, H_in], weight [H_out, H_in] (or packed)."""
        ...

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None,
        w: SlotWeights | None,
    ) -> torch.Tensor:
        """base(x, weight, bias) plus add_lora's LoRA (none for w None), a new [T, H_out]."""
        ...

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, w: SlotWeights) -> None:
        """y[t, cols_s] += x[t] @ w.lora_a[s][slot(t)].T @ w.lora_b[s][slot(t)].T for every
        token with an adapter and every slice s; rows of other tokens stay untouched.
        x: [T, H_in]; y: [T, sum(w.widths)], rows contiguous."""
        ...


def lora_backend_name(requested: str, device: torch.device | str) -> str:
    """EngineConfig.lora_backend -> "torch" or "triton": "auto" is triton on CUDA (with the
    triton package), torch elsewhere."""
    assert requested in BACKENDS, f"lora_backend must be one of {BACKENDS}, got {requested!r}"
    if requested == "auto":
        return "triton" if torch.device(device).type == "cuda" and HAS_TRITON else "torch"
    return requested


def make_lora_backend(
    device: torch.device | str, dtype: torch.dtype, requested: str = "auto"
) -> LoRABackend:
    """The backend of an engine whose activations are `dtype` on `device` (once per engine).
    Raises ValueError for "triton" without the triton package, or on the CPU without
    TRITON_INTERPRET=1."""
    device = torch.device(device)
    ops = cpp_ops(device, dtype)
    if lora_backend_name(requested, device) == "torch":
        return CPULoRABackend(ops)
    if not HAS_TRITON:
        raise ValueError("lora_backend='triton' needs the triton package")
    if device.type != "cuda" and not interpret_mode():
        raise ValueError(
            f"lora_backend='triton' on {device.type} needs TRITON_INTERPRET=1 (the interpreter)"
        )
    return TritonLoRABackend(ops)


__all__ = [
    "CPULoRABackend",
    "CppOps",
    "LoRABackend",
    "TritonLoRABackend",
    "cpp_ops",
    "lora_backend_name",
    "make_lora_backend",
]
