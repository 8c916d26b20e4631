"""Decode-step and prefill times, raylora against vLLM CPU, alternated in separate processes.

    python benchmarks/step_times.py                      # the grid below, 2 rounds
    python benchmarks/step_times.py --rounds 3 --cases decode:32x128,ttft_2k
    python benchmarks/step_times.py --profile            # raylora only, where its time goes

Cases (issue 16, item 2), base model, greedy, the same random prompts for both engines:
  decode:BxC   B sequences at context C: the median of --steps decode steps
  ttft_2k      one 2,048-token prompt: the time to its first token; --ttft-repeats
               different prompts one after the other, the median (one sample moves by
               +-6% on these VMs)
  prefill_mix  the engine-throughput workload's 64 prompts (16-256 tokens): to the last
               first token
Each round runs raylora and vLLM in their own processes (benchmarks/peers/step_times_run.py),
raylora first in even rounds; a case's ratio is raylora's time over vLLM's in the same round,
the figure the median over rounds (lower is better; issue 16 asks <= 0.85x at decode batch 1
and 32, <= 1x for ttft_2k). Both engines get --kv-gib of KV cache and max_num_seqs 64.

--profile: raylora alone, in this process: every case's timed steps under torch.profiler,
their CPU time split into linears, attention, norms / rope / activations, sampler and the
rest (Python, scheduling, input building: the step's wall time minus the ops'),
benchmarks/step_profile.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, machine, make_workload  # noqa: E402
from benchmarks.peers.vllm_peer import run_script, vllm_cpu_env, vllm_python  # noqa: E402

DEFAULT_CASES = (
    "decode:1x128,decode:1x2048,decode:8x128,decode:8x2048,decode:32x128,decode:32x512,"
    "decode:64x128,decode:64x256,ttft_2k,prefill_mix"
)
TARGETS = {"decode:1x": 0.85, "decode:32x": 0.85, "ttft_2k": 1.0}  # issue 16, at most


def build_cases(
    names: str, low: int, high: int, steps: int, seed: int, repeats: int = 1
) -> list[dict]:
    cases = []
    for i, name in enumerate(n.strip() for n in names.split(",") if n.strip()):
        if name.startswith("decode:"):
            b, c = (int(x) for x in name.removeprefix("decode:").split("x"))
            w = make_workload(b, (c, c), (1, 1), low, high, seed + i)
            cases.append(dict(label=name, kind="decode", prompts=w.prompts, steps=steps))
        elif name == "ttft_2k":  # `repeats` prompts, each timed alone: the median
            sets = [
                make_workload(1, (2048, 2048), (1, 1), low, high, seed + i + 1000 * r)
                for r in range(repeats)
            ]
            cases.append(
                dict(
                    label=name,
                    kind="prefill",
                    prompts=sets[0].prompts,
                    more_prompts=[w.prompts for w in sets[1:]],
                )
            )
        elif name == "prefill_mix":  # engine_throughput.py's workload, same seed
            w = make_workload(64, (16, 256), (16, 128), low, high, seed)
            cases.append(dict(label=name, kind="prefill", prompts=w.prompts))
        else:
            raise SystemExit(f"unknown case {name!r}")
    return cases


def figure(r: dict) -> float:
    return r["step_s"] if "step_s" in r else r["seconds"]


def target_of(label: str) -> float | None:
    return next((t for k, t in TARGETS.items() if label.startswith(k)), None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per case")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--ttft-repeats", type=int, default=3, help="ttft_2k: prompts per round (median)"
    )
    p.add_argument("--kv-gib", type=int, default=2, help="KV cache of both engines, GiB")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine run")
    p.add_argument("--profile", action="store_true", help="raylora only: the breakdown")
    p.add_argument("--peer-dir", default=None, help="keep cases, results and logs here")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.common import vocab_range
    from engine.models.loader import resolve_model

    path = resolve_model(args.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    low, high = vocab_range(AutoTokenizer.from_pretrained(str(path)), vocab)
    # high - 1: the warm-up shift; the profile reports one prompt (no median to take)
    repeats = 1 if args.profile else args.ttft_repeats
    cases = build_cases(args.cases, low, high - 1, args.steps, args.seed, repeats)
    longest = max(len(pr) for c in cases for pr in c["prompts"])
    spec = dict(
        model=str(path),
        dtype=args.dtype,
        max_num_seqs=64,
        max_model_len=longest + args.steps + 16,
        kv_cache_gib=args.kv_gib,
        cases=cases,
    )
    log(f"machine: {machine()}")
    log(f"model: {path}, {args.dtype}; cases: {args.cases}")
    if args.profile:
        from benchmarks.step_profile import profile_cases

        return profile_cases(spec)
    vllm_python()
    env = vllm_cpu_env(kvcache_gib=args.kv_gib)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log(f"vLLM CPU settings: {' '.join(f'{k}={v}' for k, v in env.items())}")
    with tempfile.TemporaryDirectory(prefix="raylora-steps-") as tmp:
        work = Path(args.peer_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "cases.json").write_text(json.dumps(spec))
        runs: dict[str, list[dict]] = {"raylora": [], "vllm": []}
        for i in range(args.rounds):
            for engine in ("raylora", "vllm") if i % 2 == 0 else ("vllm", "raylora"):
                log(f"round {i + 1}/{args.rounds}: {engine} (own process) ...")
                out = work / f"{engine}-{i}.json"
                run_script(
                    engine,
                    "step_times_run.py",
                    [engine, str(work / "cases.json"), str(out)],
                    out.with_suffix(".log"),
                    args.timeout,
                    env if engine == "vllm" else None,
                )
                runs[engine].append(json.loads(out.read_text()))
    return report(cases, runs)


def report(cases: list[dict], runs: dict[str, list[dict]]) -> dict:
    log("")
    log("== Step times, raylora against vLLM CPU (ms; ratio = raylora / vLLM, median of rounds) ==")
    log(f"{'case':<16}{'raylora':>10}{'vLLM':>10}{'ratio':>8}  rounds      target")
    result = {}
    for k, case in enumerate(cases):
        ours = [figure(r["results"][k]) for r in runs["raylora"]]
        theirs = [figure(r["results"][k]) for r in runs["vllm"]]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        ratio = statistics.median(ratios)
        t = target_of(case["label"])
        verdict = "" if t is None else f"<= {t:.2f}: {'met' if ratio <= t else 'MISSED'}"
        spread = ", ".join(f"{x:.2f}" for x in ratios)
        log(
            f"{case['label']:<16}{statistics.median(ours) * 1e3:>10.1f}"
            f"{statistics.median(theirs) * 1e3:>10.1f}{ratio:>7.2f}x  ({spread})  {verdict}"
        )
        result[case["label"]] = dict(
            raylora_ms=statistics.median(ours) * 1e3,
            vllm_ms=statistics.median(theirs) * 1e3,
            ratio=ratio,
            ratios=ratios,
        )
    return result


if __name__ == "__main__":
    main()
