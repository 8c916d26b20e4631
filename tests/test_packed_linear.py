"""The packed-weight CPU GEMM (raylora_kernels/csrc/packed_cpu.cpp, raylora_kernels/packed_weight.py) against
F.linear, its batch invariance, its LoRA op, its errors, and the engine's packed model."""

import pytest
import torch
import torch.nn.functional as F

from raylora_kernels import LoRABatchMeta, SlotWeights, base_linear, cpu_kernel
from raylora_kernels.packed_weight import PANEL, PackedWeight


def _op():
    op = cpu_kernel.cpu_linear_packed_op()
    assert op is not None, "the C++ CPU kernels did not build (see the logged warning)"
    return op


@pytest.mark.parametrize("out_features", [1, 47, 48, 49, 100, 960])
@pytest.mark.parametrize("in_features", [1, 37, 576])
def test_pack_unpack_round_trip(out_features, in_features):
    weight = torch.randn(out_features, in_features)
    pw = PackedWeight.pack(weight)
    assert pw.data.shape == (-(-out_features // PANEL), in_features, PANEL)
    assert pw.shape == weight.shape and pw.in_features == in_features
    assert torch.equal(pw.unpack(), weight)
    assert not pw.data[-1, :, out_features - (pw.data.shape[0] - 1) * PANEL :].any()  # padding
    ids = torch.tensor([0, out_features - 1, out_features // 2, 0], dtype=torch.int32)
    assert torch.equal(pw.rows(ids), weight[ids.long()])  # a tied embedding's lookup


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 129, 300])
@pytest.mark.parametrize("out_features,in_features", [(1, 5), (50, 37), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_packed_matches_f_linear(rows, out_features, in_features, bias):
    """Any row count (tiles of 8 tokens and every remainder), N past a whole panel, odd K, x a
    view with a row stride past its width, one and two threads. Against float64: each sum runs
    over k in order in float32 (about 1e-6 relative at K=576; BLAS blocks its sums)."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features + 3, generator=gen)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    pw = PackedWeight.pack(weight)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = _op()(x, pw.data, out_features, b)
            ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
            torch.testing.assert_close(y, ref.float(), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(base_linear(x, pw, b), y)  # what the model calls
    assert _op()(x[:0], pw.data, out_features, b).shape == (0, out_features)


def test_linear_packed_is_batch_invariant():
    """A token's output is the same bits alone, at any place in any batch, on any thread
    count: each sum runs over k in order (BLAS gives no such promise)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=gen)
    pw = PackedWeight.pack(weight)
    x = torch.randn(21, 96, generator=gen)
    alone = torch.cat([_op()(x[i : i + 1], pw.data, 200, None) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(_op()(x, pw.data, 200, None), alone)
            perm = torch.randperm(len(x), generator=gen)
            assert torch.equal(_op()(x[perm], pw.data, 200, None), alone[perm])
    finally:
        torch.set_num_threads(threads)


def test_linear_lora_packed_matches_plain_linear_lora():
    """The packed linear's LoRA op against the plain one; base tokens' rows equal
    linear_packed's bit for bit."""
    gen = torch.Generator().manual_seed(1)
    widths, hidden = [64, 16, 16], 64
    w = SlotWeights.zeros(4, 8, hidden, widths)
    w.a.copy_(torch.randn(w.a.shape, generator=gen) * 0.1)
    w.b_t.copy_(torch.randn(w.b_t.shape, generator=gen) * 0.1)
    slots = torch.tensor([0, 0, 2, 2, 2, 3, -1, -1], dtype=torch.int32)  # grouped by slot
    meta = LoRABatchMeta.build(slots, 4)
    assert meta.tokens_sorted
    x = torch.randn(len(slots), hidden, generator=gen)
    weight = torch.randn(sum(widths), hidden, generator=gen)
    bias = torch.randn(sum(widths), generator=gen)
    pw = PackedWeight.pack(weight)
    args = (w.a, w.b_t, meta.segments, widths, None)
    ours = cpu_kernel.cpu_linear_lora_packed_op()(x, pw.data, sum(widths), bias, *args)
    ref = cpu_kernel.cpu_linear_lora_op()(x, weight, bias, *args)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    base = _op()(x, pw.data, sum(widths), bias)
    assert torch.equal(ours[6:], base[6:])
    assert not torch.allclose(ours[:6], base[:6])


@pytest.mark.parametrize("rows", [1, 5, 8, 17, 64, 300])
@pytest.mark.parametrize("intermediate", [48, 144])
def test_linear_packed_silu_fuses_gate_up_and_silu(rows, intermediate):
    """The fused gate_up + silu-and-mul (the decoder layers' MLP without LoRA) against
    float64 silu(x Wg^T) * (x Wu^T), and the same bits as the two ops it replaces, on one and
    two threads (thread splits of 1 and 3 gate panels, tiles of every remainder)."""
    gen = torch.Generator().manual_seed(rows + intermediate)
    x = torch.randn(rows, 64 + 5, generator=gen)[:, :64]
    weight = torch.randn(2 * intermediate, 64, generator=gen) * 0.3
    pw = PackedWeight.pack(weight)
    fused = torch.ops.raylora_cpu.linear_packed_silu
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            act = fused(x, pw.data, intermediate)
            gu = _op()(x, pw.data, 2 * intermediate, None)
            assert torch.equal(act, torch.ops.raylora_cpu.silu_and_mul(gu, intermediate))
            xd, wd = x.double(), weight.double()
            ref = F.silu(xd @ wd[:intermediate].t()) * (xd @ wd[intermediate:].t())
            torch.testing.assert_close(act, ref.float(), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="whole panels"):  # the up half must start a panel
        fused(x, PackedWeight.pack(torch.randn(2 * 40, 64)).data, 40)


def test_linear_packed_rejects_bad_arguments():
    pw = PackedWeight.pack(torch.randn(100, 32))
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="does not fit"):
        _op()(x, pw.data, 200, None)
    with pytest.raises(RuntimeError, match="features"):
        _op()(torch.randn(4, 31), pw.data, 100, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        _op()(x, pw.data.transpose(0, 1), 100, None)
    with pytest.raises(RuntimeError, match="float32"):
        _op()(x.double(), pw.data, 100, None)
    with pytest.raises(RuntimeError, match="bias"):
        _op()(x, pw.data, 100, torch.randn(99))


def test_engine_packs_a_float32_cpu_model(tiny_model_dir, tmp_path, monkeypatch):
    """On a float32 CPU model the engine keeps one copy of each linear, packed (a tied
    embedding too: it is read from the packed lm_head); with the kernels off it keeps the
    plain weights."""
    from engine import EngineConfig, LLMEngine
    from engine.models.llama import LoRALinear, PackedEmbedding
    from tests.model_fixtures import make_tiny_llama

    tied_dir = str(make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True))

    monkeypatch.delenv("RAYLORA_CPU_KERNEL", raising=False)
    if not cpu_kernel.packed_gemm_fast():
        pytest.skip("the packed GEMM is used only where it was built with AVX-512")
    model = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=16)).model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert linears and all(isinstance(m.weight, PackedWeight) for m in linears)
    assert isinstance(model.head_weight, PackedWeight)
    embedding = getattr(model.embed_tokens, "weight", None)  # tied: read from the packed head
    assert not any(p.dim() == 2 and p is not embedding for p in model.parameters())
    tied = LLMEngine(EngineConfig(model=tied_dir, num_kv_blocks=16)).model_runner.model
    assert isinstance(tied.embed_tokens, PackedEmbedding)  # one copy of the tied matrix
    assert not any(p.dim() == 2 for p in tied.parameters())
    monkeypatch.setenv("RAYLORA_CPU_KERNEL", "0")
    plain = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=16)).model_runner.model
    assert all(
        isinstance(m.weight, torch.nn.Parameter)
        for m in plain.modules()
        if isinstance(m, LoRALinear)
    )
