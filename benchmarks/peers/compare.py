"""raylora against vLLM CPU on one workload, each run in its own process, alternated.

Used by `--peer vllm` on benchmarks/engine_throughput.py and benchmarks/lora_overhead.py.
Round i runs both engines one after the other (raylora first in even rounds, vLLM first in
odd ones, so neither always follows the other); the ratio of round i is raylora's tok/s over
vLLM's of the same round, and the figure is the median over the rounds (the shared cores
drift by tens of percent over minutes; two runs a minute apart see much the same machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import log, num_matching
from benchmarks.peers.vllm_peer import (
    PeerResult,
    PeerWorkload,
    run_peer,
    vllm_cpu_env,
    vllm_python,
    write_workload,
)

ENGINES = ("raylora", "vllm")


def add_peer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peer",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: HF transformers / PEFT in this process (the default); vllm: vLLM CPU "
        "(`make peer-vllm`) and raylora, each in its own process, alternated",
    )
    p.add_argument("--alternations", type=int, default=3, help="--peer vllm: rounds")
    p.add_argument(
        "--peer-timeout", type=float, default=1800, help="--peer vllm: seconds per run, at most"
    )
    p.add_argument("--peer-dir", default=None, help="--peer vllm: keep workload, results, logs")
    p.add_argument(
        "--vllm-kvcache-gib",
        type=int,
        default=1,
        help="VLLM_CPU_KVCACHE_SPACE (default 1: raylora's default KV budget, 1 GB)",
    )
    p.add_argument(
        "--vllm-threads-bind",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND (all: every core, 0-1 on 2 cores; auto: vLLM's "
        "default, which keeps one core for its engine-core process)",
    )
    p.add_argument(
        "--vllm-enforce-eager",
        action="store_true",
        help="vLLM without torch.compile (its default compiles at start-up)",
    )


def run_against_vllm(work: PeerWorkload, args: argparse.Namespace, title: str) -> dict:
    """Alternate the two engines args.alternations times on work, print every run and the
    summary under title, return the figures."""
    vllm_python()  # fail now, with `make peer-vllm` in the message, not after raylora's run
    work.enforce_eager = args.vllm_enforce_eager
    env = vllm_cpu_env(kvcache_gib=args.vllm_kvcache_gib, threads_bind=args.vllm_threads_bind)
    log(f"vLLM CPU settings: {' '.join(f'{k}={v}' for k, v in env.items())}")
    if args.peer_dir:
        Path(args.peer_dir).mkdir(parents=True, exist_ok=True)
        runs = alternate(work, args.alternations, Path(args.peer_dir), args.peer_timeout, env)
    else:
        with tempfile.TemporaryDirectory(prefix="raylora-peer-") as tmp:
            runs = alternate(work, args.alternations, Path(tmp), args.peer_timeout, env)
    return report(runs, title)


def alternate(
    work: PeerWorkload,
    num_rounds: int,
    workdir: Path,
    timeout_s: float,
    vllm_env: dict[str, str],
) -> dict[str, list[PeerResult]]:
    path = write_workload(work, workdir / "workload.json")
    runs: dict[str, list[PeerResult]] = {e: [] for e in ENGINES}
    for i in range(num_rounds):
        for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:
            log(f"round {i + 1}/{num_rounds}: {engine} (own process) ...")
            env = vllm_env if engine == "vllm" else None
            r = run_peer(engine, path, workdir / f"{engine}-{i}.json", timeout_s, env=env)
            log(f"  {line(r)}")
            runs[engine].append(r)
    return runs


def line(r: PeerResult) -> str:
    m = r.memory_mb
    return (
        f"{r.engine:8s} {r.tok_per_s:7.1f} tok/s ({r.num_tokens} tokens in {r.generate_s:6.2f} s)"
        f"  start-up {r.startup_s:6.1f} s  warm-up {r.warmup_s:5.1f} s  memory after load: "
        f"RSS {m['rss_mb']:6.0f} MB, {m['num_processes']:.0f} processes RSS "
        f"{m['rss_tree_mb']:6.0f} MB / PSS {m['pss_tree_mb']:6.0f} MB"
    )


def report(runs: dict[str, list[PeerResult]], title: str) -> dict:
    ours, theirs = runs["raylora"], runs["vllm"]
    ratios = [a.tok_per_s / b.tok_per_s for a, b in zip(ours, theirs, strict=True)]

    def med(rs: list[PeerResult], key) -> float:
        return statistics.median(key(r) for r in rs)

    log("")
    log(f"== {title}: raylora against vLLM CPU ({theirs[0].version}), separate processes ==")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        log(f"round {i + 1}: {line(a)}")
        log(f"         {line(b)}")
        log(f"         ratio raylora / vLLM: {ratios[i]:.2f}x")
    result = {"ratio": statistics.median(ratios), "ratios": ratios}
    for name, rs in (("raylora", ours), ("vllm", theirs)):
        result[f"{name}_tok_s"] = med(rs, lambda r: r.tok_per_s)
        result[f"{name}_startup_s"] = med(rs, lambda r: r.startup_s)
        result[f"{name}_pss_mb"] = med(rs, lambda r: r.memory_mb["pss_tree_mb"])
        result[f"{name}_rss_mb"] = med(rs, lambda r: r.memory_mb["rss_tree_mb"])
    log(
        f"medians over {len(ratios)} rounds: raylora {result['raylora_tok_s']:.1f} tok/s, "
        f"vLLM {result['vllm_tok_s']:.1f} tok/s; ratio raylora / vLLM {result['ratio']:.2f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
    )
    log(
        f"start-up (process start to engine ready): raylora {result['raylora_startup_s']:.1f} s,"
        f" vLLM {result['vllm_startup_s']:.1f} s ({result['raylora_startup_s'] / result['vllm_startup_s']:.2f}x)"
    )
    log(
        f"memory after load (all the engine's processes, PSS): raylora "
        f"{result['raylora_pss_mb']:.0f} MB, vLLM {result['vllm_pss_mb']:.0f} MB "
        f"({result['raylora_pss_mb'] / result['vllm_pss_mb']:.2f}x); RSS summed: "
        f"{result['raylora_rss_mb']:.0f} MB, {result['vllm_rss_mb']:.0f} MB"
    )
    same, prefix = num_matching(ours[0].token_ids, theirs[0].token_ids)
    steady = {name: all(r.token_ids == rs[0].token_ids for r in rs) for name, rs in runs.items()}
    log(
        f"greedy agreement raylora / vLLM: {same}/{len(ours[0].token_ids)} requests identical, "
        f"mean common prefix {prefix:.0%} (fp32; random-token prompts make near-ties frequent);"
        f" each engine the same over its runs: raylora {steady['raylora']}, vLLM {steady['vllm']}"
    )
    result.update(identical=same, common_prefix=prefix, settings=theirs[0].settings)
    return result
