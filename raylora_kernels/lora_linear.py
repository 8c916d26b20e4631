"""The LoRA of one (packed) linear layer: its stacked slot weights, and per-call entry points.

    w = SlotWeights.zeros(max_loras, max_rank, in_features, [576, 192, 192])
    lora_linear(x, y, w, meta)          # y: the base layer's output [T, sum(widths)]
    y = linear_with_lora(x, weight, bias, w, meta)   # the base layer and its LoRA in one call
    y = base_linear(x, weight, bias)    # F.linear (the C++ GEMMs on a float32 CPU)

The engine does not call these per linear: it picks one backend at start-up and prepares it
once per step (raylora_kernels/backends: `make_lora_backend`, `LoRABackend.prepare`), and its linears
call that. These functions build the backend `backend` names for one call (benchmarks, tests,
the lm_head's base GEMM) and run the same routes: "triton" `lora_shrink` then `lora_expand`;
"torch" (the CPU path) the C++ CPU kernel for decode-shaped batches where built, one fused
routine of torch ops otherwise (raylora_kernels/backends/cpu.py says which batches take which).

SlotWeights stores the weights for the CPU GEMM (decode with many adapters is bound by reading
them, and MKL's batched GEMM streams some layouts about twice as fast as others: measured in
benchmarks/lora_overhead.py, docs/benchmarks.md):
  - the A matrices of all slices stacked, [L, S * R, H_in]; the shrink is A @ x^T, one bmm for
    every slice (the weight as the row-major left operand, the few tokens as the right one);
  - the B matrices transposed and side by side, [L, R, H_out]; the expand is buf @ B^T[cols].
The per-slice [L, R, H_in] and [L, H_out_s, R] views the Triton kernels take are views of these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from raylora_kernels.backends import CPULoRABackend, LoRABackend, TritonLoRABackend, cpp_ops
from raylora_kernels.backends.cpu import base_gemm
from raylora_kernels.metadata import LoRABatchMeta
from raylora_kernels.packed_weight import PackedWeight
from raylora_kernels.utils import resolve_backend


@dataclass
class SlotWeights:
    """Stacked per-slot LoRA weights of one packed linear (slices: q/k/v, gate/up, or one).

    a: [L, S * R, H_in]; rows [s * R, (s + 1) * R) of slot l are slice s's A
    b_t: [L, R, H_out]; columns of slice s (offsets = cumulative widths) hold its B^T
    Zero-padded past each adapter's rank; a slice an adapter does not target stays zero.
    ranks: None, or int64 [L, S] on the CPU (whatever the weights' device): how many leading
      rows of slice s in slot l may be non-zero (the adapter's rank, 0 for an untargeted
      slice). The C++ CPU kernel reads only those rows, and so do the Triton kernels from
      `ranks_device` (its int32 copy on the weights' device, `sync_ranks()`); the torch ops
      read every row (the rest are zeros). The LoRA manager keeps both; None means all R rows.
    """

    a: torch.Tensor
    b_t: torch.Tensor
    widths: list[int]
    ranks: torch.Tensor | None = None
    ranks_device: torch.Tensor | None = None
    lora_a: list[torch.Tensor] = field(init=False)  # per slice [L, R, H_in] views of a
    lora_b: list[torch.Tensor] = field(init=False)  # per slice [L, H_out_s, R] views of b_t
    # per slice: (its rank columns of the shrink output, its columns of y, its [L, R, H_out_s]
    # view of b_t), for the torch routes (raylora_kernels/backends/cpu.py)
    slices: list[tuple[slice, slice, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num_slots, sr, _ = self.a.shape
        num_slices = len(self.widths)
        assert sr % num_slices == 0, f"a has {sr} rows per slot for {num_slices} slices"
        r = sr // num_slices
        assert self.b_t.shape == (num_slots, r, sum(self.widths)), (
            f"b_t must be [L={num_slots}, R={r}, H_out={sum(self.widths)}], "
            f"got {tuple(self.b_t.shape)}"
        )
        starts = [sum(self.widths[:s]) for s in range(num_slices)]
        self.slices = [
            (slice(s * r, (s + 1) * r), slice(c, c + w), self.b_t[:, :, c : c + w])
            for s, (c, w) in enumerate(zip(starts, self.widths, strict=True))
        ]
        self.lora_a = [self.a[:, rs] for rs, _, _ in self.slices]
        self.lora_b = [b.mT for _, _, b in self.slices]

    def sync_ranks(self) -> None:
        """Copy `ranks` into `ranks_device` (allocated once; after each slot activation)."""
        if self.ranks is None:
            self.ranks_device = None
            return
        if self.ranks_device is None or self.ranks_device.shape != self.ranks.shape:
            self.ranks_device = torch.empty(
                self.ranks.shape, dtype=torch.int32, device=self.a.device
            )
        self.ranks_device.copy_(self.ranks)

    @classmethod
    def zeros(
        cls,
        num_slots: int,
        rank: int,
        hidden_in: int,
        widths: Sequence[int],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> SlotWeights:
        a = torch.zeros(num_slots, len(widths) * rank, hidden_in, device=device, dtype=dtype)
        b_t = torch.zeros(num_slots, rank, sum(widths), device=device, dtype=dtype)
        return cls(a, b_t, list(widths))

    @property
    def rank(self) -> int:
        return self.b_t.shape[1]


def lora_linear(
    x: torch.Tensor,
    y: torch.Tensor,
    w: SlotWeights,
    meta: LoRABatchMeta,
    backend: str = "auto",
) -> None:
    """y[t, cols_s] += x[t] @ lora_a[s][slot(t)].T @ lora_b[s][slot(t)].T for every token
    with an adapter (slot(t) >= 0) and every slice s; rows of other tokens stay untouched.

    x: [T, H_in]; y: [T, sum(w.widths)], rows contiguous, same dtype as the weights (the torch
    backend also takes narrower weights: bf16 slots under an fp32 model, math in fp32).
    One call of `LoRABackend.add_lora` on the backend `backend` names (utils.resolve_backend).
    """
    if meta.no_lora:
        return
    be = _backend_for_call(backend, x, y.dtype)
    if be.name == "torch":
        assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0] == meta.num_tokens, (
            f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T={meta.num_tokens}, H]"
        )
        assert y.shape[1] == sum(w.widths), f"y has {y.shape[1]} columns, slices sum to {w.widths}"
    be.prepare(meta).add_lora(x, y, w)


def linear_with_lora(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None,
    w: SlotWeights,
    meta: LoRABatchMeta,
    backend: str = "auto",
) -> torch.Tensor:
    """F.linear(x, weight, bias) plus `lora_linear`'s per-token LoRA, returned as a new tensor:
    one call of `LoRABackend.linear` on the backend `backend` names. On the torch backend the
    C++ kernel's batches run the base GEMM and the kernel in one call, and a decode batch whose
    every token has an adapter computes the delta first and lets the base GEMM accumulate onto
    it (addmm with beta=1): y is written once, with no add pass."""
    return _backend_for_call(backend, x, x.dtype).prepare(meta).linear(x, weight, bias, w)


def base_linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """F.linear(x, weight, bias). On the CPU, float32, where the C++ kernels are built: a
    PackedWeight runs on the packed GEMM (any batch size), a plain weight on `linear`
    (decode-sized batches split by output columns between the threads, the rest handed to
    F.linear's own kernel). A PackedWeight without them is unpacked for F.linear."""
    return base_gemm(x, weight, bias, cpp_ops(x.device, x.dtype))


def _backend_for_call(backend: str, x: torch.Tensor, y_dtype: torch.dtype) -> LoRABackend:
    """The backend `backend` names for x's device; its C++ CPU kernels only for float32 x and
    y on the CPU (what they take)."""
    ops = cpp_ops(x.device, x.dtype) if y_dtype == x.dtype else None
    if resolve_backend(backend, x) == "triton":
        return TritonLoRABackend(ops)
    return CPULoRABackend(ops)
