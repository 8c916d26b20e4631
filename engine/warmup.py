"""Start-up warm-up: a few dummy requests through the whole engine before it serves.

On a GPU a fresh replica's first request of each kind paid one-off costs in its latency:
Triton compiles (the LoRA shrink/expand of a prefill, the paged decode attention of eager
mixed steps, each variant its own compile of 0.1-1 s) and the first use of torch's kernels
(prefill attention, sampling). On an H200 (2026-12-04, benchmarks/gpu_cold_start.py, empty
Triton cache) an adapter's first request took 1.4-1.8 s against ~95 ms warm; with this
warm-up, 0.15-0.22 s. vLLM warms up at start-up for the same reason
(`compile_or_warm_up_model`). The decode graphs are already compiled by their capture.

The warm-up runs real requests through `add_request` / `step`, so it covers whatever the
step runs, under a zero adapter of the largest rank (values do not change which kernels
run), and launches each variant of the paged decode kernel an eager step can reach
(`attention_variants`). Then it leaves no trace: the adapter is removed, the prefix cache and
the counters the engine reports are reset, the sampler's generator is restored (an engine
seeded with `seed` samples the same with or without a warm-up). `EngineConfig.warm_up`
(None: on CUDA only; the CPU kernels are compiled C++, built before the first step) turns it
on or off. A warm-up that fails fails the engine's construction: its kernels are the ones
the requests would run.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from raylora_kernels.paged_attention import choose_num_splits, paged_decode_attention_op

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

WARMUP_LORA = "__raylora_warmup__"
# prompt lengths: odd and multiples of 16 (Triton specialises integer arguments on
# divisibility by 16), a few tokens to a few blocks
PROMPT_LENS = (5, 16, 37, 64)
MAX_TOKENS = 4


def zero_adapter(engine: LLMEngine, rank: int) -> LoRAAdapter:
    """An adapter of `rank` on every module of every layer, all zeros: the LoRA kernels run
    on every layer as under a real adapter, and the outputs equal the base model's."""
    manager = engine.model_runner.lora_manager
    assert manager is not None
    spec = manager.spec
    weights = {
        (layer, module): (torch.zeros(rank, in_f), torch.zeros(out_f, rank))
        for layer in range(spec.num_layers)
        for module, (out_f, in_f) in spec.module_shapes.items()
    }
    modules = list(spec.module_shapes)
    return LoRAAdapter(WARMUP_LORA, rank, float(rank), 1.0, modules, weights, "warm-up")


def attention_variants(
    max_blocks: int, max_rows: int, num_kv_heads: int, num_sms: int
) -> list[tuple[int, int]]:
    """(table width, rows): one launch for each variant of the paged decode kernel that an
    eager step (decode rows beside a prefill) can compile. Its split count (`NUM_SPLITS`, from
    choose_num_splits) is a compile-time constant, and Triton specialises the width (an
    integer argument, and the tables' row stride) on being 1 or a multiple of 16. The decode
    graphs compiled theirs at capture; a mixed step's buckets take any width up to
    max_blocks and any row count (engine/attention.py `_decode_batch`). On the H200 these
    launches took a first 64-request workload from 5.5 to 4.2 s (~1 s warm): the rest of
    its first-run cost is something else, not identified (docs/benchmarks.md)."""
    seen: dict[tuple[int, bool, bool], tuple[int, int]] = {}
    for width in range(1, max_blocks + 1):
        for rows in range(1, max_rows + 1):
            split = choose_num_splits(width, rows, num_kv_heads, num_sms)
            seen.setdefault((split, width == 1, width % 16 == 0), (width, rows))
    return list(seen.values())


def _warm_decode_attention(engine: LLMEngine) -> int:
    """Launch attention_variants on the GPU (scratch q/out, tables of the null block)."""
    runner = engine.model_runner
    if runner.device.type != "cuda" or runner.decode_attention is not paged_decode_attention_op:
        return 0
    a, dev, bs = runner.args, runner.device, runner.block_size
    attn = runner.model.layers[0].self_attn
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    max_blocks = -(-engine.config.max_model_len // bs)
    variants = attention_variants(max_blocks, engine.config.max_num_seqs, a.num_kv_heads, num_sms)
    for width, rows in variants:
        # the dtypes engine/attention.py's _decode_batch passes: int32 tables and lens
        q = torch.zeros(rows, a.num_heads, a.head_dim, dtype=runner.dtype, device=dev)
        tables = torch.full((rows, width), runner.null_block, dtype=torch.int32, device=dev)
        lens = torch.ones(rows, dtype=torch.int32, device=dev)
        ids = torch.arange(rows, device=dev)
        paged_decode_attention_op(
            q, ids, attn.k_cache, attn.v_cache, tables, lens, bs, 1.0, torch.empty_like(q)
        )
    torch.cuda.synchronize(dev)
    return len(variants)


def _prompt(n: int, vocab: int) -> dict:
    return {"prompt_token_ids": [(i * 31 + 11) % vocab for i in range(n)]}


def _counters(engine: LLMEngine) -> list[tuple[object, str]]:
    """(object, attribute) of every counter `LLMEngine.stats()` reports."""
    sched = engine.scheduler
    out = [(sched.slots, a) for a in ("num_activations", "num_evictions", "num_hits")]
    out += [(sched, "num_preemptions"), (engine.block_manager, "num_evictions")]
    out += [(sched, a) for a in ("num_batches", "num_batch_seqs", "num_batch_adapters")]
    out += [(sched, "num_batch_tokens")]
    out += [(engine.block_manager.stats, a) for a in ("num_queries", "num_hits")]
    manager = engine.model_runner.lora_manager
    if manager is not None:
        names = ("num_loads", "num_cpu_hits", "num_cpu_evictions", "num_shared_reads")
        # what LoRAManager.tier_first and quick_read compare
        names += ("local_read_s", "local_read_cpu_s", "tier_fetch_s")
        out += [(manager, a) for a in names]
    return out


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests to completion and undo their traces; the seconds it took."""
    t0 = time.perf_counter()
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in _counters(engine)]
    sampler = engine.model_runner.sampler
    rng_state = sampler.generator.get_state()
    vocab = engine.model_runner.args.vocab_size
    lora = None
    if engine.config.enable_lora:
        lora = LoRARequest(WARMUP_LORA, 1, "warm-up")
        engine.insert_lora(lora, zero_adapter(engine, engine.config.max_lora_rank))
    max_len = engine.config.max_model_len
    steps = max(1, min(MAX_TOKENS, max_len - 1))  # tokens each warm-up request generates
    greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    kinds = [
        greedy,
        SamplingParams(max_tokens=steps, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=steps, temperature=0.0, logprobs=2, ignore_eos=True),
    ]
    n = 0

    def run(batch: list[tuple[int, SamplingParams, LoRARequest | None]]) -> None:
        nonlocal n
        for length, params, lora_req in batch:
            length = max(1, min(length, max_len - steps))  # a model of few positions
            engine.add_request(f"__warmup-{n}", _prompt(length, vocab), params, lora_req)
            n += 1
        while engine.has_unfinished_requests():
            engine.step()

    num_variants = _warm_decode_attention(engine)
    adapters = [None, lora] if lora is not None else [None]
    # one request alone (batch 1), then a mixed batch: every length, kind and adapter
    run([(PROMPT_LENS[0], greedy, None)])
    run(
        [
            (length, kinds[i % len(kinds)], adapters[i % len(adapters)])
            for i, length in enumerate(PROMPT_LENS)
        ]
        + [(PROMPT_LENS[-1], greedy, a) for a in adapters]
    )
    # the same prompts again: prefills that start after a cached prefix
    if engine.config.enable_prefix_caching:
        run([(PROMPT_LENS[-1], greedy, a) for a in adapters])
    if lora is not None:
        engine.remove_lora(WARMUP_LORA)
    engine.reset_prefix_cache()
    for obj, attr, value in saved:
        setattr(obj, attr, value)
    sampler.generator.set_state(rng_state)
    seconds = time.perf_counter() - t0
    logger.info(
        "warm-up: %d requests, %d decode-attention variants in %.1f s", n, num_variants, seconds
    )
    return seconds
