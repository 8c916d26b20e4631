"""Structured outputs on the engine: every constrained output valid, and what it costs.

    python benchmarks/structured_outputs.py                # default model + the demo adapters
    python benchmarks/structured_outputs.py --model PATH --adapters none --requests-per-schema 4

1. Acceptance. For the base model and each demo adapter (caps, signoff, oneword), all in one
   engine so constrained requests of every schema and adapter share batches:
   --requests-per-schema chat requests for each of 5 JSON Schemas (nested objects, enums,
   arrays with bounds, required + optional fields, regex patterns), each prompt asking for
   that JSON, sampled (temperature 0.7, a seed per request). Every output must parse and
   validate against its schema with `jsonschema` (an independent judge). The same prompts and
   seeds without the constraint are judged the same way: that few pass shows the constraint
   does the work.
2. Throughput. --num-requests requests, half constrained (the 5 schemas in turn), half not
   (exact output lengths in --output-len), all at once, greedy. Then the same requests all
   unconstrained, each generating exactly as many tokens as in the first run (ignore_eos), so
   both runs do the same forwards and the ratio prices the grammar work alone (bitmask fill,
   masking, token acceptance). Grammars are compiled first, before anything is timed (their
   compile times are printed); --rounds pairs alternate, medians. Target: >= 0.8x.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, machine, setup_threads, verdict  # noqa: E402

THROUGHPUT_TARGET = 0.8  # tok/s with 50% constrained over all unconstrained, at least

S = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": S,
                    "address": {
                        "type": "object",
                        "properties": {"city": S, "country": S},
                        "required": ["city", "country"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"enum": ["low", "medium", "high"]},
            "topic": {"enum": ["food", "travel", "work", "sport", "other"]},
        },
        "required": ["sentiment", "confidence", "topic"],
    },
    "arrays with bounds": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": S, "minItems": 2, "maxItems": 4},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["items", "scores"],
    },
    "required fields": {
        "type": "object",
        "properties": {
            "title": S,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
            "genre": S,
            "sequel": {"type": "boolean"},
        },
        "required": ["title", "year", "rating"],
    },
    "regex": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"},
        },
        "required": ["code", "date"],
    },
}
TASKS = {
    "nested objects": "Describe a person called {x} and where they live",
    "enums": "Classify this review: '{x} was a wonderful surprise'",
    "arrays with bounds": "List a few things you would pack for a trip to {x}, with scores",
    "required fields": "Describe a film about {x}",
    "regex": "Make up a product code and a release date for a product called {x}",
}
SUBJECTS = [
    "Alice", "Bob", "Paris", "Tokyo", "a dragon", "the sea", "Maria", "Kenji", "Oslo", "Lima",
    "a robot", "winter", "Omar", "Priya", "Cairo", "Quebec", "a lighthouse", "jazz", "Lena",
    "Tomas", "Nairobi", "Hanoi", "a volcano", "chess", "Sofia", "Ivan", "Seville", "Perth",
    "a tiny cat", "rain", "Chen", "Ada", "Dublin", "Quito", "a spaceship", "tea", "Noor", "Leo",
    "Vienna", "Accra", "a garden", "football", "Yuki", "Sam", "Lisbon", "Denver", "an owl",
    "bread", "Rosa", "Max",
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default' or a local checkpoint folder")
    p.add_argument(
        "--adapters", default="demo", help="'demo' (caps, signoff, oneword) or 'none' (base only)"
    )
    p.add_argument("--requests-per-schema", type=int, default=50, help="per model/adapter")
    p.add_argument("--max-tokens", type=int, default=200, help="for the acceptance requests")
    p.add_argument("--num-requests", type=int, default=64, help="throughput run")
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--rounds", type=int, default=3, help="throughput: timed pairs of runs")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--skip-acceptance", action="store_true")
    p.add_argument(
        "--skip-unconstrained", action="store_true", help="acceptance: constrained runs only"
    )
    p.add_argument("--skip-throughput", action="store_true")
    return p.parse_args(argv)


def prompt(tokenizer, schema_name: str, subject: str) -> str:
    task = TASKS[schema_name].format(x=subject)
    schema = json.dumps(SCHEMAS[schema_name], separators=(",", ":"))
    msg = f"{task}. Reply with only a JSON object that follows this JSON Schema: {schema}"
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
    )


def run_all(engine, reqs: dict) -> tuple[dict, float]:
    """reqs: id -> (prompt, SamplingParams, LoRARequest | None), all added at once."""
    t0 = time.perf_counter()
    for rid, (text, params, lora) in reqs.items():
        engine.add_request(rid, text, params, lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done, time.perf_counter() - t0


def judge(schema: dict, text: str) -> str | None:
    """None if text is JSON valid against schema, else why not."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError:
        return "not JSON"
    except jsonschema.ValidationError:
        return "invalid"
    return None


def acceptance(engine, loras: dict, args) -> dict:
    from engine import SamplingParams

    tok = engine.tokenizer
    rows = {}
    for constrained in (True,) if args.skip_unconstrained else (True, False):
        reqs = {}
        for target, lora in loras.items():
            for name, schema in SCHEMAS.items():
                for i in range(args.requests_per_schema):
                    so = {"json": schema} if constrained else None
                    params = SamplingParams(
                        temperature=0.7,
                        seed=args.seed + i,
                        max_tokens=args.max_tokens,
                        structured_outputs=so,
                    )
                    text = prompt(tok, name, SUBJECTS[i % len(SUBJECTS)])
                    reqs[(target, name, i)] = (text, params, lora)
        ids = {f"r{k}": key for k, key in enumerate(reqs)}
        done, seconds = run_all(engine, {rid: reqs[key] for rid, key in ids.items()})
        for rid, (target, name, i) in ids.items():
            out = done[rid]
            why = "error" if out.error else judge(SCHEMAS[name], out.outputs[0].text)
            cell = rows.setdefault((target, name), {True: [], False: []})
            cell[constrained].append(why)
            if constrained and why is not None:
                log(f"  INVALID {target}/{name}/{i}: {why} {out.outputs[0].text!r:.200}")
        n = len(ids)
        num_tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
        kind = "constrained" if constrained else "unconstrained"
        log(f"{kind}: {n} requests, {num_tokens} tokens in {seconds:.1f} s")
    log("")
    log("== Acceptance: valid / requests (jsonschema), constrained vs the same unconstrained ==")
    log(f"{'target':10s} {'schema':20s} {'constrained':>12s} {'unconstrained':>14s}")
    totals = {True: [0, 0], False: [0, 0]}
    for (target, name), cell in rows.items():
        counts = {}
        for c in (True, False):
            ok = sum(w is None for w in cell[c])
            totals[c][0] += ok
            totals[c][1] += len(cell[c])
            counts[c] = f"{ok}/{len(cell[c])}" if cell[c] else "-"
        log(f"{target:10s} {name:20s} {counts[True]:>12s} {counts[False]:>14s}")
    (ok_c, n_c), (ok_u, n_u) = totals[True], totals[False]
    log(f"{'all':31s} {f'{ok_c}/{n_c}':>12s} {f'{ok_u}/{n_u}' if n_u else '-':>14s}")
    verdict_ok = "MET" if ok_c == n_c and (ok_u < n_u / 2 or not n_u) else "MISSED"
    log(f"every constrained output valid, most unconstrained not: {verdict_ok}")
    return {
        "valid_constrained": ok_c,
        "num_constrained": n_c,
        "valid_unconstrained": ok_u,
        "num_unconstrained": n_u,
    }


def throughput(engine, args) -> dict:
    from engine import SamplingParams

    tok = engine.tokenizer
    rng = random.Random(args.seed)
    names = list(SCHEMAS)
    base = []  # (prompt, structured_outputs or None, exact length or None)
    for i in range(args.num_requests):
        name = names[(i // 2) % len(names)]
        text = prompt(tok, name, SUBJECTS[i % len(SUBJECTS)])
        if i % 2 == 0:
            base.append((text, {"json": SCHEMAS[name]}, None))
        else:
            base.append((text, None, rng.randint(*args.output_len)))

    def mixed() -> dict:
        return {
            f"m{i}": (
                text,
                SamplingParams(
                    temperature=0,
                    max_tokens=n or args.max_tokens,
                    ignore_eos=so is None,
                    structured_outputs=so,
                ),
                None,
            )
            for i, (text, so, n) in enumerate(base)
        }

    run_all(engine, dict(list(mixed().items())[:4]))  # warm-up
    grammar_s = _time_grammar_work(engine.structured)
    lengths: list[int] = []
    rates: dict[str, list[float]] = {"mixed": [], "plain": []}
    mixed_s = [0.0, 0.0]  # constrained runs: wall time, time in the grammar's calls

    def run_mixed() -> None:
        nonlocal lengths
        g0 = grammar_s[0]
        done, seconds = run_all(engine, mixed())
        mixed_s[0] += seconds
        mixed_s[1] += grammar_s[0] - g0
        got = [len(done[f"m{i}"].outputs[0].token_ids) for i in range(len(base))]
        assert not lengths or got == lengths, "greedy runs differ"
        lengths = got
        rates["mixed"].append(sum(got) / seconds)

    def run_plain() -> None:
        plain = {
            f"p{i}": (text, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), None)
            for i, ((text, _, _), n) in enumerate(zip(base, lengths, strict=True))
        }
        done, seconds = run_all(engine, plain)
        assert [len(done[f"p{i}"].outputs[0].token_ids) for i in range(len(base))] == lengths
        rates["plain"].append(sum(lengths) / seconds)

    for r in range(args.rounds):  # alternate the order: drift on a shared machine cancels
        for run in (run_mixed, run_plain) if r % 2 == 0 else (run_plain, run_mixed):
            run()
    mixed_rate, plain_rate = (statistics.median(rates[k]) for k in ("mixed", "plain"))
    ratio = mixed_rate / plain_rate
    num_c = sum(lengths[0::2])
    log("")
    log("== Throughput: 50% constrained vs the same requests unconstrained ==")
    log(
        f"{len(base)} requests ({len(base) // 2} constrained: {num_c} tokens; the rest "
        f"{sum(lengths[1::2])}), {sum(lengths)} tokens per run, {args.rounds} rounds"
    )
    log(
        f"50% constrained: {mixed_rate:.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in rates['mixed'])})"
    )
    log(
        f"all unconstrained: {plain_rate:.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in rates['plain'])})"
    )
    share = mixed_s[1] / mixed_s[0]
    log(f"grammar work (bitmask fill + masking + accepting) in the constrained runs: {share:.1%}")
    log(f"ratio: {ratio:.3f}x  {verdict(ratio, THROUGHPUT_TARGET, True)}")
    return {"mixed_tok_s": mixed_rate, "plain_tok_s": plain_rate, "throughput_ratio": ratio}


def _time_grammar_work(manager) -> list[float]:
    """Wrap the manager's per-step calls to add up their time into the returned [seconds]."""
    total = [0.0]
    for name in ("apply_bitmask", "accept"):
        fn = getattr(manager, name)

        def timed(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                total[0] += time.perf_counter() - t0

        setattr(manager, name, timed)
    return total


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = setup_threads(args.threads)
    from engine import EngineConfig, LLMEngine, LoRARequest
    from engine.lora.demo import DEMO_ADAPTERS, demo_adapter_dir
    from engine.sampling_params import StructuredOutputsParams

    engine = LLMEngine(
        EngineConfig(
            model=args.model, max_num_seqs=args.max_num_seqs, max_loras=4, max_lora_rank=16
        )
    )
    log(f"machine: {machine()}, {threads} threads")
    log(f"model: {engine.model_path}")
    loras: dict = {"base": None}
    if args.adapters == "demo":
        for k, name in enumerate(DEMO_ADAPTERS):
            loras[name] = LoRARequest(name, k + 1, str(demo_adapter_dir(name)))
    compile_s = {}  # first of all: each schema's first compile (the first one also imports
    for name, schema in SCHEMAS.items():  # xgrammar and reads the vocabulary into it)
        t0 = time.perf_counter()
        engine.structured.compile(StructuredOutputsParams(json=schema))
        compile_s[name] = time.perf_counter() - t0
    times = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in compile_s.items())
    log(f"compile, once per schema: {times}")
    result = {}
    if not args.skip_acceptance:
        result.update(acceptance(engine, loras, args))
    if not args.skip_throughput:
        result.update(throughput(engine, args))
    return result


if __name__ == "__main__":
    main()
