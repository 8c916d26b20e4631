"""Structured outputs in the engine (tiny model): outputs checked by independent judges (`re`,
`jsonschema`, a brute-force greedy decoder over HF transformers' logits), mixed batches with
adapters, bad grammars refused before anything is queued, runtime grammar failures isolated,
compilation once per schema and off the step's thread."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest
import torch

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.errors import InvalidRequestError
from tests.reference import TIE_GAP

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Hello world!", "The capital of France is", "def add(a, b):", "One, two, three,"]
CHOICES = ["yes", "no", "maybe so", "a quick fox"]
REGEX = r"[a-c]{3}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"enum": ["cat", "dog", "fox"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 3,
        },
        "inner": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
            "required": ["ok", "code"],
        },
    },
    "required": ["id", "label", "tags", "inner"],
}


def _json(schema=SCHEMA, **kw):
    # the tiny random model loves whitespace: compact JSON keeps the outputs short
    return {"json": schema, "disable_any_whitespace": True, **kw}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    from tests.serve_fixtures import make_tiny_adapters

    root = tmp_path_factory.mktemp("so-adapters")
    paths = make_tiny_adapters(tiny_model_dir, root, ["a1", "a2"])
    return [LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=tiny_model_dir, block_size=4, max_model_len=256, max_loras=2)
    )


def run(engine: LLMEngine, reqs: dict) -> dict:
    for rid, (prompt, params, lora) in reqs.items():
        engine.add_request(rid, prompt, params, lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def constrained_batch(adapters) -> dict:
    """Every kind of constraint, greedy and seeded sampling, base and two adapters."""
    loras = [None, *adapters]
    kinds = [
        {"choice": CHOICES},
        {"regex": REGEX},
        _json(),
        {"json_object": True, "disable_any_whitespace": True},
    ]
    reqs = {}
    for i, so in enumerate(kinds):
        for j, lora in enumerate(loras):
            for temp, seed in [(0.0, None), (1.0, 7 + i * 3 + j)]:
                params = SamplingParams(
                    temperature=temp, seed=seed, max_tokens=120, structured_outputs=dict(so)
                )
                reqs[f"c{i}-{j}-{temp}"] = (PROMPTS[(i + j) % 4], params, lora)
    return reqs


def unconstrained_batch(adapters) -> dict:
    loras = [None, *adapters]
    return {
        f"u{i}": (PROMPTS[i % 4], SamplingParams(temperature=0, max_tokens=24), loras[i % 3])
        for i in range(6)
    }


def check_output(rid: str, text: str) -> None:
    kind = int(rid[1])
    if kind == 0:
        assert text in CHOICES, (rid, text)
    elif kind == 1:
        assert re.fullmatch(REGEX, text), (rid, text)
    elif kind == 2:
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert isinstance(json.loads(text), dict), (rid, text)


def test_mixed_batch_constrained_valid_unconstrained_unchanged(engine, adapters):
    alone = run(engine, unconstrained_batch(adapters))
    mixed = run(engine, {**constrained_batch(adapters), **unconstrained_batch(adapters)})
    for rid, out in mixed.items():
        o = out.outputs[0]
        assert out.error is None, (rid, out.error)
        if rid.startswith("c3"):  # any JSON object: the random model's strings run long
            assert o.text.startswith("{")
            assert o.finish_reason == "length" or isinstance(json.loads(o.text), dict)
        elif rid.startswith("c"):
            assert o.finish_reason == "stop", (rid, o.text)
            check_output(rid, o.text)
        else:  # the constrained neighbours change nothing in an unconstrained row
            assert o.token_ids == alone[rid].outputs[0].token_ids, rid
    # the constraint does the work: unconstrained, the same prompts are not in the language
    free = run(
        engine,
        {
            rid: (
                p,
                SamplingParams(temperature=params.temperature, seed=params.seed, max_tokens=120),
                lora,
            )
            for rid, (p, params, lora) in constrained_batch(adapters).items()
        },
    )
    valid = 0
    for rid, out in free.items():
        try:
            check_output(rid, out.outputs[0].text)
            valid += 1
        except (AssertionError, ValueError, jsonschema.ValidationError):
            pass
    assert valid <= len(free) // 4, valid


def test_compiled_once_per_schema_and_n_children_constrained(engine):
    before = engine.structured.num_compiles
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    reqs = {
        f"r{i}": (
            PROMPTS[i],
            SamplingParams(
                n=2, temperature=1.0, seed=i, max_tokens=40, structured_outputs=_json(schema)
            ),
            None,
        )
        for i in range(3)
    }
    # the same schema as JSON text with another key order is the same grammar
    reqs["t"] = (
        PROMPTS[3],
        SamplingParams(
            max_tokens=40, structured_outputs=_json(json.dumps(dict(reversed(schema.items()))))
        ),
        None,
    )
    done = run(engine, reqs)
    assert engine.structured.num_compiles == before + 1
    for out in done.values():
        for o in out.outputs:
            jsonschema.validate(json.loads(o.text), schema)


@torch.inference_mode()
def brute_force_choice(model, tokenizer, prompt_ids, choices, eos_id, max_new):
    """Greedy decoding over HF's logits, allowing only tokens that keep the text a prefix of
    some choice (and EOS once it is one): the choice grammar, without xgrammar."""
    out: list[int] = []
    special = set(tokenizer.all_special_ids)
    for _ in range(max_new):
        logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
        text = tokenizer.decode(out)
        allowed = [
            t
            for t in range(logits.shape[0])
            if t < len(tokenizer)
            and t not in special
            and any(c.startswith(tokenizer.decode(out + [t])) for c in choices)
            and tokenizer.decode(out + [t]) != text
        ]
        if text in choices:
            allowed.append(eos_id)
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        top2 = masked.topk(2).values
        out.append(int(masked.argmax()))
        yield out[-1], float(top2[0] - top2[1])
        if out[-1] == eos_id:
            return


def test_greedy_choice_matches_brute_force_reference(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = engine.tokenizer
    choices = ["red apple", "green pear", "blue", "redwood tree", "0xdead"]
    for prompt in PROMPTS:
        params = SamplingParams(
            temperature=0, max_tokens=20, structured_outputs={"choice": choices}
        )
        ours = run(engine, {"g": (prompt, params, None)})["g"].outputs[0].token_ids
        prompt_ids = tok(prompt).input_ids
        ref = list(brute_force_choice(model, tok, prompt_ids, choices, 2, 20))
        for k, (ref_tok, gap) in enumerate(ref):
            if ours[k] != ref_tok:
                assert gap < TIE_GAP, (prompt, k, ours, [t for t, _ in ref])
                break
        else:
            assert ours == [t for t, _ in ref], prompt
        assert tok.decode(ours, skip_special_tokens=True) in choices


@pytest.mark.parametrize(
    "so, msg",
    [
        ({"json": {"type": "foo"}}, "not a valid JSON Schema"),
        ({"json": {"type": "array", "uniqueItems": True}}, "'uniqueItems'"),
        ({"json": {"type": "string", "format": "iri"}}, "format 'iri'"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum greater than maximum"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "(?<=a)b"}, "Lookbehind is not supported"),
        ({"regex": "a("}, "parenthesis is not closed"),
        ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ],
)
def test_bad_grammars_refused_before_queueing(engine, so, msg):
    with pytest.raises(InvalidRequestError, match=re.escape(msg)):
        engine.add_request("bad", "Hi", SamplingParams(structured_outputs=so))
    assert not engine.has_unfinished_requests() and not engine.output_processor.requests


def test_ignore_eos_refused():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})


class _BrokenMatcher:
    def __init__(self, fill_raises: bool) -> None:
        self.fill_raises = fill_raises

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask, index) -> bool:
        if self.fill_raises:
            raise RuntimeError("matcher exploded")
        return True  # leaves every token allowed: the sampled token is then refused below

    def accept_token(self, token_id: int) -> bool:
        return False


@pytest.mark.parametrize("fill_raises", [True, False])
def test_runtime_grammar_failure_fails_only_its_request(engine, adapters, fill_raises):
    good = {k: v for k, v in constrained_batch(adapters).items() if k.endswith("0.0")}
    ref = run(engine, {**good, **unconstrained_batch(adapters)})
    reqs = {
        **good,
        **unconstrained_batch(adapters),
        "bad": (
            PROMPTS[0],
            SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": "[ab]+"}),
            None,
        ),
    }
    for rid, (prompt, params, lora) in reqs.items():
        engine.add_request(rid, prompt, params, lora)
    (seq,) = engine.output_processor.requests["bad"].seqs
    engine.structured._matchers[seq] = _BrokenMatcher(fill_raises)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "GrammarError" in done["bad"].error
    for rid, out in ref.items():
        assert (
            done[rid].error is None and done[rid].outputs[0].token_ids == out.outputs[0].token_ids
        )


def test_compile_runs_off_the_step_and_bad_schema_fails_at_generate(tiny_model_dir, monkeypatch):
    """A 1.5 s compile (as a large schema can take) in AsyncLLMEngine: a running stream keeps
    getting tokens meanwhile; a bad schema raises from generate() before anything is queued."""
    eng = AsyncLLMEngine(EngineConfig(model=tiny_model_dir, block_size=4, enable_lora=False))
    real = eng.engine.structured._compile

    def slow_compile(params):
        time.sleep(1.5)  # releases the GIL, as xgrammar's compiler does
        return real(params)

    monkeypatch.setattr(eng.engine.structured, "_compile", slow_compile)

    compiled = asyncio.Event()

    async def stream_times():
        # Back-to-back streams until the compile is over: a fixed token count ends early on a
        # fast machine (400 tokens took 0.55 s here and less in CI).
        times, i = [], 0
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        while not compiled.is_set():
            async for _ in eng.generate("Hello world!", params, f"long-{i}"):
                times.append(time.monotonic())
            i += 1
        return times

    async def constrained():
        await asyncio.sleep(0.3)
        start = time.monotonic()
        so = {"regex": "[ab]{4}"}
        outs = [
            o
            async for o in eng.generate(
                "Hi", SamplingParams(temperature=0, structured_outputs=so), "c"
            )
        ]
        compiled.set()
        return start, outs[-1]

    async def main():
        (times, (start, last)) = await asyncio.gather(stream_times(), constrained())
        with pytest.raises(InvalidRequestError, match="uniqueItems"):
            async for _ in eng.generate(
                "Hi",
                SamplingParams(structured_outputs={"json": {"type": "array", "uniqueItems": True}}),
                "bad",
            ):
                pass
        return times, start, last

    try:
        times, start, last = asyncio.run(main())
    finally:
        asyncio.run(eng.shutdown(5.0))
    assert re.fullmatch("[ab]{4}", last.outputs[0].text)
    during = [t for t in times if start + 0.2 < t < start + 1.4]
    assert len(during) >= 5, f"{len(during)} tokens of the running stream during the compile"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < 1.0, max(gaps)
    assert eng.engine.get_num_unfinished_requests() == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_and_demo_adapters_follow_every_schema(default_model_dir, capsys):
    """The benchmark's acceptance run, small: the default model and each demo adapter, one
    sampled request per schema (5 schemas), in one engine; every output valid (jsonschema).
    The full run (50 per schema, and the same prompts unconstrained) is
    benchmarks/structured_outputs.py (docs/benchmarks.md)."""
    from benchmarks import structured_outputs as bench
    from engine.lora.demo import ensure_demo_adapters

    ensure_demo_adapters()
    r = bench.main(
        [
            "--requests-per-schema",
            "1",
            "--skip-throughput",
            "--skip-unconstrained",
            "--max-tokens",
            "160",
        ]
    )
    assert r["num_constrained"] == 20
    assert r["valid_constrained"] == 20, capsys.readouterr().out
