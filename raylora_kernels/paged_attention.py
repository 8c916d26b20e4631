"""paged_decode_attention: one query token per row against its paged KV cache (Triton).

The CUDA decode path's attention, launched from a CUDA graph: every per-step value (context
lengths, block tables, rows) is read on the device, and the grid is (N, Hkv, num_splits),
fixed by shapes alone, so a replay with other contexts and tables is correct. The KV cache
layout is engine/attention.py's (see Semantics below).

One program per (row, kv head, split) handles all `group` query heads of its KV head, so each
K/V tile is read once for the whole group. The group is padded to BLOCK_G >= 16 rows and both
products are `tl.dot`s ([BLOCK_G, D] x [D, TILE], [BLOCK_G, TILE] x [TILE, D]): tensor cores on
a GPU, bounded registers (a broadcast-multiply q[:, None, :] * k[None] would hold a
BLOCK_G x TILE x D tile), and one numpy matmul per tile under the interpreter. Decode is
memory bound, so the padded query rows (15 of 16 for MHA) cost no bandwidth.

Each iteration takes TILE positions (several cache blocks; each position's block id is read
from the table), so the loop count is context / TILE whatever the cache's block size. With
num_splits > 1 (flash-decoding) each split takes an even share of the row's own tiles (not of
the table width: a short row in a wide, graph-sized table still spreads over every split),
writes its (max, exp-sum, unnormalised acc) partials to a workspace, and a reduce kernel
merges them; a split past the row's context writes (-inf, 0, 0) and contributes nothing.

Only tl builtins inside the kernels (raylora_kernels/utils.py LazyJit caveat): the reductions are
`tl.reduce` with triton's own combine functions, which the interpreter maps to numpy.
"""

from __future__ import annotations

import functools

import torch

from raylora_kernels.paged_attention_ref import check_args
from raylora_kernels.utils import (
    HAS_TRITON,
    LazyJit,
    cdiv,
    dot_in_fp32,
    interpret_mode,
    next_power_of_2,
)

if HAS_TRITON:
    import triton.language as tl

MAX_SPLITS = 16
MIN_BLOCKS_PER_SPLIT = 4  # below this a split's fixed cost (partials, reduce) outweighs it
DEFAULT_TILE = 64  # positions per loop iteration


def _paged_decode_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    out_ptr,  # [T_out, H, D] (NUM_SPLITS == 1)
    tables_ptr,  # [N, M] int32
    lens_ptr,  # [N] int32
    rows_ptr,  # [N] int64 (HAS_ROWS)
    m_ptr,  # [N, H, NUM_SPLITS] fp32 workspace (NUM_SPLITS > 1)
    l_ptr,  # [N, H, NUM_SPLITS] fp32
    acc_ptr,  # [N, H, NUM_SPLITS, D] fp32
    num_heads,
    group,
    head_dim,
    max_blocks,  # M, the table width
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_tn,
    stride_tm,
    scale,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_G: tl.constexpr,  # group padded to a power of two >= 16
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tiles, exact fp32 dot (see utils.dot_in_fp32)
):
    n = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + n)
    row = n.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + n).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group
    mask_d = offs_d < head_dim
    heads = kv * group + offs_g  # [BLOCK_G]
    mask_gd = mask_g[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_gd,
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]; padded heads are zero rows: finite scores, never stored
    if DOT_FP32:
        q = q.to(tl.float32)

    # This split's share of the row's tiles: [tile_begin, tile_end), empty past the context.
    num_tiles = (ctx + TILE - 1) // TILE
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_G,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_G, BLOCK_D), 0.0, dtype=tl.float32)
    table_row = tables_ptr + n.to(tl.int64) * stride_tn
    for t in range(tile_begin, tile_end):
        pos = t * TILE + tl.arange(0, TILE)  # [TILE]
        block = pos // BLOCK_SIZE
        # block < max_blocks: a context longer than the table reads nothing out of bounds
        mask_p = (pos < ctx) & (block < max_blocks)
        block_id = tl.load(table_row + block * stride_tm, mask=mask_p, other=0).to(tl.int64)
        slot = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
        k_t = tl.load(
            k_ptr + kv * stride_kh + offs_d[:, None] * stride_kd + slot[None, :] * stride_kt,
            mask=mask_d[:, None] & mask_p[None, :],
            other=0.0,
        )  # [BLOCK_D, TILE]
        v = tl.load(
            v_ptr + kv * stride_vh + slot[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=mask_p[:, None] & mask_d[None, :],
            other=0.0,
        )  # [TILE, BLOCK_D]
        if DOT_FP32:
            s = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
        else:  # 16-bit tensor-core dot, fp32 accumulate
            s = tl.dot(q, k_t)
        s = tl.where(mask_p[None, :], s * scale, float("-inf"))  # [BLOCK_G, TILE]
        # every tile in range holds a position < ctx, so m_new is finite
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        alpha = tl.exp(m_i - m_new)  # exp(-inf) = 0 on the first tile
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        # ctx == 0 (a padding row): acc = 0 and l = 0, so zeros are written
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = (
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:  # partials, contiguous workspace; every (n, h, split) is written, empty or not
        part = (n.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(m_ptr + part, m_i, mask=mask_g)
        tl.store(l_ptr + part, l_i, mask=mask_g)
        tl.store(acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=mask_gd)


def _paged_decode_reduce_kernel(
    out_ptr,  # [T_out, H, D]
    rows_ptr,  # [N] int64 (HAS_ROWS)
    m_ptr,  # [N, H, NUM_SPLITS] fp32
    l_ptr,  # [N, H, NUM_SPLITS] fp32
    acc_ptr,  # [N, H, NUM_SPLITS, D] fp32
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    stride_od,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    NUM_SPLITS: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    # grid: (N, H); merges one head's split partials (flash-decoding's second pass)
    n = tl.program_id(0)
    h = tl.program_id(1)
    row = n.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + n).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < head_dim
    part = (n.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m_s = tl.load(m_ptr + part, mask=mask_s, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=mask_s, other=0.0)
    acc_s = tl.load(
        acc_ptr + part[:, None] * head_dim + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    m = tl.reduce(m_s, 0, tl.standard._elementwise_max)
    m = tl.where(m > float("-inf"), m, 0.0)  # a padding row: every split empty
    w = tl.exp(m_s - m)  # empty splits: exp(-inf) = 0
    l_sum = tl.reduce(l_s * w, 0, tl.standard._sum_combine)
    acc = tl.reduce(acc_s * w[:, None], 0, tl.standard._sum_combine)  # [BLOCK_D]
    o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(
        out_ptr + row * stride_ot + h * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


_kernel = LazyJit(_paged_decode_kernel)
_reduce_kernel = LazyJit(_paged_decode_reduce_kernel)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    num_splits: int = 1,
    *,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, every per-step value read on the device.

    Semantics (n over the N decode rows, r = rows[n] or n, group = H // Hkv):
        for n, h:                                     # h // group: HF's repeat_kv order
            L = context_lens[n]                       # 0: a padding row, out[r] = 0
            t = arange(L)
            slot = block_tables[n, t // block_size] * block_size + t % block_size
            k, v = k_cache[slot, h // group], v_cache[slot, h // group]   # [L, D]
            out[r, h] = softmax(q[r, h] @ k.T * scale) @ v

    Args:
        q: [T, H, D] fp32/bf16/fp16; rows `rows` (or the first N) are read.
        k_cache, v_cache: [S, Hkv, D], q's dtype, S = num_blocks * block_size.
        block_tables: [N, M] int32; entries past a row's context may hold any valid block id
            (never read). context_lens[n] <= M * block_size.
        context_lens: [N] int32, each row's cached positions, its new token included.
        out: [T_out, H, D]; rows `rows` (or the first N) are written, the others untouched.
            None: zeros [N, H, D] ([T, H, D] with `rows`), q's dtype.
        rows: [N] int64 rows of q and out, or None.
        num_splits: split-KV factor (flash-decoding), e.g. from `choose_num_splits`; a
            compile-time constant: the grid is (N, Hkv, num_splits) whatever the contexts.
        tile: positions per loop iteration (a power of two >= 16).
    """
    out = check_args(q, k_cache, v_cache, block_tables, context_lens, block_size, out, rows)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    assert tile >= 16 and tile & (tile - 1) == 0, f"tile must be a power of two >= 16, got {tile}"
    num_rows, max_blocks = block_tables.shape
    if num_rows == 0:
        return out
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    has_rows = rows is not None
    rows_arg = rows if has_rows else context_lens  # never read without HAS_ROWS
    if num_splits > 1:
        shape = (num_rows, num_heads, num_splits)
        m_ws = torch.empty(shape, dtype=torch.float32, device=q.device)
        l_ws = torch.empty(shape, dtype=torch.float32, device=q.device)
        acc_ws = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
    else:
        m_ws = l_ws = acc_ws = context_lens  # never read with NUM_SPLITS == 1
    block_d = max(16, next_power_of_2(head_dim))
    _kernel[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, block_tables, context_lens, rows_arg, m_ws, l_ws, acc_ws,
        num_heads, group, head_dim, max_blocks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_tables.stride(),
        scale,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        TILE=tile,
        NUM_SPLITS=num_splits,
        HAS_ROWS=has_rows,
        DOT_FP32=dot_in_fp32(q.dtype),
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(num_rows, num_heads)](
            out, rows_arg, m_ws, l_ws, acc_ws, num_heads, head_dim, *out.stride(),
            BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits),
            NUM_SPLITS=num_splits,
            HAS_ROWS=has_rows,
        )  # fmt: skip
    return out


def paged_decode_attention_op(
    q: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """`raylora_cpu::paged_decode_attention`'s signature (raylora_kernels/csrc/attention_cpu.h), for
    engine/attention.py's `DecodeBatch.op`: out[rows] = the attention of q[rows]. rows, tables
    and lens must be on q's device. The split count follows the shapes (choose_num_splits)."""
    num_splits = choose_num_splits(tables.shape[1], tables.shape[0], k_cache.shape[1])
    paged_decode_attention(
        q, k_cache, v_cache, tables, lens, block_size, scale, out, rows, num_splits
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    max_blocks: int, num_rows: int, num_kv_heads: int, num_sms: int | None = None
) -> int:
    """Split-KV factor for a (num_rows x num_kv_heads) launch over tables of max_blocks blocks:
    enough splits to put ~2 programs on every SM, each split at least MIN_BLOCKS_PER_SPLIT
    blocks, at most MAX_SPLITS, rounded down to a power of two (few compiled variants). A pure
    function of its arguments; num_sms None: the current CUDA device's, and 1 when
    interpreting or without CUDA (the interpreter runs programs one by one)."""
    if num_sms is None:
        if interpret_mode() or not torch.cuda.is_available():
            return 1
        num_sms = _num_sms(torch.cuda.current_device())
    programs = max(1, num_rows * num_kv_heads)
    want = min(cdiv(2 * num_sms, programs), max_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    return 1 << (max(1, want).bit_length() - 1)
