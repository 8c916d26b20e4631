"""The contract of raylora_kernels/paged_attention.py's `paged_decode_attention` (shapes,
dtypes, devices) and its float64 reference, a plain loop over the Semantics written there:
the tests and the GPU check compare the Triton kernel against it."""

from __future__ import annotations

import torch

from raylora_kernels.utils import DTYPES


def check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """Asserts the contract (shapes, dtypes, devices only: no device values read); returns
    `out` (zeros [N, H, D], or [T, H, D] with `rows`, in q's dtype if None)."""
    assert q.dim() == 3, f"q must be [T, H, D], got shape {tuple(q.shape)}"
    assert q.dtype in DTYPES, f"q dtype {q.dtype} not in {DTYPES}"
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.dim() == 3 and k_cache.shape[2] == head_dim, (
        f"k_cache must be [S, Hkv, D={head_dim}], got {tuple(k_cache.shape)}"
    )
    assert v_cache.shape == k_cache.shape, (
        f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    )
    assert k_cache.dtype == v_cache.dtype == q.dtype, (
        f"cache dtypes {k_cache.dtype}/{v_cache.dtype} != q dtype {q.dtype}"
    )
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, f"H={num_heads} is not a multiple of Hkv={num_kv_heads}"
    assert block_size > 0 and k_cache.shape[0] % block_size == 0, (
        f"cache rows {k_cache.shape[0]} are not whole blocks of {block_size}"
    )
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32, (
        f"block_tables must be int32 [N, M], got {block_tables.dtype} {tuple(block_tables.shape)}"
    )
    n = block_tables.shape[0]
    assert context_lens.shape == (n,) and context_lens.dtype == torch.int32, (
        f"context_lens must be int32 [N={n}], got {context_lens.dtype} {tuple(context_lens.shape)}"
    )
    assert context_lens.is_contiguous(), "context_lens must be contiguous"
    if rows is None:
        assert n <= num_tokens, f"{n} decode rows but q has {num_tokens} rows"
    else:
        assert rows.shape == (n,) and rows.dtype == torch.int64 and rows.is_contiguous(), (
            f"rows must be contiguous int64 [N={n}], got {rows.dtype} {tuple(rows.shape)}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens), ("rows", rows)):  # fmt: skip
        assert t is None or t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    if out is None:
        shape = (num_tokens if rows is not None else n, num_heads, head_dim)
        return torch.zeros(shape, dtype=q.dtype, device=q.device)
    assert out.dim() == 3 and out.shape[1:] == q.shape[1:], (
        f"out must be [*, H={num_heads}, D={head_dim}], got {tuple(out.shape)}"
    )
    assert out.dtype in DTYPES, f"out dtype {out.dtype} not in {DTYPES}"
    assert out.device == q.device, f"out on {out.device}, q on {q.device}"
    if rows is None:
        assert out.shape[0] >= n, f"out has {out.shape[0]} rows, need {n}"
    return out


def paged_decode_attention_ref(
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
) -> torch.Tensor:
    """`paged_decode_attention`'s Semantics as a float64 loop (num_splits is ignored)."""
    out = check_args(q, k_cache, v_cache, block_tables, context_lens, block_size, out, rows)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    for n in range(block_tables.shape[0]):
        r = n if rows is None else int(rows[n])
        length = int(context_lens[n])
        o = torch.zeros(q.shape[1:], dtype=torch.float64)
        if length > 0:
            t = torch.arange(length)
            table = block_tables[n].cpu().long()
            slot = table[t // block_size] * block_size + t % block_size
            k = k_cache.cpu()[slot].double()  # [L, Hkv, D]
            v = v_cache.cpu()[slot].double()
            for h in range(num_heads):
                s = k[:, h // group] @ q[r, h].cpu().double() * scale  # [L]
                o[h] = torch.softmax(s, 0) @ v[:, h // group]
        out[r] = o.to(out.dtype)
    return out
