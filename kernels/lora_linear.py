"""The LoRA of one (packed) linear layer in one call: y += per-token x @ A^T @ B^T, slice by slice.

    w = SlotWeights.zeros(max_loras, max_rank, in_features, [576, 192, 192])
    lora_linear(x, y, w, meta)          # y: the base layer's output [T, sum(widths)]
    y = linear_with_lora(x, weight, bias, w, meta)   # the base layer and its LoRA in one call

Triton backend: `lora_shrink` then `lora_expand` (GPU, or CPU under TRITON_INTERPRET=1).
Torch backend (the CPU path): decode-shaped batches go to the C++ CPU kernel
(kernels/cpu_kernel.py: one pass over each active adapter's weights, added straight into y)
where it is built; everything else, and everything when it is not, to one fused routine of
torch ops that reads every active adapter's weights once and launches few ops. Decode with
many adapters is bound by reading the weights, and MKL's batched GEMM streams them about
twice as fast in some layouts as in others (measured: benchmarks/lora_overhead.py,
docs/benchmarks.md), so SlotWeights stores them for the CPU GEMM:
  - the A matrices of all slices stacked, [L, S * R, H_in]; the shrink is A @ x^T, one bmm for
    every slice (the weight as the row-major left operand, the few tokens as the right one);
  - the B matrices transposed and side by side, [L, R, H_out]; the expand is buf @ B^T[cols].
The per-slice [L, R, H_in] and [L, H_out_s, R] views the Triton kernels take are views of these.

When the tokens arrive grouped by slot (the model runner orders them so; see
`LoRABatchMeta.tokens_sorted`), the torch path reads x and writes y through views instead of
gathers and scatters: with equal token counts per slot (decode) a packed linear's LoRA is
1 + S bmm calls and one in-place add. `linear_with_lora` saves that add too when every token
has an adapter: the LoRA delta comes first and the base GEMM accumulates onto it (addmm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu_kernel import (
    cpu_linear_lora_op,
    cpu_linear_lora_packed_op,
    cpu_linear_op,
    cpu_linear_packed_op,
    cpu_lora_op,
)
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.metadata import LoRABatchMeta
from kernels.packed_weight import PackedWeight
from kernels.torch_ops import _sgmv_fits
from kernels.utils import resolve_backend

_CAT_MAX_ELEMENTS = 1 << 16  # deltas up to this size are concatenated before one add into y
_FUSED_MAX_ELEMENTS = 1 << 18  # linear_with_lora: outputs up to this size take the addmm path
_CPU_KERNEL_MAX_TOKENS = 16  # the C++ kernel takes batches with at most this many tokens a slot


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
        # Per slice: (its rank columns in the shrink output, its columns of y, its B^T view).
        self._slices = [
            (slice(s * r, (s + 1) * r), slice(c, c + w), self.b_t[:, :, c : c + w])
            for s, (c, w) in enumerate(zip(starts, self.widths, strict=True))
        ]
        self.lora_a = [self.a[:, rs] for rs, _, _ in self._slices]
        self.lora_b = [b.mT for _, _, b in self._slices]

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
    """
    if meta.no_lora:
        return
    if resolve_backend(backend, x) == "triton":
        # Uninitialised is enough: the shrink writes (or, split-K, zeroes then accumulates)
        # every row of a token with an adapter, and the expand reads only those rows. On a GPU
        # an eager decode step is bound by launches, and zeros() would be one more per linear.
        buf = torch.empty(len(w.lora_a), x.shape[0], w.rank, dtype=torch.float32, device=x.device)
        lora_shrink(x, w.lora_a, meta, out=buf, backend="triton", ranks=w.ranks_device)
        lora_expand(buf, w.lora_b, meta, y, backend="triton", ranks=w.ranks_device)
        return
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0] == meta.num_tokens, (
        f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T={meta.num_tokens}, H]"
    )
    assert y.shape[1] == sum(w.widths), f"y has {y.shape[1]} columns, slices sum to {w.widths}"
    lora_linear_torch(x, y, w, meta)


def linear_with_lora(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None,
    w: SlotWeights,
    meta: LoRABatchMeta,
    backend: str = "auto",
) -> torch.Tensor:
    """F.linear(x, weight, bias) plus `lora_linear`'s per-token LoRA, returned as a new tensor.

    On the torch path, when every token has an adapter and the tokens come in equal runs per
    slot (a decode batch, ordered by the model runner), the delta is computed first and the
    base GEMM accumulates onto it (addmm with beta=1): y is written once, with no add pass.
    Batches the C++ CPU kernel takes: its `linear_lora` op (`linear_lora_packed` for a
    PackedWeight), the base GEMM and then the kernel adding into y, in one call from Python
    (this runs for every LoRA linear of every step; each call has a fixed cost). Otherwise
    (prefill-sized outputs, and any batch on a PackedWeight) `base_linear`, then `lora_linear`
    adds into its output.
    """
    torch_path = not meta.no_lora and resolve_backend(backend, x) == "torch"
    packed = isinstance(weight, PackedWeight)
    if torch_path and _cpu_kernel_takes(x, x, w, meta):  # x stands in for F.linear's y
        if packed:
            op = cpu_linear_lora_packed_op()
            if op is not None:
                n = weight.out_features
                return op(x, weight.data, n, bias, w.a, w.b_t, meta.segments, w.widths, w.ranks)
        else:
            op = cpu_linear_lora_op()
            if op is not None:
                return op(x, weight, bias, w.a, w.b_t, meta.segments, w.widths, w.ranks)
    if (
        torch_path
        and not packed
        and meta.uniform
        and meta.num_lora_tokens == meta.num_tokens > 0
        and x.shape[0] * weight.shape[0] <= _FUSED_MAX_ELEMENTS
        and x.dtype == w.a.dtype
    ):
        delta = _uniform_delta(x, w, meta)
        if bias is not None:
            delta.add_(bias)
        return delta.addmm_(x, weight.t())
    y = base_linear(x, weight, bias)
    lora_linear(x, y, w, meta, backend)
    return y


def base_linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """F.linear(x, weight, bias). On the CPU, float32, where the C++ kernels are built: a
    PackedWeight runs on the packed GEMM (any batch size), a plain weight on `linear`
    (decode-sized batches split by output columns between the threads, the rest handed to
    F.linear's own kernel). A PackedWeight without them is unpacked for F.linear."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        if isinstance(weight, PackedWeight):
            op = cpu_linear_packed_op()
            if op is not None and x.dim() == 2 and x.stride(1) == 1:
                return op(x, weight.data, weight.out_features, bias)
        else:
            op = cpu_linear_op()
            if op is not None:
                return op(x, weight, bias)
    if isinstance(weight, PackedWeight):
        weight = weight.unpack()
    return F.linear(x, weight, bias)


def lora_linear_torch(
    x: torch.Tensor, y: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta
) -> None:
    """Torch path of `lora_linear` (arguments already checked)."""
    if meta.no_lora:
        return
    op = cpu_lora_op() if _cpu_kernel_takes(x, y, w, meta) else None
    if op is not None:
        op(x, w.a, w.b_t, meta.segments, w.widths, w.ranks, y)
        return
    if w.a.dtype != x.dtype and x.device.type == "cpu":
        # lora_dtype narrower than the model's (bf16 slots, fp32 model) and a batch the C++
        # kernel does not take (prefill, or the kernel is off): widen the weights for this
        # call, so the math stays in the activations' precision, as in the kernel.
        w = SlotWeights(w.a.to(x.dtype), w.b_t.to(x.dtype), w.widths)
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


def _cpu_kernel_takes(
    x: torch.Tensor, y: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta
) -> bool:
    """Whether the C++ CPU kernel takes this batch (where it is built): fp32 activations on
    the CPU, fp32 or bf16 weights, tokens grouped by slot, few tokens a slot (decode), rows
    contiguous."""
    return (
        meta.tokens_sorted
        and meta.max_tokens_per_slot <= _CPU_KERNEL_MAX_TOKENS
        and x.device.type == "cpu"
        and x.dtype == y.dtype == torch.float32
        and w.a.dtype in (torch.float32, torch.bfloat16)
        and x.stride(1) == 1
        and y.stride(1) == 1
    )


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
    if len(w._slices) == 1:
        return _bmm_active(w.b_t, buf, meta)
    return torch.cat([_bmm_active(b, buf[:, :, rs], meta) for rs, _, b in w._slices], dim=2)


def _expand_add(ys: torch.Tensor, buf: torch.Tensor, w: SlotWeights, meta: LoRABatchMeta) -> None:
    """ys [A, n, H_out] += _expand(buf). Small (decode): one add of the concatenated slices,
    the fewest ops. Large (prefill): each slice into its own columns, because a concatenated
    copy of megabytes lands on fresh pages every call and costs more than the bmm."""
    if len(w._slices) == 1 or ys.numel() <= _CAT_MAX_ELEMENTS:
        ys.add_(_expand(buf, w, meta).to(ys.dtype))
        return
    for rs, cols, b in w._slices:
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
            for rs, cols, b in w._slices:
                ys[:, cols].add_((buf[:, rs] @ b[slot]).to(y.dtype))
        else:
            _add_rows(y, meta, rows, torch.cat([buf[:, rs] @ b[slot] for rs, _, b in w._slices], 1))


def _add_rows(y: torch.Tensor, meta: LoRABatchMeta, rows: slice, delta: torch.Tensor) -> None:
    """y[token of lora row i] += delta[i - rows.start] for the lora rows `rows`."""
    delta = delta.to(y.dtype)
    if meta.tokens_sorted:  # lora row i is token i
        y[rows].add_(delta)
    else:
        y.index_add_(0, meta.lora_token_ids[rows], delta)
