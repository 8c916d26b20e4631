"""A fresh replica's first requests, with and without the start-up warm-up (engine/warmup.py).

    python benchmarks/gpu_cold_start.py              # CUDA; run by benchmarks/gpu_check.sh
    python benchmarks/gpu_cold_start.py --dry-run    # CPU: Triton interpreter, tiny shapes

A random SmolLM2-shaped model and one random adapter (r16, all linears). Each arm (warm_up
off, on; twice, alternating) is a new process with an empty Triton cache (TRITON_CACHE_DIR),
as a new replica on a new node: it builds the engine (timed: load, KV planning, graph capture,
the warm-up), then runs four requests one after another, each timed to its last token: base
greedy, the adapter greedy, base sampled (temperature 0.8, top-p 0.9) with logprobs, then 8
mixed together; then the same four again, warm. Printed: each request's latency per arm, and
the first / warm ratio. Figures to --json (default $OUT/gpu_cold_start.json, OUT=/tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUESTS = ("base greedy", "adapter greedy", "base sampled + logprobs", "8 mixed")


def child(args: argparse.Namespace) -> None:
    """One arm, in its own process: build the engine, run REQUESTS twice, print JSON."""
    sys.path.insert(0, str(REPO))
    t0 = time.perf_counter()
    from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams

    lora = LoRARequest("a0", 1, args.lora)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_loras=4,
            max_lora_rank=16,
            max_num_seqs=16,
            num_kv_blocks=1024,
            warm_up=args.arm == "on",
            lora_backend="triton",
        )
    )
    build_s = time.perf_counter() - t0
    vocab = engine.model_runner.args.vocab_size
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, logprobs=2, ignore_eos=True)

    def prompt(i: int, n: int) -> dict:
        return {"prompt_token_ids": [(i * 977 + j * 13 + 5) % vocab for j in range(n)]}

    def timed(batch: list[tuple[int, object, object]], tag: str) -> float:
        # prompts from the tag's characters: the same in every arm's process (hash() is not)
        t, salt = time.perf_counter(), sum(map(ord, tag))
        for k, (n, params, lr) in enumerate(batch):
            engine.add_request(f"{tag}-{k}", prompt(salt + k, n), params, lr)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    rounds = []
    for r in range(2):
        rounds.append(
            [
                timed([(41, greedy, None)], f"r{r}a"),
                timed([(41, greedy, lora)], f"r{r}b"),
                timed([(23, sampled, None)], f"r{r}c"),
                timed(
                    [(19 + 7 * k, (greedy, sampled)[k % 2], (None, lora)[k % 2]) for k in range(8)],
                    f"r{r}d",
                ),
            ]
        )
    print(
        json.dumps(
            {
                "arm": args.arm,
                "build_s": build_s,
                "warm_up_s": engine.warm_up_seconds,
                "first_s": rounds[0],
                "warm_s": rounds[1],
            }
        )
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument(
        "--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "gpu_cold_start.json")
    )
    p.add_argument("--arm", choices=("on", "off"), help=argparse.SUPPRESS)  # the child
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--lora", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        child(args)
        return 0
    sys.path.insert(0, str(REPO))
    from benchmarks.common import ALL_LINEARS
    from benchmarks.gpu_decode_check import DRY, GPU
    from benchmarks.gpu_decode_models import write_random_adapter
    from engine.models.llama import ModelArgs
    from engine.models.loader import load_model_config
    from tests.model_fixtures import make_tiny_llama

    scale = DRY if args.dry_run else GPU
    tmp = Path(tempfile.mkdtemp(prefix="raylora-cold-"))
    model = make_tiny_llama(tmp / "model", **scale.smollm2)
    margs = ModelArgs.from_hf_config(load_model_config(model))
    lora = write_random_adapter(tmp / "a0", margs, 16, ALL_LINEARS, seed=0)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if args.dry_run:
        env.update(TRITON_INTERPRET="1", RAYLORA_CPU_KERNEL="0", CUDA_VISIBLE_DEVICES="")
    runs: list[dict] = []
    for arm in ("off", "on", "on", "off"):
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-", dir=tmp)
        cmd = [sys.executable, __file__, "--arm", arm, "--model", str(model), "--lora", str(lora)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(
            f"warm_up {arm}: build {r['build_s']:.1f} s (warm-up {r['warm_up_s']:.1f} s); "
            + ", ".join(
                f"{k} {a * 1e3:.0f} ms (warm {b * 1e3:.0f})"
                for k, a, b in zip(REQUESTS, r["first_s"], r["warm_s"], strict=True)
            ),
            flush=True,
        )
    summary = {}
    for arm in ("off", "on"):
        mine = [r for r in runs if r["arm"] == arm]
        summary[arm] = {
            "build_s": statistics.median(r["build_s"] for r in mine),
            "first_ms": [
                statistics.median(r["first_s"][i] for r in mine) * 1e3 for i in range(len(REQUESTS))
            ],
            "warm_ms": [
                statistics.median(r["warm_s"][i] for r in mine) * 1e3 for i in range(len(REQUESTS))
            ],
        }
    for i, name in enumerate(REQUESTS):
        off, on = summary["off"], summary["on"]
        print(
            f"{name:>26}: first request {off['first_ms'][i]:7.0f} ms without warm-up, "
            f"{on['first_ms'][i]:7.0f} ms with; warm {on['warm_ms'][i]:6.0f} ms; "
            f"first/warm {off['first_ms'][i] / off['warm_ms'][i]:.1f}x -> "
            f"{on['first_ms'][i] / on['warm_ms'][i]:.1f}x"
        )
    print(
        f"engine build: {summary['off']['build_s']:.1f} s without warm-up, "
        f"{summary['on']['build_s']:.1f} s with (medians of 2)"
    )
    Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
