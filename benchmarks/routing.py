"""Adapter routing on a real local Ray Serve deployment: AdapterAffinityRouter vs Ray's own
multiplexed-model routing, the way a Ray Serve LLM user runs LoRA.

    python benchmarks/routing.py            # 4 replicas x 3 slots, CPU cache 6, 12 adapters
                                            # Zipf(1.1), 600 requests at 15/s, 4 policies (~6 min)
    python benchmarks/routing.py --runs 2   # every policy twice, alternating (ABCD, then DCBA)
    python benchmarks/routing.py --smoke    # 2 replicas, 6 adapters, 60 requests
    python benchmarks/routing.py --adapters 40 --policies affinity,ray_multiplex

One request trace (Poisson arrivals, adapters drawn Zipf(s), seeded) is replayed against the
LLMServer deployment, deployed fresh per policy. A policy is a router and an engine's
adapter-cache behaviour (`ENGINES`: raylora's keeps what the replica is asked for most and
reads adapters in a worker thread; vLLM's is LRU and reads a missing adapter under the engine
lock, so no step runs meanwhile, as vLLM's worker reads it inside the step):
  affinity           raylora as it ships: AdapterAffinityRouter (deployments/router.py) on
                     raylora's engine; the replicas report multiplexed ids too, which the
                     router unions into its residency view
  ray_multiplex      the peer, what a Ray Serve LLM user runs: Ray's default
                     PowerOfTwoChoicesRequestRouter, each replica reporting the adapters in its
                     CPU cache as its multiplexed model ids (`@serve.multiplexed` with
                     max_num_models_per_replica = max_cpu_loras, deployments/multiplexed_ids.py:
                     2 random replicas among the holders, else among those with the fewest ids,
                     else among all), on vLLM's adapter-cache behaviour
  ray_multiplex_raylora_engine
                     the same router on raylora's engine: the router-only comparison
  affinity_moves     affinity with the moves of the adapters that are not hot turned on
                     (max_moves 1, deployments/placement.py `rebalance`; off as it ships)
  affinity_no_tier   affinity on raylora's engine without the shared adapter tier (every
                     replica reads each adapter from disk itself)
  affinity_spread    affinity with min_load_bound 1: a replica with a request in flight counts
                     as full, so a hot adapter spreads over its homes rather than batching
  affinity_bound2    affinity with min_load_bound 2 (4 as it ships): spreading starts at a
                     replica's second request in flight
  affinity_no_idle   affinity without the idle-CPU-holder rule (idle_first False): a request
                     goes to a slot holder under the bound even where each one runs a request
  affinity_no_placement
                     affinity with no hot adapter placed on k homes (use_placement False): an
                     adapter stays on its holders and spreads only past the load bound
  affinity_always_placed
                     affinity with hot adapters placed whatever the fleet's load
                     (placement_min_load 0; as it ships, only over 1-2 in flight per replica)
  pow2_no_multiplex  Ray's default router with no ids reported: 2 random replicas (a deployment
                     without `@serve.multiplexed`; not what Ray Serve LLM runs)
Requests go to the LLMServer deployment through a DeploymentHandle with the adapter as the
multiplexed model id (the ingress's path, without the HTTP layer), from this driver, so the
router runs here. They call `complete_timed` (benchmarks/routing_timing.py: `complete` plus
the replica's times of each phase), and every run prints where its requests and its slowest
1% spent their time (to the replica, the adapter, the first token, decoding, back).

Adapter loads = slot activations (an adapter copied into one of the `max_loras` slots) +
disk loads (an adapter read from disk into a replica's CPU cache; `shared`: those fetched
from the shared adapter tier instead, raylora's arms only), from each replica's engine stats
(`LLMServer.stats()["lora"]`), counted from the end of the warm-up. Latency is the driver's
time of each request (p50 / p99). With several --runs, each policy's medians are compared.

Exit status 1 if a request fails or, outside --smoke, affinity misses the issue's bar against
ray_multiplex: fewer slot loads, fewer disk loads (or both at the minimum, one per adapter in
the trace), p99 no worse (within --p99-tolerance, for timing noise on a shared machine). One
benchmark's p99 ratio is a draw: benchmarks/routing_pairs.py pools many (--latencies-out).

The model is the tests' tiny random Llama with tiny random PEFT adapters, built once under
--workdir: routing, not the model. `--model default --adapter-rank 16 --adapter-targets
q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj` serves SmolLM2-135M-Instruct with
random adapters of the sizes users train (~20 MB each), read and loaded at a user's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.routing_arms import (  # noqa: E402
    DEFAULT_POLICIES,
    POLICIES,
    TINY_ADAPTER,
    build_assets,
    build_llm_app,
)
from benchmarks.routing_report import gc_text, report  # noqa: E402
from deployments.gc_heap import freeze_startup_heap, full_collections  # noqa: E402
from deployments.protocol import GenerateRequest, SamplingSpec  # noqa: E402
from engine import paths  # noqa: E402


def make_trace(
    num_requests: int, num_adapters: int, zipf_s: float, rate: float, seed: int
) -> list[tuple[float, str]]:
    """[(arrival time in s, adapter name)]: Poisson arrivals, adapter k has weight 1/k^s."""
    rng = random.Random(seed)
    names = [f"ad{k:02d}" for k in range(num_adapters)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_adapters)]
    t, trace = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        trace.append((t, rng.choices(names, weights)[0]))
    return trace


def replica_stats(handle, num_replicas: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """stats() of every replica (base-model calls are spread by power of two choices)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"saw only {len(seen)} of {num_replicas} replicas")
        s = handle.stats.remote().result()
        seen[s["replica_id"]] = s
    return seen


def lora_counts(stats: dict[str, dict]) -> dict[str, dict[str, int]]:
    return {
        rid: {
            "activations": int(s["lora"].get("activations", 0)),
            # reads into the CPU cache from disk; those fetched from the shared tier apart
            "disk": int(s["lora"].get("loads", 0)) - int(s["lora"].get("shared_reads", 0)),
            "shared": int(s["lora"].get("shared_reads", 0)),
        }
        for rid, s in stats.items()
    }


async def replay(
    handle, trace, max_tokens: int
) -> tuple[dict[int, float], dict[int, dict], list[str]]:
    """Send every request at its arrival time; -> ({trace index: latency in s}, {trace index:
    replica, load at arrival and phases in ms (routing_timing)}, errors)."""
    from benchmarks.routing_timing import phases

    latencies: dict[int, float] = {}
    timings: dict[int, dict] = {}
    errors: list[str] = []

    async def one(i: int, adapter: str) -> None:
        request = GenerateRequest(
            f"trace-{i}",
            SamplingSpec(max_tokens=max_tokens, ignore_eos=True, temperature=0),
            prompt=f"request {i} for {adapter}:",
        )
        start, sent = time.perf_counter(), time.time()
        try:
            call = handle.options(multiplexed_model_id=adapter).complete_timed
            out, t = await call.remote(request)
            if not out.finished:
                raise RuntimeError("unfinished output")
            latencies[i] = time.perf_counter() - start
            timings[i] = {
                "total": 1000 * latencies[i],
                "replica": t["replica"],
                "inflight": t["inflight"],
                "held": t["held"],
                "phases": phases(sent, time.time(), t),
            }
        except Exception as e:
            errors.append(f"{adapter}: {e!r}")

    start = time.perf_counter()
    tasks = []
    for i, (t, adapter) in enumerate(trace):
        delay = t - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, adapter)))
    await asyncio.gather(*tasks)
    return latencies, timings, errors


def registry_waits() -> int:
    """Answers "wait" the shared tier's registry gave so far (a replica missing an adapter
    another replica was reading); 0 with no registry."""
    import ray

    from deployments.registry import get_registry

    try:
        return int(ray.get(get_registry().shared_stats.remote(), timeout=10).get("waits", 0))
    except Exception:  # no registry (no raylora arm ran yet)
        return 0


def run_policy(policy: str, args, model: str, adapters: dict[str, str], trace) -> dict:
    from ray import serve

    from benchmarks import routing_cpu as cpu_of
    from benchmarks import routing_timing as rt

    app_name = f"bench-{policy}"
    app = build_llm_app(policy, args, model, adapters)
    serve.run(app, name=app_name, route_prefix=None)
    try:
        handle = serve.get_deployment_handle("LLMServer", app_name=app_name)
        for i in range(4 * args.replicas):  # base model only: no adapter is loaded
            spec = SamplingSpec(max_tokens=2, temperature=0)
            warm = GenerateRequest(f"warm-{i}", spec, prompt="warm up")
            handle.complete.remote(warm).result()
        before_stats = replica_stats(handle, args.replicas)
        before = lora_counts(before_stats)
        waits_before = registry_waits()
        driver_gc = full_collections()
        driver_gc_before = (driver_gc.count, driver_gc.total_ms)
        cpu_before = cpu_of.cpu_by_role()
        t0 = time.perf_counter()
        latencies, timings, errors = asyncio.run(replay(handle, trace, args.max_tokens))
        wall = time.perf_counter() - t0
        cpu = cpu_of.cpu_used(cpu_before, cpu_of.cpu_by_role())
        driver_gc_run = (
            driver_gc.count - driver_gc_before[0],
            driver_gc.total_ms - driver_gc_before[1],
        )
        after_stats = replica_stats(handle, args.replicas)
        after = lora_counts(after_stats)
        waits = registry_waits() - waits_before
    finally:
        serve.delete(app_name)
    activations = sum(after[r]["activations"] - before[r]["activations"] for r in after)
    disk = sum(after[r]["disk"] - before[r]["disk"] for r in after)
    shared = sum(after[r]["shared"] - before[r]["shared"] for r in after)
    resident = [len(s["adapters_in_cpu"]) for s in after_stats.values()]
    replica_gc = [
        (
            s["gc"]["full_collections"] - before_stats[r]["gc"]["full_collections"],
            s["gc"]["full_collection_ms_total"] - before_stats[r]["gc"]["full_collection_ms_total"],
        )
        for r, s in after_stats.items()
    ]
    lat = list(latencies.values())
    return {
        "policy": policy,
        "ok": len(latencies),
        "errors": errors,
        "activations": activations,
        "disk": disk,
        "shared": shared,
        "tier_waits": waits,
        # full garbage collections during the replay: (count, ms in all), the driver's (it
        # hosts the router) and each replica's (deployments/gc_heap.py)
        "driver_gc": driver_gc_run,
        "replica_gc": replica_gc,
        "replica_frozen": [s["gc"]["frozen_objects"] for s in after_stats.values()],
        "loads": activations + disk,
        "p50_ms": 1000 * rt.percentile(lat, 0.5),
        "p99_ms": 1000 * rt.percentile(lat, 0.99),
        "mean_ms": 1000 * statistics.fmean(lat) if lat else float("nan"),
        "cpu_cached_per_replica": resident,
        "wall_s": wall,
        "cpu_s": cpu,  # CPU seconds during the replay by role (routing_timing.cpu_by_role)
        "thread_cpu_s": cpu_of.growth(before_stats, after_stats, "thread_cpu"),  # by thread
        "batches": cpu_of.growth(before_stats, after_stats, "steps"),
        "latency_ms": {i: 1000 * x for i, x in sorted(latencies.items())},
        "timing": rt.summarize(timings) if timings else None,
        "timings": timings,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=3)
    p.add_argument("--max-cpu-loras", type=int, default=6)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--adapters", type=int, default=12)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--rate", type=float, default=15.0, help="arrivals per second")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (the tests' tiny random Llama: routing alone), 'default' "
        "(SmolLM2-135M-Instruct, as `make serve` runs it) or a model folder",
    )
    p.add_argument("--adapter-rank", type=int, default=TINY_ADAPTER[0])
    p.add_argument(
        "--adapter-targets",
        default=",".join(TINY_ADAPTER[1]),
        help="modules the random adapters adapt, comma-separated",
    )
    p.add_argument("--load-bound-c", type=float, default=None, help="affinity's c (default 1.25)")
    p.add_argument(
        "--router-kwargs",
        default="{}",
        help="affinity's other router kwargs, JSON: '{\"replan_every\": 500}'",
    )
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=", ".join(POLICIES))
    p.add_argument("--runs", type=int, default=1, help="runs of every policy, order alternating")
    p.add_argument("--p99-tolerance", type=float, default=0.1, help="p99 'no worse' within this")
    p.add_argument("--workdir", type=Path, default=paths.cache_dir() / "bench-routing")
    p.add_argument("--smoke", action="store_true", help="2 replicas, 6 adapters, 60 requests")
    p.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the start-up heap of this driver (it hosts the router) and of the replicas "
        "unfrozen: their full GCs then stall what runs there",
    )
    p.add_argument(
        "--latencies-out",
        type=Path,
        default=None,
        help="JSON: the trace (arrival s, adapter) and every run's latency and phases per request",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.replicas, args.adapters, args.requests, args.rate = 2, 6, 60, 20.0
        args.max_tokens = 4
    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in [str(REPO), os.environ.get("PYTHONPATH", "")] if x
    )
    targets = tuple(args.adapter_targets.split(","))
    model, adapters = build_assets(
        args.workdir, args.adapters, args.model, args.adapter_rank, targets
    )
    trace = make_trace(args.requests, args.adapters, args.zipf, args.rate, args.seed)
    counts: dict[str, int] = {}
    for _, a in trace:
        counts[a] = counts.get(a, 0) + 1
    print(
        f"trace: {args.requests} requests over {trace[-1][0]:.0f}s, {len(counts)} of "
        f"{args.adapters} adapters used, Zipf({args.zipf}) (top 3: "
        f"{sorted(counts.values(), reverse=True)[:3]}), {args.replicas} replicas x "
        f"{args.max_loras} slots, CPU cache {args.max_cpu_loras}"
    )

    if args.no_gc_freeze:  # Ray Serve's own freeze of each replica too (they inherit this)
        os.environ["RAY_SERVE_FREEZE_GC_ON_STARTUP"] = "0"
    # Loopback only (see tests/conftest.py); read when ray is imported.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    from benchmarks.routing_cpu import CPU_KEYS, run_cpu_text
    from benchmarks.routing_pairs import LOAD_KEYS
    from benchmarks.routing_timing import print_summary

    ray.init(
        num_cpus=max(2, args.replicas),
        include_dashboard=False,
        namespace="raylora-bench",
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    results = []
    try:
        serve.start(proxy_location="Disabled")
        if not args.no_gc_freeze:  # this process hosts the router (deployments/gc_heap.py)
            freeze_startup_heap("benchmark driver")
        for run in range(args.runs):
            # ABCD, DCBA, ...: drift over time (a busier machine) hits every policy alike
            for policy in policies if run % 2 == 0 else policies[::-1]:
                results.append({**run_policy(policy, args, model, adapters, trace), "run": run})
                r = results[-1]
                print(
                    f"  run {run + 1} {policy}: done in {r['wall_s']:.1f}s "
                    f"({r['tier_waits']} waits for another replica's read of an adapter; "
                    f"full GCs (count, ms): driver {gc_text([r['driver_gc']])}, "
                    f"replicas {gc_text(r['replica_gc'])}; objects frozen in each "
                    f"replica {r['replica_frozen']})",
                    flush=True,
                )
                print(f"  run {run + 1} {policy}: {run_cpu_text(r)}", flush=True)
                if r["timing"] is not None:
                    print_summary(policy, r["timing"])
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    if args.latencies_out is not None:
        runs = [
            {k: r[k] for k in ("policy", "run", *LOAD_KEYS, "latency_ms", "timings", *CPU_KEYS)}
            for r in results
        ]
        args.latencies_out.write_text(json.dumps({"trace": trace, "runs": runs}))
        print(f"latencies: {args.latencies_out}")
    incomplete = any(r["errors"] or r["ok"] != args.requests for r in results)
    missed = report(results, args.requests, len(counts), args.p99_tolerance)
    print("FAILED: requests did not complete" if incomplete else "all requests completed")
    return 1 if incomplete or (missed and not args.smoke) else 0


if __name__ == "__main__":
    sys.exit(main())
