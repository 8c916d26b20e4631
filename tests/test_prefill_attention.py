"""The C++ CPU prefill attention (raylora_kernels/csrc/prefill_attention_cpu.cpp) against a float64
causal softmax attention over the same paged cache, and the fused layers
(csrc/layers_cpu.cpp) on batches that mix prefill chunks and decode tokens against the
model's own Python layers."""

import random

import pytest
import torch

from raylora_kernels.cpu_kernel import cpu_prefill_attention_op


def _reference(q, k_cache, v_cache, chunk, table, block_size):
    """float64 attention of one chunk (first row, tokens, first position): query position p
    attends to positions 0..p, HF's repeat_kv order for GQA."""
    row0, n, start = chunk
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    idx = torch.tensor(
        [table[t // block_size] * block_size + t % block_size for t in range(start + n)]
    )
    k = k_cache[idx].double().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
    v = v_cache[idx].double().repeat_interleave(heads // kv_heads, dim=1)
    qc = q[row0 : row0 + n].double()  # [n, H, D]
    s = torch.einsum("nhd,chd->hnc", qc, k) * q.shape[-1] ** -0.5
    pos = torch.arange(start, start + n)[:, None]
    s = s.masked_fill(torch.arange(start + n)[None, :] > pos, float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), v)


def _layout(specs, block_size, blocks, gen):
    """Chunks laid end to end in q with a spare row between them, each context on its own
    shuffled blocks: chunks [C, 3], tables [C, W] int32 (padded with block 0), rows used."""
    perm = torch.randperm(blocks, generator=gen).tolist()
    width = max(-(-(s + n) // block_size) for n, s in specs)
    chunks, tables, row, used = [], [], 1, 0
    for n, start in specs:
        need = -(-(start + n) // block_size)
        table = perm[used : used + need]
        used += need
        tables.append(table + [0] * (width - need))
        chunks.append((row, n, start))
        row += n + 1
    return chunks, tables, row


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 64, 16), (32, 8, 128, 16), (8, 1, 64, 8), (12, 3, 64, 32)],
)
def test_prefill_attention_matches_float64(heads, kv_heads, head_dim, block_size):
    op = cpu_prefill_attention_op(heads, kv_heads, head_dim)
    if op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    g = torch.Generator().manual_seed(0)
    # (tokens, first position): whole prompts, one token, chunks after a cached prefix, lengths
    # around the 32-key blocks and the query blocks (96 rows / G heads), a long one
    specs = [(1, 0), (5, 0), (33, 0), (100, 7), (17, 200), (1, 40), (64, 64), (300, 0)]
    blocks = sum(-(-(s + n) // block_size) for n, s in specs) + 4
    k_cache = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g)
    chunks, tables, rows = _layout(specs, block_size, blocks, g)
    q = torch.randn(rows, heads, head_dim, generator=g)
    out = torch.full_like(q, 7.0)
    op(
        q,
        k_cache,
        v_cache,
        torch.tensor(chunks, dtype=torch.long),
        torch.tensor(tables, dtype=torch.int32),
        block_size,
        head_dim**-0.5,
        out,
    )
    covered = torch.zeros(rows, dtype=torch.bool)
    for chunk, table in zip(chunks, tables, strict=True):
        row0, n, _ = chunk
        ref = _reference(q, k_cache, v_cache, chunk, table, block_size)
        torch.testing.assert_close(out[row0 : row0 + n].double(), ref, atol=2e-6, rtol=1e-5)
        covered[row0 : row0 + n] = True
    assert (out[~covered] == 7.0).all()  # rows of no chunk are left alone


@pytest.mark.timeout(120)
def test_prefill_attention_rows_do_not_depend_on_the_batch():
    """A chunk's output is the same bits alone and beside other chunks (the same query
    position's keys, the same blocks of 32, whatever else runs)."""
    op = cpu_prefill_attention_op(9, 3, 64)
    if op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = (
        torch.randn(64 * 16, 3, 64, generator=g),
        torch.randn(64 * 16, 3, 64, generator=g),
    )
    q = torch.randn(200, 9, 64, generator=g)
    table = torch.arange(20, dtype=torch.int32)[None]
    alone = torch.zeros_like(q)
    op(q, k_cache, v_cache, torch.tensor([[0, 150, 10]]), table, 16, 0.125, alone)
    both = torch.zeros_like(q)
    chunks = torch.tensor([[0, 150, 10], [150, 50, 0]])
    op(q, k_cache, v_cache, chunks, torch.cat([table, table + 20]), 16, 0.125, both)
    assert torch.equal(alone[:150], both[:150])


@pytest.mark.timeout(120)
def test_prefill_attention_rejects_bad_chunks():
    op = cpu_prefill_attention_op(4, 2, 64)
    if op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    cache = torch.zeros(4 * 16, 2, 64)
    q, out = torch.zeros(20, 4, 64), torch.zeros(20, 4, 64)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of the cache"):
        op(
            q,
            cache,
            cache,
            torch.tensor([[0, 20, 0]]),
            torch.tensor([[0, 9]], dtype=torch.int32),
            16,
            0.1,
            out,
        )
    with pytest.raises(RuntimeError, match="does not fit"):
        op(q, cache, cache, torch.tensor([[0, 20, 20]]), table, 16, 0.1, out)
    with pytest.raises(RuntimeError, match="out of q"):
        op(q, cache, cache, torch.tensor([[5, 20, 0]]), table, 16, 0.1, out)
    assert cpu_prefill_attention_op(4, 2, 60) is None  # head_dim without a build: SDPA path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fused_layers_on_mixed_batches_match_the_python_layers(tmp_path, prefix_caching):
    """Steps that mix new prompts, chunks of long prompts (max_num_batched_tokens 48) and
    decode tokens, through forward_layers and through the Python layers (SDPA prefill, the
    same C++ decode attention): the same logits within float rounding at every step, and the
    same greedy tokens. With prefix caching the later requests' chunks start after a cached
    prefix (the kernel reads it in place). One request asks for prompt logprobs (the fused op
    then returns rows inside a chunk, not only its last)."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.model_fixtures import make_tiny_llama

    path = make_tiny_llama(
        tmp_path / "m", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )

    def engine_and_logits(fused: bool):
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                block_size=4,
                max_num_batched_tokens=48,
                enable_lora=False,
                enable_prefix_caching=prefix_caching,
            )
        )
        runner, model = engine.model_runner, engine.model_runner.model
        if model.fused_layers_op is None:
            pytest.skip("the C++ CPU kernels are not built on this machine")
        if not fused:
            model.fused_layers_op = None
            runner.prefill_attention = None  # SDPA per chunk, as without the kernels
        seen, calls = [], {"fused": 0}
        compute = model.compute_logits

        def recording(hidden):
            logits = compute(hidden)
            seen.append(logits.clone())
            return logits

        model.compute_logits = recording
        if fused:
            op = model.fused_layers_op

            def counting(*args):
                calls["fused"] += args[11] is not None  # prefill chunks in the batch
                return op(*args)

            model.fused_layers_op = counting
        return engine, seen, calls

    rng = random.Random(0)
    shared = [rng.randrange(10, 200) for _ in range(24)]  # a prefix the later prompts share
    prompts = [[rng.randrange(10, 200) for _ in range(n)] for n in (3, 17, 40, 90)]
    prompts += [shared + [rng.randrange(10, 200) for _ in range(n)] for n in (5, 30)]
    results = []
    for fused in (True, False):
        engine, seen, calls = engine_and_logits(fused)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        engine.add_request("first", {"prompt_token_ids": shared + [7, 8]}, params)
        while engine.has_unfinished_requests():
            engine.step()
        outs = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
            engine.step()  # the next request arrives while the earlier ones decode
            if i == 2:  # prompt logprobs: rows inside a chunk are wanted too
                scored = SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0.0)
                engine.add_request("scored", {"prompt_token_ids": prompts[3][:30]}, scored)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
        results.append((seen, outs, calls))
    (fused_logits, fused_out, calls), (python_logits, python_out, _) = results
    assert calls["fused"] > 0
    assert fused_out == python_out
    assert len(fused_logits) == len(python_logits)
    for a, b in zip(fused_logits, python_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(120)
def test_layer_times_split_the_fused_forward(tmp_path):
    """raylora_cpu::layer_times (the profiler's split of forward_layers): seconds per phase
    since the last read, all three phases seen in a step, zero right after a read."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.model_fixtures import make_tiny_llama

    path = make_tiny_llama(
        tmp_path / "m", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    engine = LLMEngine(EngineConfig(model=str(path), enable_lora=False))
    if engine.model_runner.model.fused_layers_op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    layer_times = torch.ops.raylora_cpu.layer_times
    layer_times()
    engine.add_request("a", {"prompt_token_ids": list(range(5, 60))}, SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    linears, attention, elementwise = layer_times()
    assert linears > 0 and attention > 0 and elementwise > 0
    assert layer_times() == [0.0, 0.0, 0.0]
