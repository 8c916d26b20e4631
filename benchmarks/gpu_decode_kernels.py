"""Kernel checks of benchmarks/gpu_decode_check.py: each kernel captured once in a graph
(CudaGraph on CUDA, EagerGraph on the CPU) over fixed buffers, then replayed after other
context lengths, block tables or adapter mixes were written into those buffers, and compared
with the slow references (paged_decode_attention_ref in float64, lora_*_ref in fp32).
A kernel that baked a per-step value into its launch at capture time fails here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.cuda_graphs import CudaGraph, EagerGraph, Graph
from raylora_kernels import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
from raylora_kernels.metadata import StaticLoRAMeta
from raylora_kernels.paged_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from raylora_kernels.paged_attention_ref import paged_decode_attention_ref

if TYPE_CHECKING:
    from benchmarks.gpu_decode_check import Context

# max |out - ref| / max |ref| allowed (LoRA: of the LoRA delta y - y0)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def new_graph(device: torch.device) -> Graph:
    return CudaGraph() if device.type == "cuda" else EagerGraph()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def check_attention(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    contexts: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    seed: int = 0,
) -> tuple[bool, dict]:
    """paged_decode_attention over N = len(contexts[0]) rows: captured with contexts[0] and
    random tables, replayed with each contexts[i] and fresh random tables, for one split and
    for choose_num_splits' count (at least 2: the split-KV reduce too). (ok, figures)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(contexts[0])
    width = -(-max(max(c) for c in contexts) // block_size)
    num_blocks = n * width + 1
    cache = (num_blocks * block_size, kv_heads, head_dim)
    k, v = (torch.randn(cache, generator=gen).to(dtype).to(device) for _ in range(2))
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype).to(device)
    tables = torch.zeros(n, width, dtype=torch.int32, device=device)
    lens = torch.zeros(n, dtype=torch.int32, device=device)
    out = torch.empty(n, heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    k_cpu, v_cpu, q_cpu = k.float().cpu(), v.float().cpu(), q.float().cpu()

    def write(ctxs: Sequence[int]) -> None:  # new contexts and a new random table per row
        perm = torch.randperm(num_blocks, generator=gen)[: n * width].view(n, width)
        tables.copy_(perm.to(torch.int32))
        lens.copy_(torch.tensor(list(ctxs), dtype=torch.int32))

    errors, worst, splits_seen = [], 0.0, []
    for splits in sorted({1, max(2, choose_num_splits(width, n, kv_heads))}):  # both paths
        write(contexts[0])
        graph = new_graph(device)
        graph.capture(
            lambda s=splits: paged_decode_attention(
                q, k, v, tables, lens, block_size, scale, out=out, num_splits=s
            ),
            None,
        )
        splits_seen.append(splits)
        for ctxs in contexts[1:]:
            write(ctxs)
            graph.replay()
            ref = paged_decode_attention_ref(
                q_cpu, k_cpu, v_cpu, tables.cpu(), lens.cpu(), block_size, scale
            )
            err = _rel_err(out, ref)
            worst = max(worst, err)
            errors.append(err)
    detail = {"max_rel_err": worst, "tol": TOL[dtype], "replays": len(errors)}
    return worst <= TOL[dtype], {**detail, "num_splits": splits_seen, "rows": n}


def lora_mixes(num_tokens: int, num_real: int, num_slots: int, seed: int) -> list[list[int]]:
    """Adapter mixes of num_real tokens padded with -1 to num_tokens: distinct (round robin),
    identical, base only, random with base tokens, skewed (one hot slot, one rare)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = torch.randint(-1, num_slots, (num_real,), generator=gen).tolist()
    skewed = [num_slots - 1 if i % 7 == 3 else 0 for i in range(num_real)]
    mixes = [
        [i % num_slots for i in range(num_real)],
        [num_slots // 2] * num_real,
        [-1] * num_real,
        rnd,
        skewed,
    ]
    return [m + [-1] * (num_tokens - num_real) for m in mixes]


def check_static_lora(
    hidden_in: int,
    widths: Sequence[int],
    dtype: torch.dtype,
    num_tokens: int,
    num_slots: int,
    rank: int,
    device: torch.device,
    seed: int = 0,
) -> tuple[bool, dict]:
    """StaticLoRAMeta.update_ + lora_shrink + lora_expand of T = num_tokens tokens, captured
    with the first mix and replayed with every mix of `lora_mixes` written into the same
    slots buffer; the LoRA delta against lora_shrink_ref / lora_expand_ref, and a base-only
    mix must leave y exactly as it was. (ok, figures)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device)

    x = randn(num_tokens, hidden_in)
    lora_a = [randn(num_slots, rank, hidden_in, std=hidden_in**-0.5) for _ in widths]
    lora_b = [randn(num_slots, w, rank, std=rank**-0.5) for w in widths]
    y0 = randn(num_tokens, sum(widths))
    y = torch.empty_like(y0)
    buf = torch.zeros(len(widths), num_tokens, rank, dtype=torch.float32, device=device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
    meta = StaticLoRAMeta.allocate(num_tokens, num_slots, device)

    def forward() -> torch.Tensor:  # everything it reads is a fixed buffer
        meta.update_(slots)
        buf.zero_()
        y.copy_(y0)
        lora_shrink(x, lora_a, meta, out=buf, backend="triton")
        lora_expand(buf, lora_b, meta, y, backend="triton")
        return y

    mixes = lora_mixes(num_tokens, num_tokens - 3, num_slots, seed)
    slots.copy_(torch.tensor(mixes[0], dtype=torch.int32))
    graph = new_graph(device)
    graph.capture(forward, None)
    worst, base_untouched = 0.0, True
    for mix in mixes[1:] + mixes[:1]:
        slots.copy_(torch.tensor(mix, dtype=torch.int32))
        graph.replay()
        token_slots = torch.tensor(mix)
        ref_buf = lora_shrink_ref(x, lora_a, token_slots)
        ref_y = lora_expand_ref(ref_buf, lora_b, token_slots, y0)
        if all(s < 0 for s in mix):
            base_untouched &= bool(torch.equal(y, y0))
            continue
        delta, ref_delta = y.float().cpu() - y0.float().cpu(), ref_y - y0.float().cpu()
        worst = max(worst, _rel_err(delta, ref_delta))
    ok = worst <= TOL[dtype] and base_untouched
    detail = {"max_rel_err": worst, "tol": TOL[dtype], "base_only_untouched": base_untouched}
    return ok, {**detail, "mixes": len(mixes), "tokens": num_tokens, "slots": num_slots}


def part_kernels(part: dict, ctx: Context) -> None:
    """Every attention shape and LoRA layer of the scale, in every dtype."""
    s, report = ctx.scale, ctx.report
    for shape in s.attn_shapes:
        for dtype in s.dtypes:
            name = "paged attention H{}/{} D{} {}".format(*shape, dtype)
            ok, detail = check_attention(
                *shape, getattr(torch, dtype), s.attn_contexts, s.block_size, ctx.device
            )
            report.check(part, name, ok, **detail)
    for hidden_in, widths in s.lora_layers:
        for dtype in s.dtypes:
            name = f"static LoRA shrink+expand {hidden_in}->{list(widths)} {dtype}"
            ok, detail = check_static_lora(
                hidden_in,
                widths,
                getattr(torch, dtype),
                s.lora_tokens,
                s.lora_slots,
                s.rank,
                ctx.device,
            )
            report.check(part, name, ok, **detail)
