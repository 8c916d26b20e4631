"""Paged attention on the CPU with torch SDPA.

The KV cache of a layer is two tensors [num_blocks * block_size, num_kv_heads, head_dim];
token t of a sequence lives at slot block_table[t // block_size] * block_size + t % block_size.
Reads gather whole blocks (one contiguous block_size x Hkv x D copy each, ~2.4x faster than
gathering token rows). Decode tokens (one query each) are sorted by context length and
batched in a few buckets, one SDPA call per bucket and layer, so short contexts are not
padded to the longest. Under GQA the query heads that share a KV head are folded into the
query-length dimension (q: [B, Hkv, group, D]) so SDPA does a small matmul, not a
matrix-vector product per head. Prefill chunks run one SDPA call each (a chunk attends to
its cached prefix plus itself, causally).

A float32 CPU model with the C++ kernels reads the KV in place instead, one call per layer
for every decode token (`raylora_cpu::paged_decode_attention`, raylora_kernels/csrc/attention_cpu.cpp:
no gather, no padding, no mask) and one for every prefill chunk
(`raylora_cpu::paged_prefill_attention`, raylora_kernels/csrc/prefill_attention_cpu.cpp: causal
flash attention over the chunk's cached prefix and itself): `AttentionMetadata.build(...,
decode_kernel=op, prefill_kernel=op)` then fills `decode_batch` and `prefill_batch` instead of
the buckets and the per-chunk SDPA calls.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MAX_DECODE_BUCKETS = 4


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    start_pos: int  # position of the chunk's first token in its sequence
    block_ids: torch.Tensor | None  # [num_blocks] blocks holding the context; None: no prefix
    mask: torch.Tensor | None  # [num_tokens, ctx] bool; None: plain causal from position 0


@dataclass
class DecodeBucket:
    """Decode tokens of similar context length, one `sdpa_decode_attention` call a layer."""

    rows: torch.Tensor  # [B] rows of these decode tokens in the batch
    tables: torch.Tensor  # [B, max blocks] block tables, padded with block 0
    lens: torch.Tensor  # [B] context lengths, the new token included


@dataclass
class DecodeBatch:
    """Every decode token of the batch, for the C++ kernel (read in place)."""

    op: Callable[..., None]  # raylora_cpu::paged_decode_attention
    rows: torch.Tensor  # [N] int64 rows of these decode tokens in the batch
    tables: torch.Tensor  # [N, max blocks] int32 block tables, padded with block 0
    lens: torch.Tensor  # [N] int32 context lengths, the new token included


@dataclass
class PrefillBatch:
    """Every prefill chunk of the batch, for the C++ kernel (read in place, causal)."""

    op: Callable[..., None]  # raylora_cpu::paged_prefill_attention
    chunks: torch.Tensor  # [C, 3] int64: first row in the batch, tokens, first position
    tables: torch.Tensor  # [C, max blocks] int32 block tables, padded with block 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    block_size: int
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[DecodeBucket] = field(default_factory=list)
    decode_batch: DecodeBatch | None = None
    prefill_batch: PrefillBatch | None = None

    @property
    def has_prefill(self) -> bool:
        return bool(self.prefills) or self.prefill_batch is not None

    @staticmethod
    def build(
        seq_specs: list[tuple[int, int, list[int]]],
        block_size: int,
        device: torch.device,
        decode_kernel: Callable[..., None] | None = None,
        prefill_kernel: Callable[..., None] | None = None,
    ) -> "AttentionMetadata":
        """seq_specs: per scheduled sequence (num_computed_tokens, num_new_tokens, block_table),
        in batch order. decode_kernel / prefill_kernel: the C++ attention
        (cpu_decode_attention_op / cpu_prefill_attention_op) for the decode tokens / the
        prefill chunks, or None for SDPA."""
        slots: list[int] = []
        decodes: list[tuple[int, int, list[int]]] = []  # (row, context length, block table)
        prefills: list[PrefillChunk] = []
        kernel_chunks: list[tuple[int, int, int, list[int]]] = []  # (row, n, start, table)
        row = 0
        for start, n, table in seq_specs:
            slots.extend(
                table[p // block_size] * block_size + p % block_size
                for p in range(start, start + n)
            )
            if n == 1 and start > 0:
                decodes.append((row, start + 1, table))
            elif prefill_kernel is not None:
                kernel_chunks.append((row, n, start, table))
            else:
                block_ids = mask = None
                if start > 0:
                    num_blocks = -(-(start + n) // block_size)
                    block_ids = torch.tensor(table[:num_blocks], device=device)
                    q_pos = torch.arange(start, start + n)[:, None]
                    mask = (torch.arange(start + n)[None, :] <= q_pos).to(device)
                prefills.append(PrefillChunk(row, n, start, block_ids, mask))
            row += n
        md = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), block_size)
        md.prefills = prefills
        if kernel_chunks:
            md.prefill_batch = _prefill_batch(prefill_kernel, kernel_chunks, block_size, device)
        if decode_kernel is not None and decodes:
            md.decode_batch = _decode_batch(decode_kernel, decodes, block_size, device)
        else:
            md.decodes = _decode_buckets(decodes, block_size, device)
        return md


def _decode_batch(
    op: Callable[..., None],
    decodes: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
) -> DecodeBatch:
    width = max(-(-length // block_size) for _, length, _ in decodes)
    return DecodeBatch(
        op=op,
        rows=torch.tensor([r for r, _, _ in decodes], dtype=torch.long, device=device),
        tables=torch.tensor(_padded_tables(decodes, width), dtype=torch.int32, device=device),
        lens=torch.tensor([length for _, length, _ in decodes], dtype=torch.int32, device=device),
    )


def _prefill_batch(
    op: Callable[..., None],
    chunks: list[tuple[int, int, int, list[int]]],
    block_size: int,
    device: torch.device,
) -> PrefillBatch:
    width = max(-(-(start + n) // block_size) for _, n, start, _ in chunks)
    tables = [t[:width] + [0] * (width - min(len(t), width)) for *_, t in chunks]
    return PrefillBatch(
        op=op,
        chunks=torch.tensor([c[:3] for c in chunks], dtype=torch.long, device=device),
        tables=torch.tensor(tables, dtype=torch.int32, device=device),
    )


def _padded_tables(decodes: list[tuple[int, int, list[int]]], width: int) -> list[list[int]]:
    """Each decode's block table cut or padded with block 0 to `width` entries."""
    return [t[:width] + [0] * (width - min(len(t), width)) for _, _, t in decodes]


def _decode_buckets(
    decodes: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> list[DecodeBucket]:
    if not decodes:
        return []
    decodes = sorted(decodes, key=lambda d: d[1])
    num_buckets = min(MAX_DECODE_BUCKETS, max(1, len(decodes) // 8))
    size = -(-len(decodes) // num_buckets)
    buckets = []
    for i in range(0, len(decodes), size):
        group = decodes[i : i + size]
        max_blocks = -(-group[-1][1] // block_size)  # sorted: the last is the longest
        buckets.append(
            DecodeBucket(
                rows=torch.tensor([r for r, _, _ in group], device=device),
                tables=torch.tensor(_padded_tables(group, max_blocks), device=device),
                lens=torch.tensor([length for _, length, _ in group], device=device),
            )
        )
    return buckets


def sdpa_decode_attention(
    q: torch.Tensor,  # [T, H, D]
    rows: torch.Tensor,  # [N] int64 decode rows of q and out
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [N, W] int32 block tables
    lens: torch.Tensor,  # [N] int32 context lengths (<= W * block_size)
    block_size: int,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: rows written
) -> None:
    """The C++ decode kernel's contract (DecodeBatch.op) in torch: every row's W blocks
    gathered, positions past its length masked, one SDPA call. The static decode path's
    fallback where no in-place kernel takes the model (e.g. a bf16 CPU model, head sizes the
    C++ kernel lacks); it reads only tensors, so it is also safe to capture in a graph."""
    n, (num_kv_heads, head_dim), num_heads = rows.numel(), k_cache.shape[1:], q.shape[1]
    ids = tables.reshape(-1).to(torch.long)
    kd = _gather_blocks(k_cache, ids, block_size).view(n, -1, num_kv_heads, head_dim)
    vd = _gather_blocks(v_cache, ids, block_size).view(n, -1, num_kv_heads, head_dim)
    pos = torch.arange(kd.shape[1], device=q.device)
    mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    qd = q.index_select(0, rows).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask, scale=scale
    )
    out.index_copy_(0, rows, o.reshape(n, num_heads, head_dim))


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(block_ids) * block_size, Hkv, D]: the cache rows of these blocks, in order."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])
    return blocks.index_select(0, block_ids).flatten(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    k_cache[md.slot_mapping] = k
    v_cache[md.slot_mapping] = v
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    bs = md.block_size
    for c in md.prefills:
        rows = slice(c.token_start, c.token_start + c.num_tokens)
        qc = q[rows].transpose(0, 1)[None]  # [1, H, n, D]
        if c.block_ids is None:  # the whole context is this chunk: no gather needed
            kc, vc = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            ctx = c.start_pos + c.num_tokens
            kc = _gather_blocks(k_cache, c.block_ids, bs)[:ctx].transpose(0, 1)[None]
            vc = _gather_blocks(v_cache, c.block_ids, bs)[:ctx].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=c.mask, scale=scale, enable_gqa=gqa
            )
        out[rows] = o[0].transpose(0, 1)
    if md.prefill_batch is not None:
        p = md.prefill_batch
        p.op(q, k_cache, v_cache, p.chunks, p.tables, bs, scale, out)
    if md.decode_batch is not None:
        d = md.decode_batch
        d.op(q, d.rows, k_cache, v_cache, d.tables, d.lens, bs, scale, out)
    for b in md.decodes:
        sdpa_decode_attention(q, b.rows, k_cache, v_cache, b.tables, b.lens, bs, scale, out)
    return out
