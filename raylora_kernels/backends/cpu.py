"""The torch LoRA backend (the CPU path): the C++ CPU kernels where they take the batch, one
fused routine of torch ops otherwise.

    be = CPULoRABackend(cpp_ops(device, dtype))   # once per engine (raylora_kernels.make_lora_backend)
    step = be.prepare(meta)                       # once per step: this batch's route
    y = step.linear(x, weight, bias, w)           # per linear: base GEMM + its LoRA

Routes (the same ops, for the same batches, as the per-call functions of raylora_kernels/lora_linear.py
picked before this backend existed; prepare decides the per-step part once):
  - C++ kernel batches (tokens grouped by slot, at most 16 a slot: decode) where the kernels are
    built: `linear_lora` / `linear_lora_packed` (the base GEMM, then the kernel adding into y,
    one call) and `lora_add` (y += LoRA). Reading every active adapter's weights is the whole
    cost there, and torch's batched GEMM reads the expand's weights at about half the bandwidth.
  - every token has an adapter, in equal runs per slot (decode without the kernels), plain
    weight, small output: the delta first, then the base GEMM accumulates onto it (addmm).
  - otherwise the base GEMM, then the fused torch routine adds into it.
Decode with many adapters is bound by reading the weights, and MKL's batched GEMM streams them
about twice as fast in some layouts as in others (benchmarks/lora_overhead.py), so SlotWeights
stores them for the CPU GEMM (its docstring): the shrink is one bmm of the stacked A of every
slice against the tokens (A @ x^T), the expand buf @ B^T[cols]. With the tokens grouped by slot
(the model runner orders them so) x and y are read through views instead of gathers and
scatters: with equal token counts per slot a packed linear's LoRA is 1 + S bmm calls and one add.
On CUDA tensors (lora_backend="torch") only the torch routes run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from raylora_kernels.cpu_kernel import (
    cpu_linear_lora_op,
    cpu_linear_lora_packed_op,
    cpu_linear_op,
    cpu_linear_packed_op,
    cpu_lora_op,
)
from raylora_kernels.metadata import LoRABatchMeta
from raylora_kernels.packed_weight import PackedWeight
from raylora_kernels.torch_ops import _sgmv_fits

if TYPE_CHECKING:
    from raylora_kernels.lora_linear import SlotWeights

_CAT_MAX_ELEMENTS = 1 << 16  # deltas up to this size are concatenated before one add into y
_FUSED_MAX_ELEMENTS = 1 << 18  # outputs up to this size take the delta-then-addmm route
# The C++ kernel takes batches with at most this many tokens a slot: prefill too. Measured
# (2026-12-02, SmolLM2-135M, the 64-request workload, r16 all linears): prefill with 16
# adapters 11.0 -> 8.1 s against the torch route, with 2 adapters (1k tokens a slot) 9.3 ->
# 8.1 s; the cap was 16 (decode only) before.
_CPU_KERNEL_MAX_TOKENS = 4096
_KERNEL_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CppOps:
    """The C++ CPU kernels (raylora_kernels/cpu_kernel.py) a backend calls, looked up once."""

    linear: Callable[..., torch.Tensor]  # (x, weight, bias)
    linear_packed: Callable[..., torch.Tensor]  # (x, packed.data, N, bias)
    lora_add: Callable[..., None]  # (x, a, b_t, segments, widths, ranks, y)
    linear_lora: Callable[..., torch.Tensor]  # (x, weight, bias, a, b_t, segments, widths, ranks)
    linear_lora_packed: Callable[..., torch.Tensor]  # (x, data, N, bias, a, b_t, ...)


def cpp_ops(device: torch.device | str, dtype: torch.dtype) -> CppOps | None:
    """The C++ kernels for `dtype` activations on `device`: float32 on the CPU where they are
    built (and not turned off, RAYLORA_CPU_KERNEL=0); None otherwise (torch ops only)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    ops = (
        cpu_linear_op(),
        cpu_linear_packed_op(),
        cpu_lora_op(),
        cpu_linear_lora_op(),
        cpu_linear_lora_packed_op(),
    )
    return None if any(op is None for op in ops) else CppOps(*ops)


def base_gemm(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None,
    ops: CppOps | None,
) -> torch.Tensor:
    """F.linear(x, weight, bias). With the C++ kernels: a PackedWeight on the packed GEMM (any
    batch size), a plain weight on `linear` (decode-sized batches split by output columns
    between the threads, the rest handed to F.linear's own kernel). Without them a PackedWeight
    is unpacked for F.linear."""
    if isinstance(weight, PackedWeight):
        if ops is not None and x.dim() == 2 and x.stride(1) == 1:
            return ops.linear_packed(x, weight.data, weight.out_features, bias)
        return F.linear(x, weight.unpack(), bias)
    if ops is not None:
        return ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class CPULoRABackend:
    """The torch backend (raylora_kernels.backends.LoRABackend). Built once per engine with its C++
    kernels (`cpp_ops`, None for torch ops only); `prepare(meta)` returns a copy bound to one
    step's batch, with the route of that batch decided once for every LoRA linear."""

    name = "torch"

    def __init__(self, ops: CppOps | None, meta: LoRABatchMeta | None = None) -> None:
        assert meta is None or isinstance(meta, LoRABatchMeta), (
            f"the torch LoRA backend takes a LoRABatchMeta (host fields), got {type(meta).__name__}"
        )
        self.ops = ops
        self.meta = None if meta is None or meta.no_lora else meta  # None: base GEMMs only
        m = self.meta
        # The C++ kernel takes this batch: each slot's tokens one run of rows, few of them
        # (decode). Per linear it also needs fp32/bf16 weights and rows contiguous.
        self.kernel_batch = (
            m is not None
            and ops is not None
            and m.tokens_sorted
            and m.max_tokens_per_slot <= _CPU_KERNEL_MAX_TOKENS
        )
        # Every token has an adapter, in equal runs per slot at the top of the batch (decode).
        self.uniform_all = m is not None and m.uniform and m.num_lora_tokens == m.num_tokens

    def prepare(self, meta: LoRABatchMeta | None) -> CPULoRABackend:
        return CPULoRABackend(self.ops, meta)

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
        m = self.meta
        if m is None or w is None:
            return base_gemm(x, weight, bias, self.ops)
        packed = isinstance(weight, PackedWeight)
        if self.kernel_batch and _kernel_takes(x, x, w):  # x stands in for the GEMM's y
            if packed:
                n = weight.out_features
                return self.ops.linear_lora_packed(
                    x, weight.data, n, bias, w.a, w.b_t, m.segments, w.widths, w.ranks
                )
            return self.ops.linear_lora(x, weight, bias, w.a, w.b_t, m.segments, w.widths, w.ranks)
        if (
            self.uniform_all
            and not packed
            and x.shape[0] * weight.shape[0] <= _FUSED_MAX_ELEMENTS
            and x.dtype == w.a.dtype
        ):  # y written once, no add pass: the base GEMM accumulates onto the delta
            delta = _uniform_delta(x, w, m)
            if bias is not None:
                delta.add_(bias)
            return delta.addmm_(x, weight.t())
        y = base_gemm(x, weight, bias, self.ops)
        self.add_lora(x, y, w)
        return y

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, w: SlotWeights) -> None:
        m = self.meta
        if m is None:
            return
        if self.kernel_batch and _kernel_takes(x, y, w):
            self.ops.lora_add(x, w.a, w.b_t, m.segments, w.widths, w.ranks, y)
            return
        _lora_torch(x, y, w, m)


def _kernel_takes(x: torch.Tensor, y: torch.Tensor, w: SlotWeights) -> bool:
    """The per-linear part of whether the C++ kernel takes a batch (the ops themselves exist only
    for float32 CPU activations): fp32 or bf16 weights, rows contiguous."""
    return w.a.dtype in _KERNEL_WEIGHT_DTYPES and x.stride(1) == 1 and y.stride(1) == 1


def _lora_torch(x: torch.Tensor, y: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> None:
    """y += the LoRA of x on torch ops (meta has adapter tokens)."""
    if w.a.dtype != x.dtype and x.device.type == "cpu":
        # lora_dtype narrower than the model's (bf16 slots, fp32 model) and a batch the C++
        # kernel does not take (prefill, or the kernel is off): widen the weights for this
        # call, so the math stays in the activations' precision, as in the kernel.
        # (replace: the same slices and widths, the ranks dropped: the torch ops read every row)
        w = dataclasses.replace(
            w, a=w.a.to(x.dtype), b_t=w.b_t.to(x.dtype), ranks=None, ranks_device=None
        )
    x = x.to(w.a.dtype)
    num_lora = meta.num_lora_tokens
    num_active, max_n = meta.num_active_slots, meta.max_tokens_per_slot
    if meta.uniform:  # equal runs of tokens per slot at the top of the batch: views, no copies
        xs = (x if num_lora == x.shape[0] else x[:num_lora]).view(num_active, max_n, x.shape[1])
        ys = y if num_lora == y.shape[0] else y[:num_lora]
        _expand_add(ys.view(num_active, max_n, y.shape[1]), _shrink(xs, w, meta), w, meta)
        return
    if not _sgmv_fits(meta):
        _per_slot(x, y, w, meta)  # uneven segments (a long prefill next to decodes)
        return
    # each slot's tokens padded into one row of [A, max_n]
    xs = x.index_select(0, meta.padded_token_ids.flatten()).view(num_active, max_n, x.shape[1])
    delta = _expand(_shrink(xs, w, meta), w, meta).view(num_active * max_n, y.shape[1])
    _add_rows(y, meta, slice(0, num_lora), delta.index_select(0, meta.padded_rows))


def _uniform_delta(x: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> torch.Tensor:
    """[T, H_out] LoRA delta of x [T, H_in] whose rows are the adapter tokens in equal runs per
    active slot (meta.uniform): views of x in, one contiguous tensor out."""
    xs = x.view(meta.num_active_slots, meta.max_tokens_per_slot, x.shape[1])
    return _expand(_shrink(xs, w, meta), w, meta).view(x.shape[0], -1)


def _shrink(xs: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> torch.Tensor:
    """[A, n, S * R]: xs [A, n, H_in] (active slot i's tokens in row i) times every slice's A^T,
    computed as A @ xs^T, the weights as the left operand (see the module docstring)."""
    return _bmm_active(w.a, xs.mT, meta, weights_left=True).mT


def _expand(buf: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> torch.Tensor:
    """[A, n, H_out]: each slice's rank columns of buf [A, n, S * R] times its B^T."""
    if len(w.slices) == 1:
        return _bmm_active(w.b_t, buf, meta)
    return torch.cat([_bmm_active(b, buf[:, :, rs], meta) for rs, _, b in w.slices], dim=2)


def _expand_add(ys: torch.Tensor, buf: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> None:
    """ys [A, n, H_out] += _expand(buf). Small (decode): one add of the concatenated slices,
    the fewest ops. Large (prefill): each slice into its own columns, because a concatenated
    copy of megabytes lands on fresh pages every call and costs more than the bmm."""
    if len(w.slices) == 1 or ys.numel() <= _CAT_MAX_ELEMENTS:
        ys.add_(_expand(buf, w, meta).to(ys.dtype))
        return
    for rs, cols, b in w.slices:
        ys[:, :, cols].add_(_bmm_active(b, buf[:, :, rs], meta).to(ys.dtype))


def _bmm_active(
    weights: torch.Tensor, rhs: torch.Tensor, meta: LoRABatchMeta, weights_left: bool = False
) -> torch.Tensor:
    """bmm of the active slots' weights with rhs [A, ...] (weights @ rhs if weights_left, else
    rhs @ weights), one bmm per run of consecutive slots: slices of the weights, no copies."""
    runs = meta.active_slot_runs
    if len(runs) == 1 and runs[0][1] - runs[0][0] == weights.shape[0]:  # every slot active
        return torch.bmm(weights, rhs) if weights_left else torch.bmm(rhs, weights)
    out = []
    for lo, hi, i in runs:
        ws, r = weights[lo:hi], rhs[i : i + hi - lo]
        out.append(torch.bmm(ws, r) if weights_left else torch.bmm(r, ws))
    return out[0] if len(out) == 1 else torch.cat(out)


def _per_slot(x: torch.Tensor, y: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> None:
    for slot, start, n in zip(
        meta.active_slots_list, meta.slot_starts_list, meta.num_tokens_per_slot_list, strict=True
    ):
        rows = slice(start, start + n)
        xs = x[rows] if meta.tokens_sorted else x.index_select(0, meta.lora_token_ids[rows])
        buf = (w.a[slot] @ xs.T).T  # [n, S * R]
        if meta.tokens_sorted:  # slice by slice into y's rows (see _expand_add)
            ys = y[rows]
            for rs, cols, b in w.slices:
                ys[:, cols].add_((buf[:, rs] @ b[slot]).to(y.dtype))
        else:
            _add_rows(y, meta, rows, torch.cat([buf[:, rs] @ b[slot] for rs, _, b in w.slices], 1))


def _add_rows(y: torch.Tensor, meta: LoRABatchMeta, rows: slice, delta: torch.Tensor) -> None:
    """y[token of lora row i] += delta[i - rows.start] for the lora rows `rows`."""
    delta = delta.to(y.dtype)
    if meta.tokens_sorted:  # lora row i is token i
        y[rows].add_(delta)
    else:
        y.index_add_(0, meta.lora_token_ids[rows], delta)
