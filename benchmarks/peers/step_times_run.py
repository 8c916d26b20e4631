"""Step times of one engine, raylora's or vLLM's, on a list of cases, in its own process.

    .venv/bin/python      benchmarks/peers/step_times_run.py raylora CASES.json OUT.json
    .venv-vllm/bin/python benchmarks/peers/step_times_run.py vllm    CASES.json OUT.json

Started by benchmarks/step_times.py, which writes the cases and alternates the engines. Both
engines are driven through the same vLLM API (`add_request(id, {"prompt_token_ids": ...},
SamplingParams)`, `step()`, `abort_request`), so both are timed by one loop:

  decode  B prompts of C tokens, greedy, ignore_eos: step until every request has its first
          decode token (prefill done, then one decode step, untimed), then time `steps`
          decode steps (each must add one token to every request); the figure is the median
          step. The requests are aborted after.
  prefill the case's prompts with max_tokens 1: the time from the first add_request to the
          last request's token (TTFT of the whole batch; of one 2k prompt for "ttft_2k");
          a case with more_prompts times each of those sets alone too: the median.

vLLM runs with its defaults (torch.compile on the CPU, prefix caching on, its CPU settings
from the environment: benchmarks/peers/vllm_peer.py) except generation_config="vllm" (the
model's generation_config.json must not change the sampling); its engine core runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that a step returns when that step's model
forward has run (with the core in a second process, a step would return queued outputs).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path


def make_engine(name: str, spec: dict):
    if name == "vllm":
        from vllm import LLM

        llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            max_num_seqs=spec["max_num_seqs"],
            max_model_len=spec["max_model_len"],
            seed=0,
            generation_config="vllm",
        )
        return llm.llm_engine
    from benchmarks.common import setup_threads
    from engine import EngineConfig, LLMEngine

    setup_threads(None)
    cfg = EngineConfig(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        kv_cache_memory_gb=spec["kv_cache_gib"],
        enable_lora=False,
    )
    return LLMEngine(cfg)


def sampling(name: str, max_tokens: int):
    if name == "vllm":
        from vllm import SamplingParams
    else:
        from engine import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def time_prefill(engine, tag: str, prompts: list, params, around) -> float:
    """Seconds from the first add_request to the last request's (only) token."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    with around():
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - t0


def run_case(engine, name: str, case: dict, tag: str, around=contextlib.nullcontext) -> dict:
    """One case (module docstring); `around()` is entered around what is timed."""
    prompts = case["prompts"]
    steps = case.get("steps", 0)
    params = sampling(name, 1 if case["kind"] == "prefill" else steps + 4)
    if case["kind"] == "prefill":  # each prompt set timed alone
        sets = [prompts, *case.get("more_prompts", ())]
        seconds = [
            time_prefill(engine, f"{tag}-{k}", p, params, around) for k, p in enumerate(sets)
        ]
        return {"seconds": statistics.median(seconds), "seconds_all": seconds}
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(ids, 0)
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, params)

    def step() -> None:
        for out in engine.step():
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)

    while min(counts.values()) < 2:
        step()
    with around():
        times = timed_steps(engine, name, step, counts, steps)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_s": statistics.median(times), "steps_s": times}


def timed_steps(engine, name: str, step, counts: dict[str, int], steps: int) -> list[float]:
    """`steps` steps, each timed. Every request must gain `steps` tokens over them; a step's
    outputs may hold a token back (raylora's detokenizer waits for a whole UTF-8 character,
    frequent with random-token prompts), so the count is checked over the window, with up to
    4 tokens per request still held back."""
    before = sum(counts.values())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    gained, want = sum(counts.values()) - before, steps * len(counts)
    if not want - 4 * len(counts) <= gained <= want + 4 * len(counts):
        raise RuntimeError(f"{name}: {steps} timed steps gave {gained} tokens, not {want}")
    return times


def warmup_case(case: dict) -> dict:
    shift = case.get("warmup_shift", 1)
    prompts = [[t + shift for t in p] for p in case["prompts"]]
    if case["kind"] == "decode":
        prompts = [p[:16] for p in prompts]
    # more_prompts: not warmed (the prefix cache would serve them when timed)
    return {**case, "prompts": prompts, "more_prompts": [], "steps": min(3, case.get("steps", 0))}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    name, cases_path, out_path = argv[0], Path(argv[1]), Path(argv[2])
    spec = json.loads(cases_path.read_text())
    t0 = time.perf_counter()
    engine = make_engine(name, spec)
    print(f"{name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    # the first calls of a shape allocate (and, in vLLM, may compile): an untimed pass of
    # each case's shape first, on other tokens (the prefix caches must not serve the timed
    # prompts), with 16-token prompts for the decode cases (a decode step's shape is B rows)
    results = []
    for i, case in enumerate(spec["cases"]):
        run_case(engine, name, warmup_case(case), f"w{i}")
        r = run_case(engine, name, case, f"c{i}")
        results.append({"label": case["label"], **r})
        print(f"{name} {case['label']}: {r}", flush=True)
    Path(out_path).write_text(json.dumps({"engine": name, "results": results}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
