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
