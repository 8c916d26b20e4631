"""Greedy token ids equal HF transformers generate(do_sample=False), requests batched together."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.reference import assert_greedy_match, hf_greedy, hf_greedy_no_eos

PROMPTS = [
    "Hello",
    "The capital of France is",
    "One, two, three, four, five, six,",
    "def add(a, b):\n    return",
    "Ray Serve routes requests to replicas; each replica batches requests. Low-rank adapters",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "Hello world! Hello there, how are you today? 0123456789",
    "user assistant system",
    "Low-rank adapters (LoRA) add a small update to a frozen base model. " * 4,
]


def run_engine(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict[str, list]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def check_against_hf(
    model_dir: str, engine: LLMEngine, max_tokens: int, prompts=PROMPTS, ignore_eos=False
):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ours = run_engine(engine, prompts, params)
    eos = engine.output_processor.eos_token_ids
    exact = 0
    for i, p in enumerate(prompts):
        ids = engine.tokenizer(p).input_ids
        if ignore_eos:
            ref = hf_greedy_no_eos(hf, ids, max_tokens)
            assert len(ours[f"r{i}"]) == max_tokens
        else:
            ref = hf_greedy(hf, ids, max_tokens, eos)
        exact += assert_greedy_match(hf, ids, ours[f"r{i}"], ref)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return exact


def test_tiny_model_matches_hf(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir, max_num_batched_tokens=64, block_size=4, enable_lora=False
        )
    )
    exact = check_against_hf(tiny_model_dir, engine, max_tokens=24)
    assert exact >= len(PROMPTS) - 1


def test_chunked_prefill_and_tiny_blocks_match_hf(tiny_model_dir):
    """Long prompts split over several steps (budget 16) still give HF's tokens."""
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            max_num_batched_tokens=16,
            max_num_seqs=3,
            block_size=2,
            enable_lora=False,
        )
    )
    check_against_hf(tiny_model_dir, engine, max_tokens=12)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_matches_hf(default_model_dir):
    engine = LLMEngine(EngineConfig(model="default", max_num_batched_tokens=512, enable_lora=False))
    # at least 32 new tokens for every prompt: EOS does not stop either side
    exact = check_against_hf(default_model_dir, engine, max_tokens=40, ignore_eos=True)
    assert exact >= len(PROMPTS) - 1
    # and with EOS honoured, HF's own generate() as the reference
    check_against_hf(default_model_dir, engine, max_tokens=32)
