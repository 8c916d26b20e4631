"""Engine behaviour beyond parity: n > 1, seeds, preemption, stops, aborts, bad input, async."""

import asyncio

import pytest
import torch

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError, PromptTooLongError

PROMPTS = ["Hello world!", "The capital of France is", "def add(a, b):", "One, two, three,"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            block_size=4,
            max_num_batched_tokens=64,
            max_model_len=128,
            enable_lora=False,
        )
    )


def run(engine: LLMEngine, reqs: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


def test_n4_one_output_four_completions(engine):
    greedy = run(
        engine,
        {"g": (PROMPTS[1], SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True))},
    )["g"]
    assert len(greedy.outputs) == 4 and sorted(o.index for o in greedy.outputs) == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    sampled = run(
        engine,
        {"s": (PROMPTS[1], SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True))},
    )["s"]
    assert len(sampled.outputs) == 4
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1


def test_n_children_share_prompt_blocks(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, block_size=4, enable_lora=False))
    prompt = {"prompt_token_ids": list(range(3, 3 + 21))}  # 5 full blocks + 1 token
    eng.add_request("r", prompt, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()  # child 0 prefills the prompt; children wait
    eng.step()  # children share 5 blocks, compute only the last prompt token
    tables = [s.block_table for s in eng.output_processor.requests["r"].seqs]
    assert tables[0][:5] == tables[1][:5] == tables[2][:5]
    assert all(eng.block_manager.ref_counts[b] == 3 for b in tables[0][:5])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_seeded_sampling_same_alone_or_batched(engine):
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True
    )
    alone = run(engine, {"alone": (PROMPTS[0], params)})["alone"].outputs[0].token_ids
    batch = {
        f"b{i}": (p, SamplingParams(temperature=1.0, max_tokens=10)) for i, p in enumerate(PROMPTS)
    }
    batch["seeded"] = (PROMPTS[0], params)
    together = run(engine, batch)["seeded"].outputs[0].token_ids
    assert alone == together


def test_preemption_keeps_greedy_text(tiny_model_dir, engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    ample = run(engine, reqs)
    small = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            block_size=4,
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            enable_lora=False,
        )
    )
    tight = run(small, reqs)
    assert small.scheduler.num_preemptions > 0
    for rid in reqs:
        assert tight[rid].outputs[0].token_ids == ample[rid].outputs[0].token_ids


def test_stop_strings_stop_token_ids_and_logprobs(engine):
    base = run(
        engine, {"x": (PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))}
    )["x"].outputs[0]
    # stop token: the 5th generated token
    tok = base.token_ids[4]
    out = run(
        engine,
        {
            "y": (
                PROMPTS[2],
                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[tok]),
            )
        },
    )
    o = out["y"].outputs[0]
    first = base.token_ids.index(tok)
    assert o.token_ids == base.token_ids[: first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == tok
    # stop string: a piece of the greedy text; output text is cut before it
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        o = run(
            engine,
            {
                "z": (
                    PROMPTS[2],
                    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop),
                )
            },
        )["z"].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == text[: text.index(stop)]
    # logprobs: sampled token included, cumulative = sum
    o = run(
        engine,
        {
            "l": (
                PROMPTS[2],
                SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
            )
        },
    )["l"].outputs[0]
    assert len(o.logprobs) == 5
    for t, lp in zip(o.token_ids, o.logprobs, strict=True):
        assert t in lp and max(lp.values()) == lp[t]  # greedy picks the most likely
    assert o.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(o.token_ids, o.logprobs, strict=True)), rel=1e-5
    )
    assert o.finish_reason == "length"


def test_abort_frees_everything(engine):
    engine.add_request("a1", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("a2", PROMPTS[1], SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["a1", "a2"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


BAD = [
    ("", SamplingParams(), InvalidRequestError, "empty"),
    ("x " * 200, SamplingParams(), PromptTooLongError, "tokens"),
    ({"prompt_token_ids": [1, 99999]}, SamplingParams(), InvalidRequestError, "vocabulary"),
    ({"prompt_token_ids": []}, SamplingParams(), InvalidRequestError, "empty"),
    ("hi", SamplingParams(n=17), InvalidRequestError, "max_n"),
]


@pytest.mark.parametrize("prompt,params,exc,msg", BAD)
def test_bad_input_changes_nothing(engine, prompt, params, exc, msg):
    engine.add_request(
        "ok", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    engine.step()
    free, waiting = engine.block_manager.num_free_blocks, len(engine.scheduler.waiting)
    with pytest.raises(exc, match=msg):
        engine.add_request("bad", prompt, params)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", PROMPTS[1], SamplingParams())
    assert engine.block_manager.num_free_blocks == free and len(engine.scheduler.waiting) == waiting
    assert "bad" not in engine.output_processor.requests
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_async_engine_streams_and_aborts_on_close(tiny_model_dir):
    async def main():
        eng = AsyncLLMEngine(EngineConfig(model=tiny_model_dir, block_size=4, enable_lora=False))
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = [o async for o in eng.generate(PROMPTS[1], params, "s1")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        assert [len(o.outputs[0].token_ids) for o in outs] == sorted(
            len(o.outputs[0].token_ids) for o in outs
        )
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = eng.generate(PROMPTS[0], long, "s2")
        async for _ in gen:
            break
        await gen.aclose()  # consumer goes away -> abort
        stats = eng.stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
        await eng.shutdown()
        return outs

    asyncio.run(main())


def test_llm_generate_and_chat(tiny_model_dir):
    from engine import LLM

    llm = LLM(model=tiny_model_dir, block_size=4, enable_lora=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.prompt for o in outs] == PROMPTS
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))
    assert chat[0].prompt.startswith("<|im_start|>user")
    assert torch.get_num_threads() >= 1
