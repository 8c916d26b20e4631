"""lora_shrink: x @ A^T for every token with its own adapter slot (punica SGMV shrink)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raylora_kernels.metadata import LoRABatchMeta, StaticLoRAMeta, static_device_table
from raylora_kernels.torch_ops import lora_shrink_torch
from raylora_kernels.utils import (
    HAS_TRITON,
    LazyJit,
    cdiv,
    check_shrink_args,
    device_table,
    dot_in_fp32,
    interpret_mode,
    next_power_of_2,
    resolve_backend,
)

if HAS_TRITON:
    import triton.language as tl


def _lora_shrink_kernel(
    x_ptr,
    a_ptrs,  # [S] int64: data_ptr of each slice's [L, R, H_in] weights
    out_ptr,
    sorted_token_ids,  # [T] int32
    num_tokens_per_slot,  # [A] int32
    slot_starts,  # [A] int32
    active_slots,  # [A] int32
    slot_ranks,  # [L, S] int32: rows of each slot's slices that hold weights (HAS_RANKS)
    N,  # R
    K,  # H_in
    stride_xt,
    stride_xk,
    stride_al,  # the weight strides are the same for every slice
    stride_an,
    stride_ak,
    stride_os,
    stride_ot,
    stride_on,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tiles, exact fp32 dot (see utils.dot_in_fp32)
    HAS_RANKS: tl.constexpr,
):
    # grid: (m tiles x n tiles x SPLIT_K, slices, active slots)
    pid = tl.program_id(0)
    slice_id = tl.program_id(1)
    seg = tl.program_id(2)
    pid_sk = pid % SPLIT_K
    pid_mn = pid // SPLIT_K
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n

    seg_len = tl.load(num_tokens_per_slot + seg)
    if pid_m * BLOCK_M >= seg_len:  # this slot has fewer tokens than the longest one
        return
    seg_start = tl.load(slot_starts + seg)
    slot = tl.load(active_slots + seg).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tok = tl.load(sorted_token_ids + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    out_ptrs = (
        out_ptr + slice_id * stride_os + tok[:, None] * stride_ot + offs_n[None, :] * stride_on
    )
    mask = mask_m[:, None] & mask_n[None, :]
    rank = N
    if HAS_RANKS:  # rows past the adapter's rank are zero: write zeros, read no weights
        rank = tl.load(slot_ranks + slot * tl.num_programs(1) + slice_id)
        if pid_n * BLOCK_N >= rank:
            if SPLIT_K == 1:  # (split-K: the host zeroed these rows)
                zeros = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
                tl.store(out_ptrs, zeros.to(out_ptr.dtype.element_ty), mask=mask)
            return
    mask_r = offs_n < rank

    a_ptr = tl.load(a_ptrs + slice_id).to(tl.pointer_type(x_ptr.dtype.element_ty))
    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    a_cols = a_ptr + slot * stride_al + offs_n[None, :] * stride_an  # [1, BLOCK_N]

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # tl.zeros is a std-lib @jit
    for k in range(pid_sk * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(
            x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        at = tl.load(
            a_cols + offs_k[:, None] * stride_ak, mask=mask_k[:, None] & mask_r[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:  # 16-bit tensor-core dot, fp32 accumulate
            acc += tl.dot(xt, at)
    acc *= scale

    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partial sums over K; the host zeroed these rows
        tl.atomic_add(out_ptrs, acc, mask=mask)


_kernel = LazyJit(_lora_shrink_kernel)


def _config(
    meta: LoRABatchMeta, num_slices: int, rank: int, hidden_in: int, dtype: torch.dtype, device
) -> dict:
    block_m = min(64, max(16, next_power_of_2(meta.max_tokens_per_slot)))
    block_n = min(64, max(16, next_power_of_2(rank)))
    # Shared memory per stage: (BLOCK_M + BLOCK_N) * BLOCK_K elements; keep it <= 48 KB.
    block_k = 256 if block_m <= 32 else 128
    if dot_in_fp32(dtype):
        block_k //= 2
    num_k = cdiv(hidden_in, block_k)
    split_k = 1
    if not interpret_mode():  # fill the GPU when there are few tokens (decode): split K
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = (
            cdiv(meta.max_tokens_per_slot, block_m)
            * cdiv(rank, block_n)
            * num_slices
            * meta.num_active_slots
        )
        split_k = max(1, min(num_k, 32, next_power_of_2(2 * num_sms // max(1, programs))))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k)


def _static_config(
    num_tokens: int,
    num_slots: int,
    num_slices: int,
    rank: int,
    hidden_in: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    device,
) -> dict:
    """Config of the graph-safe launch: a function of the capture shape only, never of the
    adapter mix (a graph replays it for every mix). Tiles sized for an even mix, T / L tokens a
    slot. Split-K when few tiles would fill the GPU and out is fp32 (atomics need it)."""
    block_m = min(64, max(16, next_power_of_2(cdiv(num_tokens, num_slots))))
    block_n = min(64, max(16, next_power_of_2(rank)))
    block_k = 256 if block_m <= 32 else 128
    if dot_in_fp32(dtype):
        block_k //= 2
    split_k = 1
    if not interpret_mode() and out_dtype == torch.float32:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # tiles with work: about cdiv(T, BLOCK_M) m tiles over all slots together
        programs = cdiv(num_tokens, block_m) * cdiv(rank, block_n) * num_slices
        num_k = cdiv(hidden_in, block_k)
        split_k = max(1, min(num_k, 32, next_power_of_2(2 * num_sms // max(1, programs))))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k)


def _launch(
    grid: tuple[int, int, int],
    cfg: dict,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    a_ptrs: torch.Tensor,
    meta: LoRABatchMeta | StaticLoRAMeta,
    scale: float,
    out: torch.Tensor,
    ranks: torch.Tensor | None,
) -> None:
    a0 = lora_a[0]
    _kernel[grid](
        x,
        a_ptrs,
        out,
        meta.sorted_token_ids,
        meta.num_tokens_per_slot,
        meta.slot_starts,
        meta.active_slots,
        meta.active_slots if ranks is None else ranks,  # (unread without ranks)
        a0.shape[1],
        a0.shape[2],
        x.stride(0),
        x.stride(1),
        a0.stride(0),
        a0.stride(1),
        a0.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        float(scale),
        DOT_FP32=dot_in_fp32(x.dtype),
        HAS_RANKS=ranks is not None,
        **cfg,
    )


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRABatchMeta,
    scale: float,
    out: torch.Tensor,
    config: dict | None = None,
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton path of `lora_shrink` (arguments already checked). `config` overrides
    BLOCK_M / BLOCK_N / BLOCK_K / SPLIT_K (tests use it to cover every code path)."""
    if meta.no_lora:
        return out
    num_slots, rank, hidden_in = lora_a[0].shape
    cfg = _config(meta, len(lora_a), rank, hidden_in, x.dtype, x.device)
    cfg.update(config or {})
    if cfg["SPLIT_K"] > 1:
        assert out.dtype == torch.float32, "SPLIT_K > 1 accumulates with atomics: out must be fp32"
        # Zero only the rows we own: rows of no-adapter tokens stay untouched.
        if meta.num_lora_tokens == meta.num_tokens:
            out.zero_()
        else:
            out.index_fill_(1, meta.lora_token_ids, 0.0)
    a_ptrs = device_table([[a.data_ptr() for a in lora_a]], x.device)[0]
    grid = (
        cdiv(meta.max_tokens_per_slot, cfg["BLOCK_M"])
        * cdiv(rank, cfg["BLOCK_N"])
        * cfg["SPLIT_K"],
        len(lora_a),
        meta.num_active_slots,
    )
    _launch(grid, cfg, x, lora_a, a_ptrs, meta, scale, out, ranks)
    return out


def lora_shrink_static(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: StaticLoRAMeta,
    scale: float,
    out: torch.Tensor,
    config: dict | None = None,
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Graph-safe Triton path of `lora_shrink` (arguments already checked): the same kernel
    over a fixed grid, (cdiv(T, BLOCK_M) * n tiles * SPLIT_K, S, L), every program reading its
    slot's token count and start on the device and exiting when it has no tokens there. No
    host sync, no per-step host values: one capture serves every adapter mix of T tokens.
    Split-K zeroes the adapter tokens' rows with a device mask (meta.lora_token_mask), so rows
    of other tokens stay untouched here too. `config` overrides the tiles (tests)."""
    num_slots, rank, hidden_in = lora_a[0].shape
    assert num_slots == meta.max_loras, f"lora_a has {num_slots} slots, meta {meta.max_loras}"
    cfg = _static_config(
        meta.num_tokens, num_slots, len(lora_a), rank, hidden_in, x.dtype, out.dtype, x.device
    )
    cfg.update(config or {})
    if cfg["SPLIT_K"] > 1:
        assert out.dtype == torch.float32, "SPLIT_K > 1 accumulates with atomics: out must be fp32"
        out.masked_fill_(meta.lora_token_mask.view(1, -1, 1), 0.0)
    a_ptrs = static_device_table([[a.data_ptr() for a in lora_a]], x.device)[0]
    grid = (
        cdiv(meta.num_tokens, cfg["BLOCK_M"]) * cdiv(rank, cfg["BLOCK_N"]) * cfg["SPLIT_K"],
        len(lora_a),
        num_slots,
    )
    _launch(grid, cfg, x, lora_a, a_ptrs, meta, scale, out, ranks)
    return out


def lora_shrink(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRABatchMeta | StaticLoRAMeta,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Project each token onto its adapter's A (the LoRA "shrink"), several slices at once.

    Semantics:
        for s in range(S):
            for t in range(T):
                if meta.token_slots[t] >= 0:
                    out[s, t, :] = scale * x[t, :] @ lora_a[s][meta.token_slots[t]].T
        # rows of tokens with slot -1 are left exactly as they were

    Args:
        x: [T, H_in] fp16/bf16/fp32, rows contiguous.
        lora_a: S tensors (1 to 3 slices: e.g. q, k, v), each [L, R, H_in], all with the
            same strides (contiguous, or views of one packed tensor: SlotWeights.lora_a),
            same dtype as x; L = number of slots, R = max rank (zero-padded).
        meta: `LoRABatchMeta.build(token_slots, L)`, built once per step; or a
            `StaticLoRAMeta` (CUDA graphs: T padded, updated in place; Triton only), which
            takes the graph-safe launch `lora_shrink_static`.
        scale: global factor (per-adapter alpha / r is folded into lora_b).
        out: [S, T, R], contiguous; fp32 recommended (the Triton split-K path needs
            it). None allocates fp32 zeros.
        backend: "auto" (triton if x.is_cuda else torch), "torch" or "triton" (on CPU
            only with TRITON_INTERPRET=1).
        ranks: None, or int32 [L, S] on x's device (SlotWeights.ranks_device): rows of slot
            l's slice s at or past ranks[l, s] are zero (the caller's promise). The Triton
            path reads none of them and writes zeros there; the torch path reads them all.

    Returns `out`. With `meta.no_lora` nothing is launched.
    """
    out = check_shrink_args(x, lora_a, meta, out)
    if isinstance(meta, StaticLoRAMeta):
        assert resolve_backend(backend, x) == "triton", (
            "a StaticLoRAMeta is for the Triton kernels; the torch path takes LoRABatchMeta"
        )
        return lora_shrink_static(x, lora_a, meta, scale, out, ranks=ranks)
    if meta.no_lora:
        return out
    if resolve_backend(backend, x) == "triton":
        return lora_shrink_triton(x, lora_a, meta, scale, out, ranks=ranks)
    return lora_shrink_torch(x, lora_a, meta, scale, out)
