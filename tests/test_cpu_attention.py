"""The C++ CPU decode attention (raylora_kernels/csrc/attention_cpu.cpp) against a float64 softmax
attention over the same paged cache, and the engine with it against HF."""

import pytest
import torch

from raylora_kernels.cpu_kernel import cpu_decode_attention_op
from tests.test_engine_parity import check_against_hf

BS = 16


def _reference(q, k_cache, v_cache, table, length, group):
    idx = torch.tensor([table[t // BS] * BS + t % BS for t in range(length)])
    k = k_cache[idx].double().repeat_interleave(group, dim=1)  # [L, H, D], HF's repeat_kv
    v = v_cache[idx].double().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k) * q.shape[-1] ** -0.5
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128)])
def test_decode_attention_matches_float64(heads, kv_heads, head_dim):
    op = cpu_decode_attention_op(heads, kv_heads, head_dim)
    if op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    g = torch.Generator().manual_seed(0)
    # lengths around the block (16) and chunk (256) edges, and a multi-chunk context
    lens = [1, 5, 16, 17, 255, 256, 257, 700]
    blocks = 64
    k_cache = torch.randn(blocks * BS, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(blocks * BS, kv_heads, head_dim, generator=g)
    width = max(-(-n // BS) for n in lens)
    tables = [torch.randperm(blocks, generator=g)[:width].tolist() for _ in lens]
    rows = torch.tensor([2 * i + 1 for i in range(len(lens))])  # interleaved with other rows
    q = torch.randn(2 * len(lens) + 1, heads, head_dim, generator=g)
    out = torch.full_like(q, 7.0)
    op(
        q,
        rows,
        k_cache,
        v_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        BS,
        head_dim**-0.5,
        out,
    )
    for i, n in enumerate(lens):
        ref = _reference(q[rows[i]], k_cache, v_cache, tables[i], n, heads // kv_heads)
        torch.testing.assert_close(out[rows[i]].double(), ref, atol=2e-6, rtol=1e-5)
    others = torch.ones(len(out), dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all()  # rows that are not decode tokens are left alone


@pytest.mark.timeout(120)
def test_decode_attention_rejects_bad_tables():
    op = cpu_decode_attention_op(4, 2, 64)
    if op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    cache = torch.zeros(4 * BS, 2, 64)
    q, out = torch.zeros(1, 4, 64), torch.zeros(1, 4, 64)
    rows, lens = torch.tensor([0]), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of the cache"):
        table = torch.tensor([[0, 9]], dtype=torch.int32)  # block 9 of 4
        op(q, rows, cache, cache, table, lens, BS, 0.125, out)
    with pytest.raises(RuntimeError, match="does not fit"):
        table = torch.tensor([[0]], dtype=torch.int32)  # 20 positions, one block
        op(q, rows, cache, cache, table, lens, BS, 0.125, out)
    assert cpu_decode_attention_op(4, 2, 48) is None  # head_dim without a build: SDPA path


@pytest.mark.timeout(300)
def test_engine_with_decode_attention_matches_hf(tmp_path):
    """A model whose heads the kernel takes (head_dim 64, 3 query heads per KV head), so that
    every decode step runs the C++ attention, gives HF's greedy tokens."""
    from engine import EngineConfig, LLMEngine
    from tests.model_fixtures import make_tiny_llama

    path = str(
        make_tiny_llama(
            tmp_path / "m",
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
        )
    )
    engine = LLMEngine(
        EngineConfig(model=path, max_num_batched_tokens=64, block_size=4, enable_lora=False)
    )
    if engine.model_runner.decode_attention is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    from tests.test_engine_parity import PROMPTS

    assert check_against_hf(path, engine, max_tokens=24) >= len(PROMPTS) - 1


@pytest.mark.timeout(300)
def test_fused_decode_layers_match_the_python_layers(tmp_path):
    """forward_layers (csrc/layers_cpu.cpp, every layer in one call) against the model's own
    Python layers on the same decode batch: the same logits within float rounding."""
    import random

    from benchmarks.decode_timing import all_decoding, bare_decode_forward
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.model_fixtures import make_tiny_llama

    path = make_tiny_llama(
        tmp_path / "m", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    engine = LLMEngine(EngineConfig(model=str(path), block_size=4, enable_lora=False))
    model = engine.model_runner.model
    if model.fused_layers_op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    rng = random.Random(0)
    for i, n in enumerate((3, 17, 40, 90)):
        prompt = [rng.randrange(10, 200) for _ in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while not all_decoding(engine):
        engine.step()
    engine.step()
    forward = bare_decode_forward(engine)
    fused = forward()
    op, model.fused_layers_op = model.fused_layers_op, None
    try:
        python = forward()
    finally:
        model.fused_layers_op = op
    torch.testing.assert_close(fused, python, atol=1e-4, rtol=1e-4)
    assert not torch.equal(fused, torch.zeros_like(fused))


def test_elementwise_ops_match_torch():
    """csrc/elementwise_cpu.cpp's silu_and_mul (vectorised e^x) and rope_qk against torch's ops,
    including lengths that are not a multiple of the 16-lane vectors and saturated inputs."""
    import torch.nn.functional as F

    from engine.models.llama import apply_rope
    from raylora_kernels.cpu_kernel import cpu_elementwise_ops

    ops = cpu_elementwise_ops()
    if ops is None:
        pytest.skip("the C++ CPU kernels are not built here")
    silu_and_mul, rope_qk = ops
    torch.manual_seed(0)
    for t, i in ((1, 7), (33, 1536), (5, 40)):
        gu = torch.randn(t, 2 * i) * 6
        gu[0, : min(i, 4)] = torch.tensor([-100.0, 100.0, 0.0, -88.5])[: min(i, 4)]
        ref = F.silu(gu[:, :i]) * gu[:, i:]
        torch.testing.assert_close(silu_and_mul(gu, i), ref, rtol=2e-6, atol=1e-6)
    h, hkv, d, t = 9, 3, 64, 17
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    freqs = torch.arange(t)[:, None].float() * (1e4 ** (-torch.arange(0, d, 2) / d))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    q, k = rope_qk(qkv, cos.view(t, d), sin.view(t, d), h, hkv, d)
    q_ref = apply_rope(qkv[:, : h * d].view(t, h, d), cos, sin)
    k_ref = apply_rope(qkv[:, h * d : (h + hkv) * d].view(t, hkv, d), cos, sin)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        silu_and_mul(torch.randn(3, 10), 4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lora_dtype", ["auto", "bfloat16"])
def test_fused_decode_layers_with_lora_match_peft(tmp_path, lora_dtype):
    """LoRA decode batches through forward_layers (each linear linear_lora_packed, the route
    the Python layers' CPU backend takes for them): PEFT's greedy tokens on the three-adapter
    parity workload (deferrals, swaps), and the same tokens as with the Python layers."""
    from tests.lora_fixtures import make_adapter_set
    from tests.model_fixtures import make_tiny_llama
    from tests.test_lora_engine import check_parity, parity_engine

    path = str(
        make_tiny_llama(
            tmp_path / "m",
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
        )
    )
    adapters = {k: str(v) for k, v in make_adapter_set(path, tmp_path / "ad").items()}
    lora_round = torch.bfloat16 if lora_dtype == "bfloat16" else None  # the slots' values
    engine = parity_engine(path, lora_dtype=lora_dtype)
    model = engine.model_runner.model
    if model.fused_layers_op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    calls = {"lora": 0, "narrowed": 0}
    op = model.fused_layers_op

    def counting(*args):
        calls["lora"] += args[-2] is not None  # segments: a LoRA batch
        # a LoRA prefill whose last layer runs its sampling rows alone (re-segmented)
        calls["narrowed"] += args[-2] is not None and len(args[-1]) < len(args[0])
        return op(*args)

    model.fused_layers_op = counting
    fused = check_parity(path, adapters, engine, lora_round=lora_round)
    assert calls["lora"] > 0 and calls["narrowed"] > 0
    python_engine = parity_engine(path, lora_dtype=lora_dtype)
    python_engine.model_runner.model.fused_layers_op = None
    assert check_parity(path, adapters, python_engine, lora_round=lora_round) == fused
