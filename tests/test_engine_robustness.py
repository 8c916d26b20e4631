"""A bad request must not kill the engine: SamplingParams validation, the context-length check,
per-request failure isolation in a step, fault injection (step / loop) and AsyncLLMEngine's
health (errored, dead_error, check_health)."""

import asyncio
import math
import shutil
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.errors import (
    ContextLengthError,
    EngineDeadError,
    InjectedFault,
    InvalidRequestError,
    RequestFailedError,
)
from tests.lora_fixtures import make_peft_adapter
from tests.reference import hf_greedy_no_eos

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Hello world!", "The capital of France is", "def add(a, b):", "One, two, three,"]
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


def make_engine(model_dir: str, **kw) -> LLMEngine:
    cfg = dict(model=model_dir, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    return LLMEngine(EngineConfig(**(cfg | {"enable_lora": False} | kw)))


def run(engine: LLMEngine, reqs: dict) -> dict:
    """reqs: rid -> (prompt, params[, lora]); the final RequestOutput per rid."""
    for rid, (prompt, params, *lora) in reqs.items():
        engine.add_request(rid, prompt, params, *lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in done, "an output after the final one"
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.output_processor.requests
    return done


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def assert_failed(out, reason_start: str) -> None:
    assert out.finished and out.error is not None and out.error.startswith(reason_start), out
    assert all(o.finish_reason == "error" for o in out.outputs)


# -- validation ----------------------------------------------------------------------------
BAD_PARAMS = [
    ("temperature", math.nan, "nan"),
    ("temperature", math.inf, "inf"),
    ("temperature", -math.inf, "-inf"),
    ("temperature", "0.5", "'0.5'"),
    ("temperature", True, "True"),
    ("top_p", math.nan, "nan"),
    ("top_p", "0.5", "'0.5'"),
    ("top_p", math.inf, "inf"),
    ("n", True, "True"),
    ("top_k", True, "True"),
    ("max_tokens", True, "True"),
    ("max_tokens", 2.0, "2.0"),
    ("logprobs", True, "True"),
    ("logprobs", 21, "21"),
    ("prompt_logprobs", True, "True"),
    ("prompt_logprobs", 21, "21"),
    ("prompt_logprobs", -1, "-1"),
    ("seed", True, "True"),
    ("seed", 2**70, str(2**70)),
    ("seed", -(2**63) - 1, str(-(2**63) - 1)),
    ("stop", 5, "5"),
    ("stop_token_ids", [True], "True"),
    ("stop_token_ids", 3, "3"),
]


@pytest.mark.parametrize("field,value,shown", BAD_PARAMS)
def test_bad_sampling_params_name_field_and_value(field, value, shown):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and shown in str(info.value), str(info.value)


def test_add_request_verifies_params_changed_after_construction(engine):
    params = SamplingParams(temperature=0.7)
    params.temperature = math.nan
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request("nan", PROMPTS[0], params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 12345678901234567])
def test_big_seeds_sample_reproducibly(engine, seed):
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed, n=2)
    first = run(engine, {"s1": (PROMPTS[1], params)})["s1"]
    again = run(engine, {"s2": (PROMPTS[1], params)})["s2"]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len(first.outputs[0].token_ids) == 6


def test_context_length_error(engine):
    ids = list(range(3, 103))  # 100 prompt tokens, max_model_len 128
    with pytest.raises(ContextLengthError) as info:
        engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(max_tokens=29))
    e = info.value
    assert isinstance(e, InvalidRequestError)
    assert (e.max_model_len, e.num_prompt_tokens, e.max_tokens) == (128, 100, 29)
    assert str(e) == (
        "This model's maximum context length is 128 tokens. However, you requested 129 tokens "
        "(100 in the prompt, 29 in the completion). Please reduce the length of the prompt or "
        "the completion."
    )
    assert not engine.has_unfinished_requests()
    # exactly at the limit is fine, and so is max_tokens=None (up to the limit)
    fits = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    unbounded = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    done = run(
        engine,
        {"fits": ({"prompt_token_ids": ids}, fits), "none": ({"prompt_token_ids": ids}, unbounded)},
    )
    for rid in ("fits", "none"):
        assert len(tokens(done[rid])) == 28 and done[rid].outputs[0].finish_reason == "length"


def test_llm_generate_runs_none_of_a_batch_with_an_invalid_prompt(tiny_model_dir):
    from engine import LLM

    llm = LLM(model=tiny_model_dir, block_size=4, max_model_len=64, enable_lora=False)
    prompts = [PROMPTS[0], {"prompt_token_ids": list(range(3, 63))}]
    with pytest.raises(ContextLengthError, match="60 in the prompt, 16 in the completion"):
        llm.generate(prompts, SamplingParams(max_tokens=16))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2))) == 2


# -- failure isolation in a step ------------------------------------------------------------
@pytest.mark.parametrize(
    "bad,reason",
    [
        # a seeded NaN row fails at its draw, after "seeded" drew: the retry must put the
        # generators back so that "seeded" draws the same again
        (math.nan, "RuntimeError: probability tensor contains"),
        ("hot", "TypeError"),  # fails before any draw
    ],
)
def test_a_bad_row_fails_alone(tiny_model_dir, hf, engine, bad, reason):
    """A careless caller changes params after add_request (verify ran already). That request
    fails, in the step it samples; the greedy and seeded requests in the same batch give what
    they give without it, and the engine goes on."""
    seeded = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=7)
    good = {
        "g0": (PROMPTS[0], SamplingParams(**GREEDY)),
        "g1": (PROMPTS[1], SamplingParams(**GREEDY)),
        "seeded": (PROMPTS[2], seeded),
    }
    alone = run(engine, good)
    params = SamplingParams(temperature=0.7, max_tokens=8, seed=3, n=2)
    for rid, (prompt, p) in good.items():
        engine.add_request(rid, prompt, p)
    engine.add_request("bad", PROMPTS[3], params)  # after "seeded": its rows sample later
    params.temperature = bad
    done = run(engine, {})
    assert_failed(done["bad"], reason)
    assert len(done["bad"].outputs) == 2
    for rid in good:
        assert done[rid].error is None and tokens(done[rid]) == tokens(alone[rid]), rid
    for rid in ("g0", "g1"):
        ids = engine.tokenizer(good[rid][0]).input_ids
        assert tokens(done[rid]) == hf_greedy_no_eos(hf, ids, 8)
    after = run(engine, {"after": (PROMPTS[0], SamplingParams(**GREEDY))})
    assert tokens(after["after"]) == tokens(alone["g0"])


def test_a_failing_forward_fails_only_its_step(tiny_model_dir, hf):
    """An injected forward fault fails every request of that step; one still waiting (no
    seat) is not in it and finishes as HF does; the engine serves new requests."""
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(**GREEDY))
    engine.faults.arm("step")
    first = {o.request_id: o for o in engine.step()}
    assert sorted(first) == ["r0", "r1"]
    for out in first.values():
        assert_failed(out, "InjectedFault: injected step fault")
    done = run(engine, {"r3": (PROMPTS[3], SamplingParams(**GREEDY))})
    for rid, prompt in (("r2", PROMPTS[2]), ("r3", PROMPTS[3])):
        ids = engine.tokenizer(prompt).input_ids
        assert done[rid].error is None and tokens(done[rid]) == hf_greedy_no_eos(hf, ids, 8)


def test_a_failing_slot_load_leaves_no_slot_behind(tiny_model_dir, tmp_path):
    """An adapter evicted from the CPU cache whose folder vanished: its slot activation fails,
    the step's requests fail, the SlotTable does not keep the adapter, and the other adapter's
    request then runs as it does on a fresh engine."""
    paths = {
        n: make_peft_adapter(tiny_model_dir, tmp_path / n, r=4, target_modules=t, seed=i)
        for i, (n, t) in enumerate([("x", ["q_proj", "v_proj"]), ("y", ["gate_proj"])])
    }
    loras = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(paths.items())}
    kw = dict(enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = make_engine(tiny_model_dir, **kw)
    engine.add_request("rx", PROMPTS[0], SamplingParams(**GREEDY), loras["x"])
    engine.add_request("base", PROMPTS[1], SamplingParams(**GREEDY))
    engine.add_request("ry", PROMPTS[2], SamplingParams(**GREEDY), loras["y"])  # evicts x
    shutil.rmtree(paths["x"])
    first = {o.request_id: o for o in engine.step()}
    assert sorted(first) == ["base", "rx"]  # y had no slot: not in the failed step
    for out in first.values():
        assert_failed(out, "LoRANotFoundError")
    assert "x" not in engine.scheduler.slots.slot_of
    done = run(engine, {})
    fresh = run(
        make_engine(tiny_model_dir, **kw),
        {"ry": (PROMPTS[2], SamplingParams(**GREEDY), loras["y"])},
    )
    assert done["ry"].error is None and tokens(done["ry"]) == tokens(fresh["ry"])
    assert engine.scheduler.slots.slot_of == {"y": 0}


# -- AsyncLLMEngine -------------------------------------------------------------------------
def async_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    return AsyncLLMEngine(engine=make_engine(model_dir, **kw))


async def first_output(gen):
    return await gen.__anext__()


def test_async_step_fault_fails_requests_and_the_engine_goes_on(tiny_model_dir, hf):
    async def main():
        eng = async_engine(tiny_model_dir)
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        gens = [eng.generate(PROMPTS[i], long, f"s{i}") for i in range(2)]
        for g in gens:
            await first_output(g)
        eng.inject_fault("step")
        for g in gens:
            with pytest.raises(RequestFailedError) as info:
                async for _ in g:
                    pass
            assert info.value.reason.startswith("InjectedFault: injected step fault")
        assert not eng.errored and eng.dead_error is None
        eng.check_health()
        outs = [o async for o in eng.generate(PROMPTS[3], SamplingParams(**GREEDY), "after")]
        stats = eng.stats()
        await eng.shutdown()
        assert not eng.errored
        return outs[-1], stats

    final, stats = asyncio.run(main())
    ids = hf_tokenize(tiny_model_dir, PROMPTS[3])
    assert final.finished and tokens(final) == hf_greedy_no_eos(hf, ids, 8)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def hf_tokenize(model_dir: str, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(prompt).input_ids


@pytest.mark.parametrize("how", ["inject_fault", "step_raises"])
def test_async_loop_death_is_reported(tiny_model_dir, how):
    """The loop dies (an injected loop fault, or an exception escaping LLMEngine.step): the
    in-flight request gets EngineDeadError, and so does everything after."""

    async def main():
        eng = async_engine(tiny_model_dir)
        assert not eng.errored and eng.dead_error is None
        gen = eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=None), "s")
        await first_output(gen)
        if how == "inject_fault":
            eng.inject_fault("loop")
        else:

            def broken():
                raise KeyError("a bug in the scheduler")

            eng.engine.scheduler.schedule = broken
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        await asyncio.to_thread(eng._thread.join, 5.0)
        assert not eng._thread.is_alive()
        assert eng.errored and isinstance(eng.dead_error, EngineDeadError)
        cause = InjectedFault if how == "inject_fault" else KeyError
        assert isinstance(eng.dead_error.__cause__, cause)
        with pytest.raises(EngineDeadError):
            eng.check_health()
        with pytest.raises(EngineDeadError):
            await first_output(eng.generate(PROMPTS[1], SamplingParams(), "later"))

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_caller_loop_that_closed_does_not_kill_the_engine(tiny_model_dir):
    """A caller's event loop closes with its stream open (no aclose ran): delivering to it
    fails, so the engine aborts that request and goes on."""
    eng = async_engine(tiny_model_dir)
    loop = asyncio.new_event_loop()
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    gen = eng.generate(PROMPTS[0], params, "orphan")
    loop.run_until_complete(first_output(gen))
    loop.close()
    deadline = time.monotonic() + 30
    while eng.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.stats()["num_running"] == 0 and not eng.errored

    async def after():
        outs = [o async for o in eng.generate(PROMPTS[1], SamplingParams(**GREEDY), "after")]
        await eng.shutdown()
        return outs[-1]

    assert asyncio.run(after()).finished
