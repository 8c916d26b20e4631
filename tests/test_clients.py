"""Clients nobody here wrote, against a running app (tiny model, one replica, one adapter):
the official `openai` client over the whole surface, and EleutherAI's lm-eval
(`local-completions`) on loglikelihood tasks whose data this test writes. Every answer is
compared with the engine run directly (offline LLM, no Ray, no HTTP), whose logprobs are
themselves checked against HF transformers in tests/test_prompt_logprobs.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.serve_fixtures import make_tiny_adapter, serve_tiny_app, stop_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE = {"max_loras": 1, "max_cpu_loras": 2, "max_num_seqs": 8, "num_kv_blocks": 256}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    a1 = make_tiny_adapter(tiny_model_dir, root / "a1", 4, ["q_proj", "v_proj"], 1)
    args = {k: str(v) for k, v in ENGINE.items()}
    url = serve_tiny_app(
        tiny_model_dir, "clients", adapters=f"a1={a1}", num_replicas="1", num_cpus="0.5", **args
    )
    try:
        yield {"url": url, "a1": str(a1)}
    finally:
        stop_ray()


@pytest.fixture(scope="module")
def llm(tiny_model_dir, served):
    from engine import LLM

    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def models(client, served):
    from engine import LoRARequest

    base = client.models.list().data[0].id
    return {base: None, "a1": LoRARequest("a1", 1, served["a1"])}


def offline(llm, prompt, lora, **params):
    from engine import SamplingParams

    return llm.generate(prompt, SamplingParams(**params), lora_request=lora)[0]


def test_completions(client, llm, models):
    for model, lora in models.items():
        ref = offline(llm, PROMPT, lora, temperature=0, max_tokens=10, logprobs=2)
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2
        )
        (choice,) = r.choices
        assert choice.text == ref.outputs[0].text, model
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        want = [
            lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True)
        ]
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
        # streamed, with usage
        stream = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        # stop string, cut as the engine cuts it
        stop = ref.outputs[0].text[3:5] or "x"
        ref_stop = offline(llm, PROMPT, lora, temperature=0, max_tokens=10, stop=[stop])
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop]
        )
        assert r.choices[0].text == ref_stop.outputs[0].text
        assert r.choices[0].finish_reason == ref_stop.outputs[0].finish_reason


def test_n_and_seed_reproduce_the_engine(client, llm, models):
    for model, lora in models.items():
        ref = offline(llm, PROMPT, lora, n=3, temperature=0.9, max_tokens=8, seed=11)
        r = client.completions.create(
            model=model, prompt=PROMPT, n=3, temperature=0.9, max_tokens=8, seed=11
        )
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        assert texts == [o.text for o in ref.outputs], model
        assert len(set(texts)) > 1  # sampling, not three greedy copies


def test_batched_prompts_and_echo(client, llm, models):
    prompts = [PROMPT, "Hello world!", "One, two, three,"]
    for model, lora in models.items():
        r = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0)
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        refs = [offline(llm, p, lora, temperature=0, max_tokens=5).outputs[0].text for p in prompts]
        assert texts == refs
        # echo + logprobs: one entry per prompt token (the first is null), then the new one
        ref = offline(llm, PROMPT, lora, temperature=0, max_tokens=1, prompt_logprobs=1)
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text == PROMPT + ref.outputs[0].text
        assert len(lp.token_logprobs) == len(ref.prompt_token_ids) + 1
        assert lp.token_logprobs[0] is None
        want = [
            top[t] for t, top in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], strict=True)
        ]
        assert lp.token_logprobs[1:-1] == pytest.approx(want, abs=1e-4)
        # echo with max_tokens=0: the prompt alone
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True
        )
        assert r.choices[0].text == PROMPT
        assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def test_chat(client, llm, models):
    from engine import SamplingParams

    for model, lora in models.items():
        ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, logprobs=2), lora)[0]
        r = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
        )
        assert r.choices[0].message.content == ref.outputs[0].text
        got = [t.logprob for t in r.choices[0].logprobs.content]
        want = [
            lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True)
        ]
        assert got == pytest.approx(want, abs=1e-4)
        stream = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=10, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == ref.outputs[0].text
        r = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=6, n=2, temperature=0.9, seed=5
        )
        assert sorted(c.index for c in r.choices) == [0, 1]


def test_client_errors(client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="a1", prompt="x", max_tokens=10**9)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="a1", prompt="x", temperature=-1)


# ---------------------------------------------------------------- structured outputs

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_parse_with_a_pydantic_model(client, llm, models):
    """client.chat.completions.parse(response_format=<pydantic model>), unmodified: the
    client sends the model's strict JSON Schema and validates the answer with pydantic; the
    answer is the offline engine's under the same schema."""
    from typing import Literal

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    from engine import SamplingParams

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        kind: Literal["cat", "dog", "fox"]
        age: int = Field(ge=0, le=30)

    for model, lora in models.items():
        r = client.chat.completions.parse(
            model=model, messages=CHAT, response_format=Pet, max_tokens=300, temperature=0
        )
        (choice,) = r.choices
        assert isinstance(choice.message.parsed, Pet), choice.message.content
        so = {"json": to_strict_json_schema(Pet)}
        ref = llm.chat(
            CHAT, SamplingParams(temperature=0, max_tokens=300, structured_outputs=so), lora
        )
        assert choice.message.content == ref[0].outputs[0].text


def test_named_tool_call_whole_and_streamed(client, llm, models):
    from engine import SamplingParams

    tools = [{"type": "function", "function": {"name": "forecast", "parameters": WEATHER}}]
    choice = {"type": "function", "function": {"name": "forecast"}}
    for model, lora in models.items():
        r = client.chat.completions.create(
            model=model,
            messages=CHAT,
            tools=tools,
            tool_choice=choice,
            max_tokens=200,
            temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "forecast" and r.choices[0].finish_reason == "stop"
        args = json.loads(call.function.arguments)
        assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
        ref = llm.chat(
            CHAT,
            SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": WEATHER}),
            lora,
        )
        assert call.function.arguments == ref[0].outputs[0].text
        stream = client.chat.completions.create(
            model=model,
            messages=CHAT,
            tools=tools,
            tool_choice=choice,
            max_tokens=200,
            temperature=0,
            stream=True,
        )
        parts = [t for c in stream if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert parts[0].function.name == "forecast" and parts[0].id
        assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments


def test_grammar_errors_from_the_replica_are_400s(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="Lookbehind is not supported"):
        client.completions.create(model="a1", prompt="x", extra_body={"guided_regex": "(?<=a)b"})
    schema = {"type": "array", "uniqueItems": True}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model="a1",
            messages=CHAT,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    r = client.completions.create(
        model="a1", prompt="x", temperature=0, extra_body={"guided_choice": ["up", "down"]}
    )
    assert r.choices[0].text in ("up", "down")


# ---------------------------------------------------------------- lm-eval

DOCS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("One, two, three,", ["four", "five", "ten", "dog"], 0),
    ("The quick brown fox jumps over the", ["lazy dog", "moon", "fence", "river"], 0),
    ("Hello world! Hello", ["there", "world", "friend", "again"], 0),
    ("Low-rank adapters add a small", ["update", "model", "weight", "cat"], 1),
    ("Ray Serve routes requests to", ["replicas", "servers", "nodes", "people"], 2),
]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "Ray Serve routes requests to replicas; each replica batches requests.",
]


def _write_tasks(folder, model_dir) -> None:
    mc = folder / "mc.jsonl"
    mc.write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS)
    )
    text = folder / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "raylora_mc.yaml").write_text(
        f"task: raylora_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "raylora_ppl.yaml").write_text(
        f"task: raylora_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {text}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )


def _engine_loglikelihood(llm, tokenizer, lora, context: str, continuation: str):
    """(sum of logprobs, greedy?) of continuation after context, split into tokens as lm-eval
    splits them (trailing spaces of the context go to the continuation; whole, then cut)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    num_ctx = len(tokenizer(context, add_special_tokens=False).input_ids)
    out = offline(llm, {"prompt_token_ids": whole}, lora, max_tokens=1, prompt_logprobs=1)
    entries = list(zip(whole, out.prompt_logprobs, strict=True))[num_ctx:]
    total = sum(top[t] for t, top in entries)
    greedy = all(top[t] == max(top.values()) for t, top in entries)
    return total, greedy


def test_lm_eval_scores_equal_the_engine(
    tmp_path, served, llm, models, tiny_model_dir, monkeypatch
):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    _write_tasks(tmp_path, tiny_model_dir)
    tokenizer = llm.get_tokenizer()
    task_manager = TaskManager(include_path=str(tmp_path))  # indexes lm-eval's tasks: once
    for model, lora in models.items():
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": model,
                "base_url": served["url"] + "/v1/completions",
                "tokenizer": tiny_model_dir,
                "tokenizer_backend": "huggingface",
                "num_concurrent": 2,
                "max_retries": 1,
                "max_length": 256,
            },
            tasks=["raylora_mc", "raylora_ppl"],
            batch_size=3,
            task_manager=task_manager,
            log_samples=True,
        )
        correct = 0
        for sample in results["samples"]["raylora_mc"]:
            q, choices, answer = DOCS[sample["doc_id"]]
            want = [_engine_loglikelihood(llm, tokenizer, lora, q, " " + c) for c in choices]
            got = [tuple(r) for r in sample["filtered_resps"]]
            assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
            assert [g[1] for g in got] == [w[1] for w in want]
            correct += max(range(len(want)), key=lambda i: want[i][0]) == answer
        acc = results["results"]["raylora_mc"]["acc,none"]
        assert acc == pytest.approx(correct / len(DOCS)), model
        # perplexity: the rolling loglikelihood of each text (one window: they are short),
        # the engine's over all its tokens after lm-eval's prefix token (BOS, else EOS)
        prefix = (
            tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        )
        total_ll = 0.0
        for text in TEXTS:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            out = offline(
                llm, {"prompt_token_ids": [prefix] + ids}, lora, max_tokens=1, prompt_logprobs=0
            )
            total_ll += sum(top[t] for t, top in zip(ids, out.prompt_logprobs[1:], strict=True))
        words = sum(len(t.split()) for t in TEXTS)
        ppl = results["results"]["raylora_ppl"]["word_perplexity,none"]
        assert ppl == pytest.approx(math.exp(-total_ll / words), rel=1e-4), model
        assert ppl > 1.0  # not the 1.0 that an all-zero score gives
