"""raylora_kernels/paged_attention.py: the Triton decode attention (TRITON_INTERPRET=1) against torch SDPA
over blocks gathered here (an independent route) and the float64 `paged_decode_attention_ref`.

Every cache row that no row's context covers is NaN: the spare blocks that pad the tables
(junk entries past a row's context, and the whole table of a padding row) and the positions
past a row's context inside its last block. A kernel that reads any of them, even to multiply
it by a zero probability, writes NaN and fails.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.attention import AttentionMetadata, paged_attention  # noqa: E402
from raylora_kernels.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    MIN_BLOCKS_PER_SPLIT,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_op,
)
from raylora_kernels.paged_attention_ref import paged_decode_attention_ref  # noqa: E402

pa = importlib.import_module("raylora_kernels.paged_attention")
BS = 16  # cache block size
TOL = {  # (atol, rtol) vs float64; outputs are O(1)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_case(lens, H, Hkv, D, dtype, seed, num_tokens=None, num_blocks=None, width=None):
    """(q [T, H, D], k_cache, v_cache [S, Hkv, D], tables int32 [N, M], lens int32 [N]): each
    row's blocks drawn from a shuffled pool (non-contiguous), the rest of the table junk."""
    gen = torch.Generator().manual_seed(seed)
    need = [cdiv(n, BS) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    width = width or max(1, *need)
    perm = torch.randperm(num_blocks, generator=gen)
    spare = perm[sum(need) :]
    k = torch.randn(num_blocks * BS, Hkv, D, generator=gen)
    v = torch.randn(num_blocks * BS, Hkv, D, generator=gen)
    for b in spare.tolist():
        k[b * BS : (b + 1) * BS] = v[b * BS : (b + 1) * BS] = float("nan")
    tables = spare[torch.randint(len(spare), (len(lens), width), generator=gen)]
    start = 0
    for n, (length, nb) in enumerate(zip(lens, need, strict=True)):
        tables[n, :nb] = perm[start : start + nb]
        start += nb
        if length % BS:  # the last block's positions past the context
            last = int(tables[n, nb - 1]) * BS
            k[last + length % BS : last + BS] = v[last + length % BS : last + BS] = float("nan")
    q = torch.randn(num_tokens or len(lens), H, D, generator=gen)
    to = dict(dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return q.to(**to), k.to(**to), v.to(**to), tables.to(torch.int32), lens_t


def sdpa_decode(q, k_cache, v_cache, tables, lens, scale, rows=None) -> torch.Tensor:
    """[N, H, D] float64: per row, gather its blocks whole, cut to the context, run SDPA."""
    num_heads, (_, num_kv_heads, head_dim) = q.shape[1], k_cache.shape
    out = torch.zeros(len(lens), num_heads, head_dim, dtype=torch.float64)
    kb = k_cache.view(-1, BS, num_kv_heads, head_dim)
    vb = v_cache.view(-1, BS, num_kv_heads, head_dim)
    for n, length in enumerate(lens.tolist()):
        if length == 0:
            continue
        ids = tables[n, : cdiv(length, BS)].long()
        kk = kb[ids].flatten(0, 1)[:length].double().transpose(0, 1)  # [Hkv, L, D]
        vv = vb[ids].flatten(0, 1)[:length].double().transpose(0, 1)
        qq = q[n if rows is None else int(rows[n])].double()[:, None]  # [H, 1, D]
        o = F.scaled_dot_product_attention(
            qq[None], kk[None], vv[None], scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[n] = o[0, :, 0]
    return out


def check(out, q, k, v, tables, lens, scale, rows=None) -> None:
    """out's decode rows equal SDPA and the ref; padding rows are exactly zero."""
    got = out[: len(lens)] if rows is None else out[rows]
    atol, rtol = TOL[q.dtype]
    want = sdpa_decode(q, k, v, tables, lens, scale, rows)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, BS, scale, rows=rows)
    ref = ref[: len(lens)] if rows is None else ref[rows]
    torch.testing.assert_close(got.double(), ref.double(), atol=atol, rtol=rtol)
    pad = lens == 0
    assert torch.equal(got[pad], torch.zeros_like(got[pad])), "padding rows must be zeros"


# (H, Hkv, D, contexts, dtype, num_splits, tile): GQA ratios 1, 3, 4, 8 and 2; contexts at
# the block edges, random ones, 2,048; splits on and off; one tile per block and wider tiles.
CASES = {
    "mha-edges": (8, 8, 64, [1, 15, 16, 17], torch.float32, 1, 16),
    "gqa3-pad": (9, 3, 64, [33, 0, 100, 5, 64], torch.float32, 2, 64),
    "gqa4-random": (8, 2, 64, [251, 77, 140, 3, 190], torch.float32, 4, 32),
    "mqa-2048": (8, 1, 64, [2048, 1], torch.float32, 8, 64),
    "d128-splits3": (4, 2, 128, [47, 130], torch.float32, 3, 64),
    "d32-bf16": (8, 4, 32, [20, 200, 0], torch.bfloat16, 2, 32),
    "fp16": (8, 2, 64, [77, 16], torch.float16, 1, 64),
    "bf16-2048": (8, 2, 64, [2048], torch.bfloat16, 1, 64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_sdpa_and_ref(name):
    H, Hkv, D, lens, dtype, num_splits, tile = CASES[name]
    q, k, v, tables, lens_t = make_case(lens, H, Hkv, D, dtype, seed=len(name))
    scale = D**-0.5
    out = paged_decode_attention(
        q, k, v, tables, lens_t, BS, scale, num_splits=num_splits, tile=tile
    )
    assert out.shape == (len(lens), H, D) and out.dtype == dtype
    check(out, q, k, v, tables, lens_t, scale)


def test_splits_on_and_off_agree():
    lens = [2048, 17, 0, 300]
    q, k, v, tables, lens_t = make_case(lens, 8, 2, 64, torch.float32, seed=1)
    outs = {
        s: paged_decode_attention(q, k, v, tables, lens_t, BS, 0.125, num_splits=s)
        for s in (1, 2, 5, MAX_SPLITS)
    }
    check(outs[1], q, k, v, tables, lens_t, 0.125)
    for s, out in outs.items():  # the same result up to fp32 rounding of the merge
        torch.testing.assert_close(out, outs[1], atol=1e-6, rtol=1e-6, msg=f"splits={s}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_given_writes_only_those_rows(num_splits):
    lens = [0, 30, 16, 1]
    rows = torch.tensor([7, 2, 9, 4])
    q, k, v, tables, lens_t = make_case(lens, 8, 2, 64, torch.float32, seed=2, num_tokens=10)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(
        q, k, v, tables, lens_t, BS, 0.125, out=out, rows=rows, num_splits=num_splits
    )
    assert got is out
    check(out, q, k, v, tables, lens_t, 0.125, rows=rows)
    others = torch.ones(10, dtype=torch.bool)
    others[rows] = False
    assert out[others].isnan().all(), "rows not in `rows` must stay untouched"


class Recorder:
    """Wraps a LazyJit kernel; records each launch's grid and every non-tensor argument."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            scalars = [a for a in args if not isinstance(a, torch.Tensor)]
            self.launches.append((grid, scalars, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_graph_safety_same_launch_other_contexts(monkeypatch):
    """A CUDA graph replays one launch over fixed buffers: same grid and scalars, other
    contexts and tables copied in place must still give the right answer."""
    main, red = Recorder(pa._kernel), Recorder(pa._reduce_kernel)
    monkeypatch.setattr(pa, "_kernel", main)
    monkeypatch.setattr(pa, "_reduce_kernel", red)
    steps = [[1, 128, 0, 37], [100, 0, 17, 128], [0, 0, 0, 0], [128, 128, 64, 2]]
    num_blocks, width = 40, 8  # one cache and one table width for every step
    q0, k, v, tables0, lens0 = make_case(
        steps[0], 8, 2, 64, torch.float32, seed=10, num_blocks=num_blocks, width=width
    )
    q_buf, tables_buf, lens_buf = q0.clone(), tables0.clone(), lens0.clone()
    out_buf = torch.empty_like(q_buf)
    for i, lens in enumerate(steps):
        q, k_i, v_i, tables, lens_t = make_case(
            lens, 8, 2, 64, torch.float32, seed=10 + i, num_blocks=num_blocks, width=width
        )
        k.copy_(k_i), v.copy_(v_i), q_buf.copy_(q), tables_buf.copy_(tables), lens_buf.copy_(lens_t)
        paged_decode_attention(
            q_buf, k, v, tables_buf, lens_buf, BS, 0.125, out=out_buf, num_splits=2
        )
        check(out_buf, q_buf, k, v, tables_buf, lens_buf, 0.125)
    for rec in (main, red):
        assert len(rec.launches) == len(steps)
        assert all(launch == rec.launches[0] for launch in rec.launches), "launch changed"
    assert main.launches[0][0] == (4, 2, 2)  # (N, Hkv, num_splits)


def test_op_plugs_into_engine_decode_batch():
    """With the C++ op's argument order, as engine/attention.py calls `DecodeBatch.op`: a
    mixed batch (prefill chunks and decodes) equals the engine's own SDPA-bucket route."""
    H, Hkv, D = 6, 2, 32
    gen = torch.Generator().manual_seed(3)
    num_blocks = 24
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    # (num_computed_tokens, num_new_tokens, block_table): decodes at block edges, prefills
    specs = [(16, 1, ids[0:2]), (40, 1, ids[2:5]), (0, 5, ids[5:6]), (1, 1, ids[6:7])]
    specs += [(20, 6, ids[7:9]), (95, 1, ids[9:15]), (15, 1, ids[15:16])]
    T = sum(n for _, n, _ in specs)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (H, Hkv, Hkv))
    k_cache = torch.randn(num_blocks * BS, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks * BS, Hkv, D, generator=gen)
    cpu = torch.device("cpu")
    md_op = AttentionMetadata.build(specs, BS, cpu, decode_kernel=paged_decode_attention_op)
    md_sdpa = AttentionMetadata.build(specs, BS, cpu)
    assert md_op.decode_batch is not None and not md_op.decodes
    got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), md_op, 0.2)
    want = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), md_sdpa, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_choose_num_splits():
    assert choose_num_splits(128, 1, 1, num_sms=132) == MAX_SPLITS  # one long row: fill
    assert choose_num_splits(128, 64, 8, num_sms=132) == 1  # 512 programs already fill it
    assert choose_num_splits(3, 1, 1, num_sms=132) == 1  # a short table
    assert choose_num_splits(16, 2, 2, num_sms=132) == 4  # capped by MIN_BLOCKS_PER_SPLIT
    assert choose_num_splits(40, 3, 2, num_sms=132) == 8  # 10 allowed -> power of two
    assert choose_num_splits(2048, 4, 4, num_sms=16) == 2  # 32 SMs' worth over 16 programs
    assert choose_num_splits(2048, 1, 1) == 1  # interpreting (no CUDA here either)
    for max_blocks in (1, 4, 7, 33, 512):
        for programs in (1, 3, 40, 300):
            s = choose_num_splits(max_blocks, programs, 1, num_sms=108)
            assert s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS
            assert s == 1 or s * MIN_BLOCKS_PER_SPLIT <= max_blocks
            assert s == 1 or programs * s // 2 < 2 * 108  # no more than ~2 programs per SM


def test_rejects_bad_arguments():
    q, k, v, tables, lens = make_case([20, 3], 8, 2, 64, torch.float32, seed=4)
    with pytest.raises(AssertionError, match="int32"):
        paged_decode_attention(q, k, v, tables.long(), lens, BS, 0.1)
    with pytest.raises(AssertionError, match="context_lens"):
        paged_decode_attention(q, k, v, tables, lens.long(), BS, 0.1)
    with pytest.raises(AssertionError, match="multiple"):
        paged_decode_attention(q[:, :7], k, v, tables, lens, BS, 0.1)
    with pytest.raises(AssertionError, match="rows"):
        paged_decode_attention(q, k, v, tables, lens, BS, 0.1, rows=torch.tensor([0, 1]).int())
    with pytest.raises(AssertionError, match="dtype"):
        paged_decode_attention(q.half(), k, v, tables, lens, BS, 0.1)
