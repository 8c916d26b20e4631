"""lora_linear (shrink + expand of one packed linear, fused on the torch path) and
linear_with_lora (the base linear too) against the fp32 references, on every layout their torch
path distinguishes, with the C++ CPU kernel on and off, and through Triton (interpreter)."""

import zlib

import pytest
import torch
import torch.nn.functional as F

from raylora_kernels import (
    LoRABatchMeta,
    SlotWeights,
    base_linear,
    cpu_kernel,
    linear_with_lora,
    lora_expand_ref,
    lora_linear,
    lora_shrink_ref,
)
from raylora_kernels.backends import CPULoRABackend
from raylora_kernels.packed_weight import PackedWeight
from tests.lora_fixtures import cpu_kernel_mode

# Layouts the C++ CPU kernel takes (grouped by slot, up to raylora_kernels/backends/cpu.py's
# _CPU_KERNEL_MAX_TOKENS a slot: prefill segments too); unsorted ones stay on torch ops.
CPU_KERNEL_LAYOUTS = {
    "sorted_uniform",
    "sorted_uniform_one_slot",
    "sorted_uniform_large",
    "sorted_uneven",
    "sorted_prefill_and_decode",
}


L, R = 6, 8  # slot 5 is never used: it holds NaN garbage
WIDTHS = {"qkv": (64, [64, 16, 16]), "o": (64, [64]), "down": (96, [64]), "odd": (40, [24, 12])}


def _weights(widths_key: str, dtype: torch.dtype, gen: torch.Generator) -> SlotWeights:
    hidden_in, widths = WIDTHS[widths_key]
    w = SlotWeights.zeros(L, R, hidden_in, widths, dtype=dtype)
    for a in w.lora_a:  # views of w.a and w.b_t: writing them fills the packed tensors
        a.copy_(torch.randn(a.shape, generator=gen) * hidden_in**-0.5)
    for b in w.lora_b:
        b.copy_(torch.randn(b.shape, generator=gen) * R**-0.5)
    w.lora_b[0][5].fill_(float("nan"))  # an inactive slot's garbage must not leak
    w.lora_a[0][5].fill_(float("nan"))
    return w


def _slots(layout: str, gen: torch.Generator) -> torch.Tensor:
    runs = {
        # (slot, count): grouped by slot as the model runner orders them, base tokens last
        "sorted_uniform": [(0, 3), (2, 3), (4, 3)],
        "sorted_uniform_one_slot": [(1, 7)],
        # 800 x 96 outputs: past _CAT_MAX_ELEMENTS, each slice is added into y on its own
        "sorted_uniform_large": [(0, 400), (3, 400), (-1, 5)],
        "sorted_uneven": [(0, 2), (1, 1), (4, 3), (-1, 4)],
        "sorted_prefill_and_decode": [(0, 40), (2, 1), (3, 1), (-1, 2)],
    }
    if layout in runs:
        return torch.tensor([s for s, n in runs[layout] for _ in range(n)], dtype=torch.int32)
    n = {"shuffled": 23, "shuffled_prefill": 60}[layout]
    slots = torch.randint(-1, L - 1, (n,), generator=gen)
    if layout == "shuffled_prefill":
        slots[torch.randperm(n, generator=gen)[:45]] = 2  # one long segment: no padding
    slots[:3] = torch.tensor([-1, 4, 0])  # unsorted for sure
    return slots.to(torch.int32)


LAYOUTS = [
    "sorted_uniform",
    "sorted_uniform_one_slot",
    "sorted_uniform_large",
    "sorted_uneven",
    "sorted_prefill_and_decode",
    "shuffled",
    "shuffled_prefill",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_kernel", "torch_ops", "triton"])
@pytest.mark.parametrize("widths_key", sorted(WIDTHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_linear_matches_reference(monkeypatch, mode, widths_key, layout):
    calls, backend = None, "triton" if mode == "triton" else "torch"
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        calls = cpu_kernel_mode(monkeypatch, mode)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{widths_key}/{layout}".encode()))
    w = _weights(widths_key, torch.float32, gen)
    slots = _slots(layout, gen)
    meta = LoRABatchMeta.build(slots, L)
    assert meta.tokens_sorted == layout.startswith("sorted")
    x = torch.randn(len(slots), w.a.shape[2], generator=gen)
    y = torch.randn(len(slots), sum(w.widths), generator=gen)
    ref = lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, y)
    base_rows = (slots < 0).nonzero().flatten()
    y0 = y.clone()
    lora_linear(x, y, w, meta, backend=backend)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[base_rows], y0[base_rows])  # base tokens untouched, bit for bit
    if calls is not None:
        assert len(calls) == (layout in CPU_KERNEL_LAYOUTS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("weight_kind", ["plain", "packed"])
@pytest.mark.parametrize("mode", ["cpu_kernel", "torch_ops"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("widths_key", sorted(WIDTHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_with_lora_matches_reference(
    monkeypatch, mode, bias, widths_key, layout, weight_kind
):
    """A plain weight, or a PackedWeight (how the engine holds a float32 CPU model's linears:
    the packed GEMM, or unpacked for torch ops)."""
    cpu_kernel_calls = cpu_kernel_mode(monkeypatch, mode)
    packed = weight_kind == "packed"
    gen = torch.Generator().manual_seed(zlib.crc32(f"{widths_key}/{layout}/{bias}".encode()))
    w = _weights(widths_key, torch.float32, gen)
    slots = _slots(layout, gen)
    meta = LoRABatchMeta.build(slots, L)
    x = torch.randn(len(slots), w.a.shape[2], generator=gen)
    weight = torch.randn(sum(w.widths), w.a.shape[2], generator=gen)
    b = torch.randn(sum(w.widths), generator=gen) if bias else None
    if packed:
        weight, plain = PackedWeight.pack(weight), weight
    base = base_linear(x, weight, b)  # the model's base GEMM (C++ on the CPU where built)
    torch.testing.assert_close(
        base, F.linear(x, plain if packed else weight, b), rtol=1e-5, atol=1e-5
    )
    ref = lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, base.clone())
    # The C++ kernel's batches go straight to it; without it, a batch whose every token has an
    # adapter, in equal runs per slot (decode), takes the addmm path. Neither calls the
    # backend's add_lora after the base GEMM; every other batch goes through it.
    uniform_all = layout in ("sorted_uniform", "sorted_uniform_one_slot")
    assert uniform_all == (meta.uniform and meta.num_lora_tokens == meta.num_tokens)
    kernel = cpu_kernel_calls is not None and layout in CPU_KERNEL_LAYOUTS
    fused = kernel or (uniform_all and cpu_kernel_calls is None and not packed)
    calls = []
    real = CPULoRABackend.add_lora
    monkeypatch.setattr(CPULoRABackend, "add_lora", lambda *a: calls.append(1) or real(*a))
    y = linear_with_lora(x, weight, b, w, meta, backend="torch")
    assert len(calls) == (0 if fused else 1)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    base_rows = (slots < 0).nonzero().flatten()
    assert torch.equal(y[base_rows], base[base_rows])
    if cpu_kernel_calls is not None:  # the base GEMM and the kernel in one call
        op = "cpu_linear_lora_packed_op" if packed else "cpu_linear_lora_op"
        assert cpu_kernel_calls == [op] * (layout in CPU_KERNEL_LAYOUTS)


@pytest.mark.parametrize("mode", ["cpu_kernel", "torch_ops"])
@pytest.mark.parametrize("widths_key", sorted(WIDTHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_weights_under_fp32_activations(monkeypatch, mode, widths_key, layout):
    """lora_dtype="bfloat16" under an fp32 model: the math is fp32 on the bf16 values, so the
    reference is the fp32 one on the same weights widened, to fp32 rounding."""
    calls = cpu_kernel_mode(monkeypatch, mode)
    gen = torch.Generator().manual_seed(zlib.crc32(f"bf16/{widths_key}/{layout}".encode()))
    w = _weights(widths_key, torch.bfloat16, gen)
    wide = SlotWeights(w.a.float(), w.b_t.float(), w.widths)
    slots = _slots(layout, gen)
    x = torch.randn(len(slots), w.a.shape[2], generator=gen)
    y = torch.randn(len(slots), sum(w.widths), generator=gen)
    ref = lora_expand_ref(lora_shrink_ref(x, wide.lora_a, slots), wide.lora_b, slots, y)
    y0 = y.clone()
    out = linear_with_lora(
        x,
        torch.zeros(y.shape[1], x.shape[1]),
        None,
        w,
        LoRABatchMeta.build(slots, L),
        backend="torch",
    )
    lora_linear(x, y, w, LoRABatchMeta.build(slots, L), backend="torch")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref - y0, rtol=1e-5, atol=1e-5)
    base_rows = (slots < 0).nonzero().flatten()
    assert torch.equal(y[base_rows], y0[base_rows])
    if calls is not None:  # linear_with_lora and lora_linear each call it once
        assert calls == ["cpu_linear_lora_op", "cpu_lora_op"] * (layout in CPU_KERNEL_LAYOUTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,widths", [(3, [20]), (3, [20, 7, 7]), (1, [33]), (5, [16, 16])])
def test_cpu_kernel_odd_ranks_and_token_counts(dtype, rank, widths):
    """The kernel's token blocks (up to 4 tokens per pass over a weight row, then the rest)
    at ranks whose S * R is no multiple of 4, every token count a slot can have up to 9,
    hidden sizes and slice widths with a tail past the 16-float vectors."""
    op = cpu_kernel.cpu_lora_op()
    assert op is not None
    gen = torch.Generator().manual_seed(rank * 100 + len(widths))
    hidden_in, num_slots = 37, 4
    w = SlotWeights.zeros(num_slots, rank, hidden_in, widths, dtype=dtype)
    w.a.copy_(torch.randn(w.a.shape, generator=gen))
    w.b_t.copy_(torch.randn(w.b_t.shape, generator=gen))
    wide = SlotWeights(w.a.float(), w.b_t.float(), w.widths)
    slots = torch.tensor([s for s, n in [(0, 1), (1, 2), (2, 9), (3, 6)] for _ in range(n)])
    x = torch.randn(len(slots), hidden_in, generator=gen)
    y = torch.randn(len(slots), sum(widths), generator=gen)
    ref = lora_expand_ref(lora_shrink_ref(x, wide.lora_a, slots), wide.lora_b, slots, y)
    meta = LoRABatchMeta.build(slots.to(torch.int32), num_slots)
    assert meta.tokens_sorted  # the kernel's contract: each slot's tokens one run of rows
    op(x, w.a, w.b_t, meta.segments, w.widths, None, y)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_cpu_kernel_rejects_bad_arguments():
    op = cpu_kernel.cpu_lora_op()
    assert op is not None
    w = SlotWeights.zeros(4, 2, 8, [8, 4])
    x, y = torch.randn(3, 8), torch.zeros(3, 12)
    segments = torch.tensor([[1], [0], [3]])
    op(x, w.a, w.b_t, segments, w.widths, None, y)  # fine: zero weights add nothing
    assert y.eq(0).all()
    with pytest.raises(RuntimeError, match="segment 0 out of range"):
        op(x, w.a, w.b_t, torch.tensor([[4], [0], [3]]), w.widths, None, y)  # slot 4 of 4
    with pytest.raises(RuntimeError, match="segment 0 out of range"):
        op(x, w.a, w.b_t, torch.tensor([[1], [1], [3]]), w.widths, None, y)  # rows 1..3 of 3
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), w.a, w.b_t, segments, w.widths, None, y)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        op(x, w.a.bfloat16(), w.b_t, segments, w.widths, None, y)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        op(x, w.a.half(), w.b_t.half(), segments, w.widths, None, y)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(x, w.a, w.b_t, segments, [8, 3], None, y[:, :11])
    with pytest.raises(RuntimeError, match=r"ranks must be a contiguous int64 CPU tensor \[L=4"):
        op(x, w.a, w.b_t, segments, w.widths, torch.zeros(4, 3, dtype=torch.long), y)
    with pytest.raises(RuntimeError, match=r"ranks must be a contiguous int64"):
        op(x, w.a, w.b_t, segments, w.widths, torch.zeros(4, 2, dtype=torch.int32), y)
    with pytest.raises(RuntimeError, match=r"ranks must lie in \[0, 2\], got 3"):
        op(x, w.a, w.b_t, segments, w.widths, torch.full((4, 2), 3), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_reads_only_each_slices_rank(dtype):
    """With `ranks`, the kernel uses the first ranks[slot, s] rows of slice s and no others: the
    rows past them hold garbage here (the manager keeps them zero), and the result must be the
    reference on the weights cut to those ranks, including slices of rank 0 and a slot that
    has no slice at all. Through both ops."""
    gen = torch.Generator().manual_seed(7)
    widths, rank, hidden_in, num_slots = [24, 8, 8], 5, 40, 4
    w = SlotWeights.zeros(num_slots, rank, hidden_in, widths, dtype=dtype)
    w.a.copy_(torch.randn(w.a.shape, generator=gen))
    w.b_t.copy_(torch.randn(w.b_t.shape, generator=gen))
    ranks = torch.tensor([[5, 5, 5], [2, 0, 2], [0, 0, 0], [1, 4, 0]])
    cut = SlotWeights(w.a.float().clone(), w.b_t.float().clone(), widths)
    for slot, row in enumerate(ranks.tolist()):
        for s, r in enumerate(row):  # zero what the kernel must not read
            cut.lora_a[s][slot, r:] = 0
            cut.lora_b[s][slot, :, r:] = 0
    slots = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    x = torch.randn(len(slots), hidden_in, generator=gen)
    y = torch.randn(len(slots), sum(widths), generator=gen)
    ref = lora_expand_ref(lora_shrink_ref(x, cut.lora_a, slots), cut.lora_b, slots, y.clone())
    assert not torch.allclose(
        ref, lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, y.clone())
    )  # the garbage rows matter: ignoring ranks would fail
    meta = LoRABatchMeta.build(slots.to(torch.int32), num_slots)
    weight = torch.randn(sum(widths), hidden_in, generator=gen)
    out = cpu_kernel.cpu_linear_lora_op()(x, weight, None, w.a, w.b_t, meta.segments, widths, ranks)
    y0 = y.clone()
    cpu_kernel.cpu_lora_op()(x, w.a, w.b_t, meta.segments, widths, ranks, y)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, F.linear(x, weight) + (ref - y0), rtol=1e-5, atol=1e-4)


def test_lora_linear_bf16_and_base_only():
    gen = torch.Generator().manual_seed(0)
    w = _weights("qkv", torch.bfloat16, gen)
    slots = _slots("sorted_uneven", gen)
    x = torch.randn(len(slots), 64, generator=gen).to(torch.bfloat16)
    y = torch.randn(len(slots), 96, generator=gen).to(torch.bfloat16)
    ref = lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, y)
    lora_linear(x, y, w, LoRABatchMeta.build(slots, L), backend="torch")
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    y1 = y.clone()
    lora_linear(x, y, w, LoRABatchMeta.build(torch.full_like(slots, -1), L), backend="torch")
    assert torch.equal(y, y1)


def test_slot_weights_layout():
    w = SlotWeights.zeros(3, 4, 10, [6, 2])
    assert w.a.shape == (3, 8, 10) and w.b_t.shape == (3, 4, 8) and w.rank == 4
    assert [tuple(a.shape) for a in w.lora_a] == [(3, 4, 10)] * 2
    assert [tuple(b.shape) for b in w.lora_b] == [(3, 6, 4), (3, 2, 4)]
    w.lora_a[1][2].fill_(1.0)  # slot 2 of slice 1 = rows 4..7 of a[2]
    assert w.a[2, 4:].eq(1).all() and w.a[2, :4].eq(0).all() and w.a[:2].eq(0).all()
    w.lora_b[1][0].fill_(2.0)  # slot 0 of slice 1 = columns 6..7 of b_t[0]
    assert w.b_t[0, :, 6:].eq(2).all() and w.b_t[0, :, :6].eq(0).all() and w.b_t[1:].eq(0).all()
    with pytest.raises(AssertionError, match="b_t must be"):
        SlotWeights(torch.zeros(3, 8, 10), torch.zeros(3, 4, 7), [6, 2])


def test_meta_slot_runs():
    meta = LoRABatchMeta.build(torch.tensor([4, 0, -1, 1, 3, 0, 4]), 6)
    assert meta.active_slots_list == (0, 1, 3, 4)
    assert meta.active_slot_runs == ((0, 2, 0), (3, 5, 2))  # slots 0-1 and 3-4


@pytest.mark.parametrize("rows", [1, 3, 32, 128, 129])
@pytest.mark.parametrize("out_features,in_features", [(1, 5), (17, 40), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_f_linear(rows, out_features, in_features, bias):
    """raylora_cpu::linear (the decode GEMM split by output columns, <= 128 rows; at::linear
    beyond) against F.linear: x a view with a row stride past its width, one and two threads,
    N not a multiple of the 16-column blocks."""
    op = cpu_kernel.cpu_linear_op()
    assert op is not None
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features + 3, generator=gen)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.testing.assert_close(
                op(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5
            )
    finally:
        torch.set_num_threads(threads)
    # other dtypes go to at::linear
    torch.testing.assert_close(
        op(x.double(), weight.double(), None), F.linear(x.double(), weight.double())
    )
    assert base_linear(x, weight, b).shape == (rows, out_features)


def test_cpu_kernel_build_flags_follow_the_headers(monkeypatch, tmp_path):
    """cpp_extension rebuilds on a changed source or flag, not on a changed header alone: the
    headers' hash is one of the flags, so editing linear_cpu.h rebuilds the kernels."""
    from raylora_kernels import cpu_kernel

    assert any(cpu_kernel._CSRC.glob("*.h"))
    monkeypatch.setattr(cpu_kernel, "_CSRC", tmp_path)
    (tmp_path / "linear_cpu.h").write_text("#pragma once\n")
    before = cpu_kernel._headers_tag()
    assert cpu_kernel._headers_tag() == before
    (tmp_path / "linear_cpu.h").write_text("#pragma once\nint f();\n")
    assert cpu_kernel._headers_tag() != before
