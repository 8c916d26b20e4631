"""lora_expand: y[:, slice] += buf @ B^T for every token with its own adapter slot (SGMV expand)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raylora_kernels.metadata import LoRABatchMeta, StaticLoRAMeta, static_device_table
from raylora_kernels.torch_ops import lora_expand_torch
from raylora_kernels.utils import (
    HAS_TRITON,
    LazyJit,
    cdiv,
    check_expand_args,
    device_table,
    dot_in_fp32,
    interpret_mode,
    next_power_of_2,
    resolve_backend,
)

if HAS_TRITON:
    import triton.language as tl


def _lora_expand_kernel(
    buf_ptr,
    b_ptrs,  # [S] int64: data_ptr of each slice's [L, H_out_s, R] weights
    y_ptr,
    sorted_token_ids,  # [T] int32
    num_tokens_per_slot,  # [A] int32
    slot_starts,  # [A] int32
    active_slots,  # [A] int32
    slice_widths,  # [S] int32: H_out_s
    slice_offsets,  # [S] int32: first column of slice s in y
    slice_stride_l,  # [S] int64: lora_b[s].stride(0)
    slot_ranks,  # [L, S] int32: rows of each slot's slices that hold weights (HAS_RANKS)
    K,  # R
    MAX_N,  # max_s H_out_s
    stride_bs,
    stride_bt,
    stride_bk,
    stride_wn,  # lora_b[s].stride(1), the same for every slice (contiguous, same R)
    stride_wk,
    stride_yt,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tiles, exact fp32 dot (see utils.dot_in_fp32)
    HAS_RANKS: tl.constexpr,
):
    # grid: (m tiles x n tiles of the widest slice, slices, active slots)
    pid = tl.program_id(0)
    slice_id = tl.program_id(1)
    seg = tl.program_id(2)
    num_n = (MAX_N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n
    pid_n = pid % num_n

    N = tl.load(slice_widths + slice_id)
    seg_len = tl.load(num_tokens_per_slot + seg)
    if pid_m * BLOCK_M >= seg_len:  # this slot has fewer tokens than the longest one
        return
    if pid_n * BLOCK_N >= N:  # this slice is narrower than the widest one
        return
    seg_start = tl.load(slot_starts + seg)
    slot = tl.load(active_slots + seg).to(tl.int64)
    col0 = tl.load(slice_offsets + slice_id)
    stride_wl = tl.load(slice_stride_l + slice_id)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tok = tl.load(sorted_token_ids + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N

    w_ptr = tl.load(b_ptrs + slice_id).to(tl.pointer_type(y_ptr.dtype.element_ty))
    buf_rows = buf_ptr + slice_id * stride_bs + tok[:, None] * stride_bt  # [BLOCK_M, 1]
    w_cols = w_ptr + slot * stride_wl + offs_n[None, :] * stride_wn  # [1, BLOCK_N]

    rank = K
    if HAS_RANKS:  # only the rows up to the adapter's rank hold weights: read no others
        rank = tl.load(slot_ranks + slot * tl.num_programs(1) + slice_id)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # tl.zeros is a std-lib @jit
    for k in range(0, rank, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        bt = tl.load(
            buf_rows + offs_k[None, :] * stride_bk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        wt = tl.load(
            w_cols + offs_k[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            acc += tl.dot(bt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:  # 16-bit tensor-core dot, fp32 accumulate
            acc += tl.dot(bt.to(wt.dtype), wt)

    y_ptrs = y_ptr + tok[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    if ADD_INPUTS:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_kernel = LazyJit(_lora_expand_kernel)


def _config(meta: LoRABatchMeta, rank: int, max_width: int) -> dict:
    block_m = min(64, max(16, next_power_of_2(meta.max_tokens_per_slot)))
    block_n = 256 if interpret_mode() else (64 if meta.max_tokens_per_slot > 16 else 128)
    block_k = min(64, max(16, next_power_of_2(rank)))
    return dict(
        BLOCK_M=block_m, BLOCK_N=min(block_n, max(16, next_power_of_2(max_width))), BLOCK_K=block_k
    )


def _static_config(num_tokens: int, num_slots: int, rank: int, max_width: int) -> dict:
    """Config of the graph-safe launch: a function of the capture shape only, never of the
    adapter mix. Tiles sized for an even mix, T / L tokens a slot."""
    block_m = min(64, max(16, next_power_of_2(cdiv(num_tokens, num_slots))))
    block_n = 256 if interpret_mode() else (64 if block_m > 16 else 128)
    block_k = min(64, max(16, next_power_of_2(rank)))
    return dict(
        BLOCK_M=block_m, BLOCK_N=min(block_n, max(16, next_power_of_2(max_width))), BLOCK_K=block_k
    )


def _launch(
    grid: tuple[int, int, int],
    cfg: dict,
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    table: torch.Tensor,
    meta: LoRABatchMeta | StaticLoRAMeta,
    y: torch.Tensor,
    add_inputs: bool,
    ranks: torch.Tensor | None,
) -> None:
    b0 = lora_b[0]
    _kernel[grid](
        buf,
        table[0],
        y,
        meta.sorted_token_ids,
        meta.num_tokens_per_slot,
        meta.slot_starts,
        meta.active_slots,
        table[1],
        table[2],
        table[3],
        meta.active_slots if ranks is None else ranks,  # (unread without ranks)
        buf.shape[2],
        max(b.shape[1] for b in lora_b),
        buf.stride(0),
        buf.stride(1),
        buf.stride(2),
        b0.stride(1),
        b0.stride(2),
        y.stride(0),
        y.stride(1),
        ADD_INPUTS=add_inputs,
        DOT_FP32=dot_in_fp32(b0.dtype),
        HAS_RANKS=ranks is not None,
        **cfg,
    )


def _table_rows(lora_b: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[list[int]]:
    # per slice: weight data_ptr, width H_out_s, first column in y, stride(0)
    return [
        [b.data_ptr() for b in lora_b],
        [b.shape[1] for b in lora_b],
        list(offsets),
        [b.stride(0) for b in lora_b],
    ]


def lora_expand_triton(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRABatchMeta,
    y: torch.Tensor,
    offsets: Sequence[int],
    add_inputs: bool,
    config: dict | None = None,
    ranks: torch.Tensor | None = None,
) -> None:
    """Triton path of `lora_expand` (arguments already checked). `config` overrides
    BLOCK_M / BLOCK_N / BLOCK_K (tests use it to cover every code path)."""
    if meta.no_lora:
        return
    assert y.dtype == lora_b[0].dtype, (
        f"backend='triton' needs y dtype {y.dtype} == lora_b dtype {lora_b[0].dtype}"
    )
    rank = buf.shape[2]
    max_width = max(b.shape[1] for b in lora_b)
    cfg = _config(meta, rank, max_width)
    cfg.update(config or {})
    table = device_table(_table_rows(lora_b, offsets), y.device)
    grid = (
        cdiv(meta.max_tokens_per_slot, cfg["BLOCK_M"]) * cdiv(max_width, cfg["BLOCK_N"]),
        len(lora_b),
        meta.num_active_slots,
    )
    _launch(grid, cfg, buf, lora_b, table, meta, y, add_inputs, ranks)


def lora_expand_static(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: StaticLoRAMeta,
    y: torch.Tensor,
    offsets: Sequence[int],
    add_inputs: bool,
    config: dict | None = None,
    ranks: torch.Tensor | None = None,
) -> None:
    """Graph-safe Triton path of `lora_expand` (arguments already checked): the same kernel
    over a fixed grid, (cdiv(T, BLOCK_M) * n tiles of the widest slice, S, L), every program
    reading its slot's token count and start on the device and exiting when it has no tokens
    there. No host sync, no per-step host values. `config` overrides the tiles (tests)."""
    assert y.dtype == lora_b[0].dtype, (
        f"backend='triton' needs y dtype {y.dtype} == lora_b dtype {lora_b[0].dtype}"
    )
    num_slots = lora_b[0].shape[0]
    assert num_slots == meta.max_loras, f"lora_b has {num_slots} slots, meta {meta.max_loras}"
    max_width = max(b.shape[1] for b in lora_b)
    cfg = _static_config(meta.num_tokens, num_slots, buf.shape[2], max_width)
    cfg.update(config or {})
    table = static_device_table(_table_rows(lora_b, offsets), y.device)
    grid = (
        cdiv(meta.num_tokens, cfg["BLOCK_M"]) * cdiv(max_width, cfg["BLOCK_N"]),
        len(lora_b),
        num_slots,
    )
    _launch(grid, cfg, buf, lora_b, table, meta, y, add_inputs, ranks)


def lora_expand(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRABatchMeta | StaticLoRAMeta,
    y: torch.Tensor,
    offsets: Sequence[int] | None = None,
    add_inputs: bool = True,
    backend: str = "auto",
    ranks: torch.Tensor | None = None,
) -> None:
    """Add each token's adapter B projection into its slice of y (the LoRA "expand"), in place.

    Semantics:
        for s in range(S):
            cols = slice(offsets[s], offsets[s] + lora_b[s].shape[1])
            for t in range(T):
                if meta.token_slots[t] >= 0:
                    delta = buf[s, t, :] @ lora_b[s][meta.token_slots[t]].T
                    y[t, cols] = y[t, cols] + delta if add_inputs else delta
        # rows of tokens with slot -1 are left exactly as they were

    Args:
        buf: [S, T, R] contiguous, usually the fp32 output of `lora_shrink`.
        lora_b: S tensors, each [L, H_out_s, R], same dtype, same stride(1) and stride(2)
            (contiguous, or views of one packed tensor: SlotWeights.lora_b); H_out_s may
            differ per slice (q/k/v under GQA: 576, 192, 192). Scaling alpha / r is
            folded in by the caller.
        meta: `LoRABatchMeta.build(token_slots, L)`, built once per step; or a
            `StaticLoRAMeta` (CUDA graphs: T padded, updated in place; Triton only), which
            takes the graph-safe launch `lora_expand_static`.
        y: [T, H_out] fp16/bf16/fp32, rows contiguous (the base layer's output);
            the Triton path wants y.dtype == lora_b dtype.
        offsets: first column of each slice in y; None = cumulative widths (then
            H_out must equal sum(H_out_s)).
        add_inputs: True adds to y, False overwrites the slice columns.
        backend: "auto" (triton if y.is_cuda else torch), "torch" or "triton" (on CPU
            only with TRITON_INTERPRET=1).
        ranks: None, or int32 [L, S] on y's device (SlotWeights.ranks_device): columns of
            slot l's lora_b[s] at or past ranks[l, s] are zero (the caller's promise). The
            Triton path reads none of them, nor those columns of buf; the torch path reads all.

    With `meta.no_lora` nothing is launched and y is untouched.
    """
    offsets = check_expand_args(buf, lora_b, meta, y, offsets)
    if isinstance(meta, StaticLoRAMeta):
        assert resolve_backend(backend, y) == "triton", (
            "a StaticLoRAMeta is for the Triton kernels; the torch path takes LoRABatchMeta"
        )
        lora_expand_static(buf, lora_b, meta, y, offsets, add_inputs, ranks=ranks)
        return
    if meta.no_lora:
        return
    if resolve_backend(backend, y) == "triton":
        lora_expand_triton(buf, lora_b, meta, y, offsets, add_inputs, ranks=ranks)
    else:
        lora_expand_torch(buf, lora_b, meta, y, offsets, add_inputs)
