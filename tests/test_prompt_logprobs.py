"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers and PEFT:
log_softmax(logits at position j - 1)[token j] over the full vocabulary, fp32, for every prompt
token, through chunked prefill, preemption, n > 1 fan-out, LoRA and mixed batches."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine import model_runner as model_runner_module
from tests.lora_fixtures import make_peft_adapter

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-4


def prompt_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[P, vocab]: row i is the distribution of token i + 1 (HF's own forward, fp32)."""
    return torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0]


def check_prompt_logprobs(ours, ref: torch.Tensor, ids: list[int], k: int) -> None:
    assert ours is not None and len(ours) == len(ids), None if ours is None else len(ours)
    assert ours[0] is None
    for j in range(1, len(ids)):
        entry, row, tok = ours[j], ref[j - 1], ids[j]
        assert tok in entry, j
        for t, lp in entry.items():
            assert abs(lp - float(row[t])) <= ATOL, (j, t, lp, float(row[t]))
        assert len(entry) in (k, k + 1), (j, len(entry), k)
        if k:  # the other keys are the reference's top-k (up to a near-tie at the k-th)
            kth = float(row.topk(k).values[-1])
            others = [t for t in entry if t != tok or len(entry) == k]
            assert len(others) == k
            assert all(float(row[t]) >= kth - ATOL for t in others), j
        else:
            assert list(entry) == [tok]


def run_all(engine: LLMEngine, reqs: dict) -> tuple[dict, dict]:
    """reqs: rid -> (prompt, params[, lora]). Returns (final outputs, every output per rid)."""
    for rid, (prompt, params, *lora) in reqs.items():
        engine.add_request(rid, prompt, params, *lora)
    done, every = {}, {rid: [] for rid in reqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            every[out.request_id].append(out)
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done, every


def assert_every_output_has_the_full_list(every: dict, reqs: dict) -> None:
    for rid, outs in every.items():
        if reqs[rid][1].prompt_logprobs is None:
            assert all(o.prompt_logprobs is None for o in outs)
            continue
        assert outs
        final = outs[-1].prompt_logprobs
        assert all(o.prompt_logprobs == final for o in outs), rid


def make_engine(model_dir: str, **kw) -> LLMEngine:
    cfg = dict(model=model_dir, block_size=4, max_num_batched_tokens=64, enable_lora=False)
    return LLMEngine(EngineConfig(**(cfg | kw)))


def test_mixed_batch_matches_hf(tiny_model_dir, hf):
    """Several lengths (one an exact multiple of block_size, one of a single token), k of 0, 1
    and 5, batched with requests that do not ask: theirs are unchanged."""
    engine = make_engine(tiny_model_dir)
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    lengths_k = [(12, 0), (7, 1), (16, 5), (1, 3), (23, 20)]
    asking = {
        f"p{i}": (
            {"prompt_token_ids": prompt_ids(n, i)},
            SamplingParams(prompt_logprobs=k, **greedy),
        )
        for i, (n, k) in enumerate(lengths_k)
    }
    plain = {
        f"q{i}": ({"prompt_token_ids": prompt_ids(9 + i, 100 + i)}, SamplingParams(**greedy))
        for i in range(3)
    }
    reqs = dict(asking) | plain
    done, every = run_all(engine, reqs)
    assert_every_output_has_the_full_list(every, reqs)
    for rid, (prompt, params) in asking.items():
        ids = prompt["prompt_token_ids"]
        check_prompt_logprobs(
            done[rid].prompt_logprobs, reference_logprobs(hf, ids), ids, params.prompt_logprobs
        )
    alone, _ = run_all(make_engine(tiny_model_dir), plain)
    for rid in plain:
        assert done[rid].prompt_logprobs is None
        assert done[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids


def test_chunked_prefill_and_chunked_log_softmax(tiny_model_dir, hf, monkeypatch):
    """A 37-token prompt over 8-token steps, and the log_softmax 3 rows at a time."""
    vocab = hf.config.vocab_size
    monkeypatch.setattr(model_runner_module, "LOGITS_CHUNK_ELEMS", 3 * vocab)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8, block_size=2)
    ids = prompt_ids(37, 7)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    engine.add_request("c", {"prompt_token_ids": ids}, params)
    steps_to_first = 0
    outs = []
    while engine.has_unfinished_requests():
        got = engine.step()
        if not outs:
            steps_to_first += 1
        outs.extend(got)
    assert steps_to_first == 5  # ceil(37 / 8): the prompt really was split
    assert all(o.prompt_logprobs == outs[-1].prompt_logprobs for o in outs)
    check_prompt_logprobs(outs[-1].prompt_logprobs, reference_logprobs(hf, ids), ids, 4)


def test_n2_fan_out(tiny_model_dir, hf):
    """n=2: the children share the parent's prompt blocks; the request's prompt logprobs
    come once, from the sequence that ran the whole prompt."""
    engine = make_engine(tiny_model_dir)
    ids = prompt_ids(21, 3)  # 5 full blocks of 4 + 1 token
    params = SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True, prompt_logprobs=2
    )
    reqs = {"n2": ({"prompt_token_ids": ids}, params)}
    done, every = run_all(engine, reqs)
    assert_every_output_has_the_full_list(every, reqs)
    assert len(done["n2"].outputs) == 2
    assert all(len(o.token_ids) == 5 for o in done["n2"].outputs)
    check_prompt_logprobs(done["n2"].prompt_logprobs, reference_logprobs(hf, ids), ids, 2)


@pytest.mark.parametrize("num_kv_blocks,mid_prefill", [(12, True), (14, False)])
def test_preemption_recompute_no_duplicates(tiny_model_dir, hf, num_kv_blocks, mid_prefill):
    """A tight KV cache preempts the prompt-logprobs request, mid-prefill (12 blocks) or after
    it (14); its recompute fills in only what is missing, nothing twice."""
    engine = make_engine(tiny_model_dir, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=8)
    greedy = dict(temperature=0, ignore_eos=True)
    reqs = {
        "a1": ({"prompt_token_ids": prompt_ids(6, 11)}, SamplingParams(max_tokens=30, **greedy)),
        "a2": ({"prompt_token_ids": prompt_ids(6, 12)}, SamplingParams(max_tokens=30, **greedy)),
        "b": (
            {"prompt_token_ids": prompt_ids(30, 13)},
            SamplingParams(max_tokens=3, prompt_logprobs=3, **greedy),
        ),
    }
    preempted_at: list[int] = []  # B's prompt logprobs known when it was preempted
    scheduler = engine.scheduler
    original = scheduler._preempt

    def preempt(seq, out):
        if seq.req_id == "b":
            preempted_at.append(len(seq.prompt_logprobs))
        original(seq, out)

    scheduler._preempt = preempt
    done, every = run_all(engine, reqs)
    assert preempted_at, "the scenario no longer preempts B"
    if mid_prefill:
        assert any(1 < n < 30 for n in preempted_at), preempted_at  # with some already known
    else:
        assert all(n == 30 for n in preempted_at), preempted_at
    assert_every_output_has_the_full_list(every, reqs)
    ids = reqs["b"][0]["prompt_token_ids"]
    check_prompt_logprobs(done["b"].prompt_logprobs, reference_logprobs(hf, ids), ids, 3)
    ample, _ = run_all(make_engine(tiny_model_dir), reqs)
    for rid in reqs:
        assert done[rid].outputs[0].token_ids == ample[rid].outputs[0].token_ids


def test_lora_adapter_matches_peft(tiny_model_dir, hf, tmp_path):
    """With an adapter, the adapter's distribution (PEFT's); a base request batched with it
    gets the base model's."""
    path = make_peft_adapter(
        tiny_model_dir, tmp_path / "qv", r=4, target_modules=["q_proj", "v_proj"]
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(path)).eval()
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, block_size=4, max_num_batched_tokens=16, max_loras=1)
    )
    lora = LoRARequest("qv", 1, str(path))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=5)
    ids_a, ids_b = prompt_ids(19, 21), prompt_ids(14, 22)
    reqs = {
        "a": ({"prompt_token_ids": ids_a}, params, lora),
        "b": ({"prompt_token_ids": ids_b}, params, None),
    }
    done, every = run_all(engine, reqs)
    check_prompt_logprobs(done["a"].prompt_logprobs, reference_logprobs(peft, ids_a), ids_a, 5)
    check_prompt_logprobs(done["b"].prompt_logprobs, reference_logprobs(hf, ids_b), ids_b, 5)
    # the adapter changes the distribution, so the comparison above could tell them apart
    diff = (reference_logprobs(peft, ids_a) - reference_logprobs(hf, ids_a)).abs().max()
    assert diff > 1e-2


def test_llm_generate(tiny_model_dir, hf):
    llm = LLM(model=tiny_model_dir, block_size=4, enable_lora=False)
    ids = prompt_ids(10, 31)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}, "Hello world!"], params)
    check_prompt_logprobs(out[0].prompt_logprobs, reference_logprobs(hf, ids), ids, 0)
    text_ids = llm.get_tokenizer()("Hello world!").input_ids
    check_prompt_logprobs(out[1].prompt_logprobs, reference_logprobs(hf, text_ids), text_ids, 0)


def test_packed_cpu_gemm_path(tiny_model_dir, hf, monkeypatch):
    """The packed-weight lm_head (raylora_kernels/packed_weight.py) on the sampling rows and on
    chunks of prompt rows. The engine packs only where the packed GEMM has AVX-512; packing
    is forced here so the path runs wherever the C++ kernels build."""
    from raylora_kernels import cpu_kernel
    from raylora_kernels.packed_weight import PackedWeight

    monkeypatch.delenv("RAYLORA_CPU_KERNEL", raising=False)
    if cpu_kernel.cpu_lora_op() is None or cpu_kernel.cpu_linear_packed_op() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    monkeypatch.setattr(model_runner_module, "packed_gemm_fast", lambda: True)
    monkeypatch.setattr(model_runner_module, "LOGITS_CHUNK_ELEMS", 5 * hf.config.vocab_size)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    assert isinstance(engine.model_runner.model.head_weight, PackedWeight)
    ids = prompt_ids(29, 41)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    done, _ = run_all(engine, {"p": ({"prompt_token_ids": ids}, params)})
    check_prompt_logprobs(done["p"].prompt_logprobs, reference_logprobs(hf, ids), ids, 3)
