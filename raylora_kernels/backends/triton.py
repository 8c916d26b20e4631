"""The Triton LoRA backend: `lora_shrink` then `lora_expand` per linear (CUDA, or the CPU under
TRITON_INTERPRET=1 for tests).

    be = TritonLoRABackend(cpp_ops(device, dtype))   # once per engine (raylora_kernels.make_lora_backend)
    step = be.prepare(meta)          # once per step: a LoRABatchMeta, or a StaticLoRAMeta
    y = step.linear(x, weight, bias, w)               # base GEMM, then shrink + expand into y

The kernels read the step's metadata on the device. A StaticLoRAMeta (CUDA graphs: fixed
shapes and addresses, updated in place) goes through the same public `lora_shrink` /
`lora_expand`, which take their graph-safe launch for it; this backend adds no host work per
linear beyond the two launches and the shrink buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raylora_kernels.backends.cpu import CppOps, base_gemm
from raylora_kernels.lora_expand import lora_expand
from raylora_kernels.lora_shrink import lora_shrink
from raylora_kernels.packed_weight import PackedWeight

if TYPE_CHECKING:
    from raylora_kernels.lora_linear import SlotWeights
    from raylora_kernels.metadata import LoRABatchMeta, StaticLoRAMeta


class TritonLoRABackend:
    """raylora_kernels.backends.LoRABackend on the Triton kernels. `ops`: the C++ CPU GEMMs for the
    base linears under the interpreter on a float32 CPU model (weights may be packed there);
    None on CUDA (F.linear)."""

    name = "triton"

    def __init__(
        self, ops: CppOps | None, meta: LoRABatchMeta | StaticLoRAMeta | None = None
    ) -> None:
        self.ops = ops
        self.meta = None if meta is None or meta.no_lora else meta  # None: base GEMMs only

    def prepare(self, meta: LoRABatchMeta | StaticLoRAMeta | None) -> TritonLoRABackend:
        return TritonLoRABackend(self.ops, meta)

    def base(
        self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return base_gemm(x, weight, bias, self.ops)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None,
        w: SlotWeights | None,
    ) -> torch.Tensor:
        y = base_gemm(x, weight, bias, self.ops)
        if w is not None:
            self.add_lora(x, y, w)
        return y

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, w: SlotWeights) -> None:
        meta = self.meta
        if meta is None:
            return
        # Uninitialised is enough: the shrink writes (or, split-K, zeroes then accumulates)
        # every row of a token with an adapter, and the expand reads only those rows. On a GPU
        # an eager decode step is bound by launches, and zeros() would be one more per linear.
        buf = torch.empty(len(w.lora_a), x.shape[0], w.rank, dtype=torch.float32, device=x.device)
        lora_shrink(x, w.lora_a, meta, out=buf, backend="triton", ranks=w.ranks_device)
        lora_expand(buf, w.lora_b, meta, y, backend="triton", ranks=w.ranks_device)
