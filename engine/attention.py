"""Paged attention on the CPU with torch SDPA.

The KV cache of a layer is two flat tensors [num_blocks * block_size, num_kv_heads, head_dim];
token t of a sequence lives at block_table[t // block_size] * block_size + t % block_size.
Decode tokens (one query each) are batched into one SDPA call per layer over their gathered,
padded contexts; prefill chunks run one SDPA call each (a chunk attends to its cached prefix
plus itself, causally).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    start_pos: int  # position of the chunk's first token in its sequence
    kv_index: torch.Tensor | None  # [start_pos + num_tokens] flat cache slots; None: no prefix
    mask: torch.Tensor | None  # [num_tokens, ctx] bool; None: plain causal from position 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    decode_rows: torch.Tensor | None = None  # [Bd] rows of decode tokens in the batch
    decode_kv_index: torch.Tensor | None = None  # [Bd, Lmax] flat cache slots (padded with 0)
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Lmax] True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)

    @staticmethod
    def build(
        seq_specs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
    ) -> "AttentionMetadata":
        """seq_specs: per scheduled sequence (num_computed_tokens, num_new_tokens, block_table),
        in batch order."""
        offsets = torch.arange(block_size)
        slot_parts: list[torch.Tensor] = []
        decode_rows: list[int] = []
        decode_specs: list[tuple[int, list[int]]] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for start, n, table in seq_specs:
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_specs.append((start + 1, table))
                p = start
                slot_parts.append(torch.tensor([table[p // block_size] * block_size
                                                + p % block_size]))
            else:
                ctx = (torch.tensor(table)[:, None] * block_size + offsets).flatten()[: start + n]
                slot_parts.append(ctx[start:])
                kv_index = mask = None
                if start > 0:
                    kv_index = ctx.to(device)
                    q_pos = torch.arange(start, start + n)[:, None]
                    mask = (torch.arange(start + n)[None, :] <= q_pos).to(device)
                prefills.append(PrefillChunk(row, n, start, kv_index, mask))
            row += n
        md = AttentionMetadata(torch.cat(slot_parts).to(device))
        md.prefills = prefills
        if decode_rows:
            lens = torch.tensor([length for length, _ in decode_specs])
            max_blocks = max(len(t) for _, t in decode_specs)
            tables = torch.zeros(len(decode_specs), max_blocks, dtype=torch.long)
            for i, (_, t) in enumerate(decode_specs):
                tables[i, : len(t)] = torch.tensor(t)
            lmax = int(lens.max())
            idx = (tables[:, :, None] * block_size + offsets).flatten(1)[:, :lmax]
            md.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            md.decode_kv_index = idx.to(device)
            mask = torch.arange(lmax)[None, :] < lens[:, None]
            md.decode_mask = mask[:, None, None, :].to(device)
        return md


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
    gqa = q.shape[1] != k.shape[1]
    for c in md.prefills:
        rows = slice(c.token_start, c.token_start + c.num_tokens)
        qc = q[rows].transpose(0, 1)[None]  # [1, H, n, D]
        if c.kv_index is None:  # the whole context is this chunk: no gather needed
            kc, vc = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            kc = k_cache[c.kv_index].transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            vc = v_cache[c.kv_index].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale,
                                               enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)
    if md.decode_rows is not None:
        qd = q[md.decode_rows][:, :, None, :]  # [Bd, H, 1, D]
        kd = k_cache[md.decode_kv_index].transpose(1, 2)  # [Bd, Hkv, L, D]
        vd = v_cache[md.decode_kv_index].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md.decode_mask, scale=scale,
                                           enable_gqa=gqa)
        out[md.decode_rows] = o[:, :, 0, :]
    return out
