"""A linear layer's float32 weight in the C++ CPU GEMM's panel layout (csrc/packed_cpu.cpp).

    pw = PackedWeight.pack(weight)      # weight [N, K] -> pw.data [ceil(N / 48), K, 48]
    y = base_linear(x, pw, bias)        # raylora_kernels.lora_linear: the packed GEMM where built
    pw.unpack()                         # the [N, K] weight again (bit for bit)

The model runner packs every linear of a float32 CPU model once, after loading, where the
C++ kernels are built with AVX-512 (`cpu_kernel.packed_gemm_fast()`), and keeps only the
packed copy (the weight's bytes rearranged, zero-padded to a whole panel), so the packed GEMM
costs no memory. The torch paths that need a plain weight (the C++ kernels turned off later)
call `unpack()`, which rebuilds it per call. A model with tied embeddings looks its token
embeddings up in the packed lm_head (`rows(ids)`) and frees the embedding's own copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PANEL = 48  # output columns per panel: kPanel in csrc/packed_cpu.h


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor  # [P, K, PANEL]: data[p, k, j] = weight[p * PANEL + j, k], zero-padded
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        n, k = weight.shape
        full, rest = divmod(n, PANEL)
        data = torch.zeros(full + (rest > 0), k, PANEL, dtype=weight.dtype, device=weight.device)
        # copied straight into place: no other transient copy (lm_head's is 113 MB here)
        data[:full].copy_(weight[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
        if rest:
            data[full, :, :rest].copy_(weight[full * PANEL :].t())
        return cls(data, n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """weight[ids] ([len(ids), in_features], the same values): a tied embedding's lookup in
        its lm_head's packed copy, so the model keeps one copy of that matrix."""
        ids = ids.to(torch.long)
        return self.data[ids // PANEL, :, ids % PANEL]

    def unpack(self) -> torch.Tensor:
        p, k, _ = self.data.shape
        return self.data.transpose(1, 2).reshape(p * PANEL, k)[: self.out_features].contiguous()

    @property
    def in_features(self) -> int:
        return self.data.shape[1]

    @property
    def shape(self) -> torch.Size:
        """The plain weight's shape, [out_features, in_features]."""
        return torch.Size((self.out_features, self.in_features))


@dataclass(frozen=True)
class GreedyHead:
    """Greedy decoding's lm_head on a PackedWeight: `head(x)` is argmax(x @ W^T, -1) as the
    packed GEMM's float32 logits give it, bit for bit (the first of equal maxima), at about
    half the cost: a bfloat16 screen with a proven error bound, then the few panels that can
    hold the maximum recomputed exactly (csrc/head_cpu.cpp says how). It keeps a bfloat16 copy
    of the weight (half the float32 one's bytes) and each column's norm.

        head = GreedyHead.build(packed_head, cpu_greedy_head_op())   # None where not built
        ids = head(hidden)                                           # [S] int64
    """

    packed: PackedWeight
    data16: torch.Tensor  # [P, K/2, PANEL, 2] bfloat16: data16[p, i, j, e] = data[p, 2i + e, j]
    norms: torch.Tensor  # [P * PANEL] float32: column norms (upper bounds); padding 0
    op: Callable[..., torch.Tensor]

    @classmethod
    def build(cls, pw: PackedWeight, op: Callable[..., torch.Tensor] | None) -> GreedyHead | None:
        """None without the op (no AVX512-BF16 build), for an odd K or a weight that is not
        finite (the screen's bound needs finite values)."""
        p, k, _ = pw.data.shape
        if op is None or k % 2 or pw.data.device.type != "cpu" or pw.data.dtype != torch.float32:
            return None
        # a float32 sum of K squares is within K * 2^-24 relative (its square root half that):
        # K * 2^-23 more makes each norm an upper bound; a weight not finite, a norm not finite
        norms = torch.linalg.vector_norm(pw.data, dim=1).reshape(-1) * (1 + k * 2.0**-23 + 1e-6)
        if not torch.isfinite(norms).all():
            return None
        data16 = torch.empty(p, k // 2, PANEL, 2, dtype=torch.bfloat16)
        data16.copy_(pw.data.view(p, k // 2, 2, PANEL).transpose(2, 3))
        return cls(pw, data16, norms.contiguous(), op)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, K] float32 (rows contiguous) -> [S] int64 token ids."""
        return self.op(x, self.packed.data, self.data16, self.norms, self.packed.out_features)
