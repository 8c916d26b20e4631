"""Prefix caching in the engine against HF transformers / PEFT: greedy tokens identical with
enable_prefix_caching on and off and equal to the references, for base and adapter requests,
through n > 1, preemption, chunked prefill, one LoRA slot for two adapters, and prompts of an
exact multiple of block_size; adapters never share blocks with each other or the base (the
llama.cpp bug); an adapter reloaded with other weights under the same name and path never
reuses its old blocks (the vLLM bug); failed steps and prompt logprobs; the counters."""

import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from tests.lora_fixtures import make_peft_adapter
from tests.reference import assert_greedy_match, hf_greedy_no_eos

pytestmark = pytest.mark.timeout(300)

BS = 4
MAX_TOKENS = 8


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=gen).tolist()


SYSTEM = ids(36, 0)  # 9 full blocks, shared by every tenant (so a leak would show)
USERS = [ids(5, 1), ids(4, 2), ids(7, 3), ids(6, 4)]  # USERS[1]: a 40-token (block-multiple) prompt


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pc-adapters")
    specs = {
        "a": dict(r=4, target_modules=["q_proj", "v_proj"], seed=11),
        "b": dict(
            r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], seed=12
        ),
    }
    return {n: str(make_peft_adapter(tiny_model_dir, root / n, **kw)) for n, kw in specs.items()}


@pytest.fixture(scope="module")
def models(tiny_model_dir, adapters) -> dict:
    """The references: tenant -> HF model (None) or PEFT model."""

    out = {None: hf_base(tiny_model_dir)}
    for name, path in adapters.items():
        out[name] = peft_model(tiny_model_dir, path)
    return out


def hf_base(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_model(model_dir: str, path) -> PeftModel:
    return PeftModel.from_pretrained(hf_base(model_dir), str(path)).eval()


def make_engine(model_dir: str, caching: bool, **kw) -> LLMEngine:
    cfg = dict(
        model=model_dir,
        block_size=BS,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_loras=2,
        max_lora_rank=8,
        enable_prefix_caching=caching,
    )
    return LLMEngine(EngineConfig(**(cfg | kw)))


def run(engine: LLMEngine, reqs: dict) -> dict:
    """reqs: rid -> (prompt ids, lora, params). Steps to the end; rid -> final RequestOutput."""
    for rid, (prompt, lora, params) in reqs.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # no leak
    return done


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def waves(loras: dict) -> list[dict]:
    """Wave 1: one request per tenant (base, a, b). Wave 2, once wave 1 is done: three more
    per tenant on the same system prompt, one of 40 tokens (10 blocks exactly), one n=2."""
    tenants = [None, *loras]
    first = {f"{t}-0": (SYSTEM + USERS[0], loras.get(t), greedy()) for t in tenants}
    second = {}
    for t in tenants:
        second[f"{t}-1"] = (SYSTEM + USERS[1], loras.get(t), greedy())
        second[f"{t}-2"] = (SYSTEM + USERS[2], loras.get(t), greedy())
        second[f"{t}-3"] = (SYSTEM + USERS[3], loras.get(t), greedy(n=2))
    return [first, second]


def check_references(models: dict, reqs: dict, done: dict, tenant_of: dict) -> None:
    exact = total = 0
    for rid, (prompt, _, _) in reqs.items():
        model = models[tenant_of[rid]]
        ref = hf_greedy_no_eos(model, prompt, MAX_TOKENS)
        for c in done[rid].outputs:
            exact += assert_greedy_match(model, prompt, c.token_ids, ref)
            total += 1
    assert exact >= total - 1


SCENARIOS = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 36},
    "one_slot": {"max_loras": 1},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_identical_on_and_off_and_equal_to_references(
    tiny_model_dir, adapters, models, scenario
):
    loras = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())}
    results = {}
    for caching in (False, True):
        engine = make_engine(tiny_model_dir, caching, **SCENARIOS[scenario])
        done, cached = {}, {}
        for wave in waves(loras):
            out = run(engine, wave)
            done |= out
            cached |= {rid: o.num_cached_tokens for rid, o in out.items()}
        results[caching] = (done, cached, engine.stats())
    (off, cached_off, stats_off), (on, cached_on, stats_on) = results[False], results[True]
    for rid in off:
        assert [c.token_ids for c in on[rid].outputs] == [c.token_ids for c in off[rid].outputs]
    reqs = waves(loras)[0] | waves(loras)[1]
    tenant_of = {rid: o.lora_request and o.lora_request.lora_name for rid, o in on.items()}
    check_references(models, reqs, on, tenant_of)
    # the adapters really change the output (else a leak across tenants could not show)
    assert len({tuple(on[f"{t}-0"].outputs[0].token_ids) for t in (None, "a", "b")}) == 3
    assert not any(cached_off.values()) and stats_off["prefix_cache_queries"] == 0
    assert all(cached_on[f"{t}-0"] == 0 for t in (None, "a", "b"))  # all admitted at once
    if scenario == "preemption":
        assert stats_on["num_preemptions"] > 0 and stats_off["num_preemptions"] > 0
        assert stats_on["prefix_cache_hits"] > 0
    else:
        # wave 2 finds its tenant's system prompt (9 blocks), never more: each prompt parts
        # from wave 1's at its first user token
        assert all(cached_on[rid] == len(SYSTEM) for rid in waves(loras)[1]), cached_on
    if scenario == "one_slot":
        assert stats_on["lora"]["evictions"] > 0


def test_adapters_and_base_never_share_blocks(tiny_model_dir, adapters, models):
    """The same prompt under a, then b, then the base, then a again: only the last hits. With
    llama.cpp's bug (a cached prompt reused across adapters) b and the base would find a's
    KV: num_cached_tokens > 0 and a's continuation instead of PEFT's for b."""
    engine = make_engine(tiny_model_dir, caching=True)
    loras = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())}
    prompt = SYSTEM + USERS[1]  # 40 tokens
    outs = {}
    for i, tenant in enumerate(["a", "b", None, "a", "b", None]):
        out = run(engine, {f"r{i}": (prompt, loras.get(tenant), greedy())})[f"r{i}"]
        outs[i] = out
        expected_cached = 0 if i < 3 else len(prompt) - BS  # the last block always runs
        assert out.num_cached_tokens == expected_cached, (i, tenant, out.num_cached_tokens)
        ref = hf_greedy_no_eos(models[tenant], prompt, MAX_TOKENS)
        assert_greedy_match(models[tenant], prompt, out.outputs[0].token_ids, ref)
    assert len({tuple(outs[i].outputs[0].token_ids) for i in range(3)}) == 3
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == 6 * 40
    assert stats["prefix_cache_hits"] == 3 * 36


def test_adapter_reloaded_with_other_weights_never_reuses_its_blocks(
    tiny_model_dir, tmp_path, monkeypatch
):
    """vLLM's bug: an adapter reloaded in place under the same name reused its old blocks.
    Here the name and the path stay, the weights change: no hit, PEFT's output for the new
    weights. The same weights loaded again (from another path) do hit where the identity is
    the weights' content: files written in the last RACY_S seconds, here all of them (a
    settled folder's identity is its files, tests/test_adapter_identity.py)."""
    import engine.lora.adapter as adapter_module

    monkeypatch.setattr(adapter_module, "RACY_S", 1e9)
    path = tmp_path / "x"
    make_peft_adapter(tiny_model_dir, path, r=4, target_modules=["q_proj", "v_proj"], seed=21)
    old_model = peft_model(tiny_model_dir, path)
    engine = make_engine(tiny_model_dir, caching=True)
    prompt = SYSTEM + USERS[0]
    lora = LoRARequest("x", 1, str(path))
    first = run(engine, {"r0": (prompt, lora, greedy())})["r0"]
    ref = hf_greedy_no_eos(old_model, prompt, MAX_TOKENS)
    assert_greedy_match(old_model, prompt, first.outputs[0].token_ids, ref)

    engine.remove_lora("x")
    shutil.rmtree(path)
    make_peft_adapter(tiny_model_dir, path, r=4, target_modules=["q_proj", "v_proj"], seed=22)
    new_model = peft_model(tiny_model_dir, path)
    again = run(engine, {"r1": (prompt, LoRARequest("x", 1, str(path)), greedy())})["r1"]
    assert again.num_cached_tokens == 0
    ref = hf_greedy_no_eos(new_model, prompt, MAX_TOKENS)
    assert_greedy_match(new_model, prompt, again.outputs[0].token_ids, ref)
    assert again.outputs[0].token_ids != first.outputs[0].token_ids

    engine.remove_lora("x")
    copy = tmp_path / "x-copy"
    shutil.copytree(path, copy)
    same = run(engine, {"r2": (prompt, LoRARequest("x", 1, str(copy)), greedy())})["r2"]
    assert same.num_cached_tokens == 40  # 41 tokens: 10 full blocks
    assert same.outputs[0].token_ids == again.outputs[0].token_ids


def test_counters_by_hand(tiny_model_dir):
    """A 21-token prompt (5 full blocks + 1 token) twice, then n=3: the second request finds
    20 tokens; each n=3 child (after the parent) 20 more. Queries count every lookup's
    num_tokens, hits the tokens found (vLLM's prefix_cache_queries / prefix_cache_hits)."""
    engine = make_engine(tiny_model_dir, caching=True, enable_lora=False)
    prompt = ids(21, 5)
    a = run(engine, {"a": (prompt, None, greedy())})["a"]
    b = run(engine, {"b": (prompt, None, greedy())})["b"]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 20)
    stats = engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (42, 20)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(20 / 42)
    c = run(engine, {"c": (prompt, None, greedy(n=3))})["c"]
    assert c.num_cached_tokens == 20  # the parent's, as the request's
    stats = engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (42 + 63, 20 + 60)
    assert {tuple(o.token_ids) for o in c.outputs} == {tuple(b.outputs[0].token_ids)}
    assert stats["num_cached_blocks"] >= 5
    assert engine.reset_prefix_cache() == stats["num_cached_blocks"]
    d = run(engine, {"d": (prompt, None, greedy())})["d"]
    assert d.num_cached_tokens == 0


def test_failed_step_leaves_nothing_in_the_cache(tiny_model_dir, models):
    """An injected fault fails the prefill step before the forward writes any KV: its blocks
    must not be registered, or the next request would read them as the prompt's KV."""
    engine = make_engine(tiny_model_dir, caching=True, enable_lora=False)
    prompt = SYSTEM + USERS[0]
    engine.faults.arm("step")
    failed = run(engine, {"f": (prompt, None, greedy())})["f"]
    assert failed.outputs[0].finish_reason == "error"
    out = run(engine, {"r": (prompt, None, greedy())})["r"]
    assert out.num_cached_tokens == 0
    ref = hf_greedy_no_eos(models[None], prompt, MAX_TOKENS)
    assert_greedy_match(models[None], prompt, out.outputs[0].token_ids, ref)


@torch.inference_mode()
def test_prompt_logprobs_are_computed_not_read_from_the_cache(tiny_model_dir, models):
    engine = make_engine(tiny_model_dir, caching=True, enable_lora=False)
    prompt = SYSTEM + USERS[1]
    run(engine, {"warm": (prompt, None, greedy())})
    params = SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    out = run(engine, {"p": (prompt, None, params)})["p"]
    assert out.num_cached_tokens == 0
    ref = torch.log_softmax(models[None](torch.tensor([prompt])).logits.float(), -1)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]] - float(ref[j - 1, prompt[j]])) < 1e-4
    greedy_ref = hf_greedy_no_eos(models[None], prompt, 4)
    assert all(c.token_ids == greedy_ref for c in out.outputs)
