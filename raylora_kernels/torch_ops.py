"""Torch implementations of lora_shrink / lora_expand (the CPU path) and the fp32 references.

The fast ops pick a strategy per call with a small cost model (constants measured on
CPU, see benchmarks/lora_kernels.py):

- shrink "dense": one GEMM of the adapter tokens against all L slots of a slice
  (`lora_a[s].view(L * R, H_in)`, no weight copy), then keep each token's own R
  columns. Launch count is independent of the number of adapters; it wastes
  (L - 1) / L of the FLOPs, so it is used while that waste is small (decode).
- "segments": loop over active slots; each slot's tokens are gathered, multiplied
  by that slot's weights and scattered back. FLOP-exact, ~3 ops per (slot, slice).
- expand "gather": copies each token's [H_out_s, R] weight and runs one bmm per
  slice. No loop over slots; costs a copy of num_tokens x H_out x R weights, so
  it wins only when there are few tokens per slot (decode with many adapters).
  (A dense expand would multiply zeros by the weights of inactive slots, which may
  hold NaN garbage, so it is not offered.)
- "sgmv" (shrink and expand): the tokens of each active slot padded into one row of a
  [A, max_tokens_per_slot] layout, then ONE bmm per slice against the active slots'
  weights (no copy when every slot is active). FLOP-exact up to the padding and a
  constant ~3 ops per slice; the default whenever the padding is small (decode with
  many adapters, balanced prefill).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raylora_kernels.metadata import LoRABatchMeta

# Cost model: one small torch op costs about as much as this many multiply-adds
# (shrink) or element copies (expand gather). ~10 us at ~20 GMAC/s on a CPU core.
_MACS_PER_OP = 200_000
_COPIES_PER_OP = 20_000


def _sgmv_fits(meta: LoRABatchMeta) -> bool:
    # padding rows cost as much as real ones: allow at most ~2x the real tokens
    padded = meta.num_active_slots * meta.max_tokens_per_slot
    return meta.num_active_slots > 1 and padded <= 2 * meta.num_lora_tokens + 16


def shrink_strategy(
    meta: LoRABatchMeta, num_slices: int, num_slots: int, rank: int, hidden_in: int
) -> str:
    if _sgmv_fits(meta):
        return "sgmv"
    # dense multiplies every token by all L slots: (L - 1) / L of its MACs are wasted
    wasted_macs = meta.num_lora_tokens * (num_slots - 1) * rank * hidden_in
    saved_ops = meta.num_active_slots * num_slices  # launches of the segment loop
    return "dense" if wasted_macs <= saved_ops * _MACS_PER_OP else "segments"


def expand_strategy(meta: LoRABatchMeta, num_slices: int, rank: int, hidden_out: int) -> str:
    if _sgmv_fits(meta):
        return "sgmv"
    copies = meta.num_lora_tokens * rank * hidden_out
    return "gather" if copies <= meta.num_active_slots * num_slices * _COPIES_PER_OP else "segments"


def lora_shrink_torch(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRABatchMeta,
    scale: float,
    out: torch.Tensor,
    strategy: str | None = None,
) -> torch.Tensor:
    """Torch path of `raylora_kernels.lora_shrink` (arguments already checked)."""
    if meta.no_lora:
        return out
    num_slots, rank, hidden_in = lora_a[0].shape
    strategy = strategy or shrink_strategy(meta, len(lora_a), num_slots, rank, hidden_in)
    all_tokens = meta.num_lora_tokens == meta.num_tokens  # then a lone segment is in order
    if strategy == "sgmv":
        xs = x.index_select(0, meta.padded_token_ids.flatten()).view(
            meta.num_active_slots, meta.max_tokens_per_slot, hidden_in
        )  # [A, n, H_in]
        for s, a in enumerate(lora_a):
            w = _active_weights(a, meta)  # [A, R, H_in]
            r = torch.bmm(xs.to(w.dtype), w.transpose(1, 2)).view(-1, rank)  # [A * n, R]
            out[s].index_copy_(
                0,
                meta.lora_token_ids,
                _scaled(r.index_select(0, meta.padded_rows), scale, out.dtype),
            )
        return out
    if strategy == "dense":
        ids = meta.lora_token_ids
        xs = x if all_tokens and meta.num_active_slots == 1 else x.index_select(0, ids)
        rows = torch.arange(meta.num_lora_tokens, device=x.device)
        for s, a in enumerate(lora_a):
            full = (xs @ a.reshape(num_slots * rank, hidden_in).T).view(-1, num_slots, rank)
            mine = full[rows, meta.lora_token_slots]  # [n, R]: each token's own slot
            out[s].index_copy_(0, ids, _scaled(mine, scale, out.dtype))
        return out
    assert strategy == "segments", f"unknown shrink strategy {strategy!r}"
    for slot, start, n in _segments(meta):
        if all_tokens and n == meta.num_tokens:  # one slot owns every token: no gather
            for s, a in enumerate(lora_a):
                out[s].copy_(_scaled(x @ a[slot].T, scale, out.dtype))
            continue
        ids = meta.lora_token_ids[start : start + n]
        xs = x.index_select(0, ids)
        for s, a in enumerate(lora_a):
            out[s].index_copy_(0, ids, _scaled(xs @ a[slot].T, scale, out.dtype))
    return out


def lora_expand_torch(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRABatchMeta,
    y: torch.Tensor,
    offsets: Sequence[int],
    add_inputs: bool,
    strategy: str | None = None,
) -> None:
    """Torch path of `raylora_kernels.lora_expand` (arguments already checked)."""
    if meta.no_lora:
        return
    rank = buf.shape[2]
    hidden_out = sum(b.shape[1] for b in lora_b)
    strategy = strategy or expand_strategy(meta, len(lora_b), rank, hidden_out)
    wdtype = lora_b[0].dtype
    all_tokens = meta.num_lora_tokens == meta.num_tokens
    if strategy == "sgmv":
        num_active, max_n = meta.num_active_slots, meta.max_tokens_per_slot
        bufs = buf.index_select(1, meta.padded_token_ids.flatten()).to(wdtype)  # [S, A*n, R]
        for s, b in enumerate(lora_b):
            w = _active_weights(b, meta)  # [A, H_out_s, R]
            d = torch.bmm(bufs[s].view(num_active, max_n, rank), w.transpose(1, 2))
            delta = d.view(-1, b.shape[1]).index_select(0, meta.padded_rows)  # [n, H_out_s]
            _scatter(
                y[:, offsets[s] : offsets[s] + b.shape[1]], meta.lora_token_ids, delta, add_inputs
            )
        return
    if strategy == "gather":
        ids = meta.lora_token_ids
        bufs = buf.index_select(1, ids).to(wdtype).unsqueeze(3)  # [S, n, R, 1]
        for s, b in enumerate(lora_b):
            w = b.index_select(0, meta.lora_token_slots)  # [n, H_out_s, R]
            delta = torch.bmm(w, bufs[s]).squeeze(2)  # [n, H_out_s]
            _scatter(y[:, offsets[s] : offsets[s] + b.shape[1]], ids, delta, add_inputs)
        return
    assert strategy == "segments", f"unknown expand strategy {strategy!r}"
    for slot, start, n in _segments(meta):
        if all_tokens and n == meta.num_tokens:  # one slot owns every token: no gather
            for s, b in enumerate(lora_b):
                cols = y[:, offsets[s] : offsets[s] + b.shape[1]]
                delta = buf[s].to(wdtype) @ b[slot].T
                cols.add_(delta) if add_inputs else cols.copy_(delta)
            continue
        ids = meta.lora_token_ids[start : start + n]
        bufs = buf.index_select(1, ids).to(wdtype)  # [S, n, R]
        for s, b in enumerate(lora_b):
            delta = bufs[s] @ b[slot].T  # [n, H_out_s]
            _scatter(y[:, offsets[s] : offsets[s] + b.shape[1]], ids, delta, add_inputs)


def _active_weights(w: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
    """w[active slots]; w itself (no copy) when every slot is active, in order."""
    if meta.num_active_slots == w.shape[0]:
        return w  # active_slots is ascending and distinct, so it is exactly 0..L-1
    return w.index_select(0, meta.active_slots_long)


def _segments(meta: LoRABatchMeta) -> zip:
    return zip(
        meta.active_slots_list, meta.slot_starts_list, meta.num_tokens_per_slot_list, strict=True
    )


def _scaled(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    t = t.to(dtype)
    return t if scale == 1.0 else t * scale


def _scatter(cols: torch.Tensor, ids: torch.Tensor, delta: torch.Tensor, add: bool) -> None:
    # cols is a column slice of y: index_add_ on such a strided view is ~50x slower on
    # CPU than gather + add + index_copy_ (ids are unique, so this is equivalent).
    delta = delta.to(cols.dtype)
    if add:
        delta = cols.index_select(0, ids).add_(delta)
    cols.index_copy_(0, ids, delta)


# ---- references: slow, obviously correct, fp32; for tests only ----


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    token_slots: torch.Tensor,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s, t] = scale * x[t] @ lora_a[s][slot(t)].T for slot(t) >= 0, in fp32.

    Rows of tokens with slot -1 are copied from `out` (zeros if None). Returns a
    new fp32 tensor [S, T, R].
    """
    num_tokens = x.shape[0]
    rank = lora_a[0].shape[1]
    ref = torch.zeros(len(lora_a), num_tokens, rank, dtype=torch.float32)
    if out is not None:
        ref.copy_(out.float().cpu())
    xf = x.float().cpu()
    for s, a in enumerate(lora_a):
        af = a.float().cpu()
        for t in range(num_tokens):
            slot = int(token_slots[t])
            if slot >= 0:
                ref[s, t] = scale * (af[slot] @ xf[t])
    return ref


def lora_expand_ref(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    token_slots: torch.Tensor,
    y: torch.Tensor,
    offsets: Sequence[int] | None = None,
    add_inputs: bool = True,
) -> torch.Tensor:
    """y[t, cols_s] (+)= buf[s, t] @ lora_b[s][slot(t)].T for slot(t) >= 0, in fp32.

    Returns a new fp32 tensor [T, H_out]; rows of tokens with slot -1 equal y's.
    """
    widths = [b.shape[1] for b in lora_b]
    if offsets is None:
        offsets = [sum(widths[:s]) for s in range(len(lora_b))]
    ref = y.float().cpu().clone()
    buff = buf.float().cpu()
    for s, b in enumerate(lora_b):
        bf = b.float().cpu()
        cols = slice(offsets[s], offsets[s] + widths[s])
        for t in range(y.shape[0]):
            slot = int(token_slots[t])
            if slot >= 0:
                delta = bf[slot] @ buff[s, t]
                ref[t, cols] = ref[t, cols] + delta if add_inputs else delta
    return ref
