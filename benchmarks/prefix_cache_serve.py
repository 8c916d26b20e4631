"""Prefix caching on a real Serve app: does routing keep each tenant's prefix on one replica?

    python benchmarks/prefix_cache_serve.py                # default model, issue 18 workload
    python benchmarks/prefix_cache_serve.py --model PATH --system-len 64 --num-requests 12

The workload is benchmarks/prefix_cache.py's (build_workload): --num-requests chat requests
from --num-adapters random PEFT adapters plus the base model, each tenant with its own
--system-len-token system prompt and a short user turn, exactly --output-len greedy tokens.
It is sent over HTTP (/v1/chat/completions, streamed, usage included) at --concurrency in
flight, in the workload's order, to the app (serve_app.build_app) deployed fresh for each arm:
  1 replica        the reference: every request meets every cached prefix
  N affinity       --replicas replicas, AdapterAffinityRouter: adapter requests on their
                   adapter's replica, base requests with a long prompt on their prefix key's
  N pow2           --replicas replicas, Ray Serve's default router (power of two choices),
                   for contrast: nothing keeps a tenant on one replica
The prefix hit rate of an arm is usage.prompt_tokens_details.cached_tokens summed over its
requests / prompt tokens summed (the replicas' prefix_cache_hits / queries are printed too).
Arms run --alternations times, in reversed order every other time. Target (issue 18): the
N-replica affinity hit rate >= 0.9x the single replica's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ALL_LINEARS, log, machine, make_random_adapters, verdict  # noqa: E402
from benchmarks.prefix_cache import add_workload_args, build_workload, percentile  # noqa: E402

HIT_RATE_TARGET = 0.9  # N-replica affinity hit rate / single-replica hit rate, at least
APP = "prefix-bench"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(p)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--alternations", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="per replica")
    return p.parse_args(argv)


async def send_all(url: str, reqs, concurrency: int) -> list[dict]:
    """Every request, streamed, at most `concurrency` in flight; -> per request: ttft_s,
    latency_s, prompt_tokens, cached_tokens, text (or error)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)

    async def one(http, r) -> dict:
        body = {
            "model": r.lora_name or "base",
            "messages": r.messages,
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate:
            start = time.perf_counter()
            rec = {"ttft_s": None, "text": "", "usage": None, "error": None}
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    rec["error"] = f"{resp.status_code} {(await resp.aread())[:200]!r}"
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        rec["error"] = str(chunk["error"])
                    for c in chunk.get("choices", []):
                        if c["delta"].get("content") and rec["ttft_s"] is None:
                            rec["ttft_s"] = time.perf_counter() - start
                        rec["text"] += c["delta"].get("content") or ""
                    rec["usage"] = chunk.get("usage") or rec["usage"]
            rec["latency_s"] = time.perf_counter() - start
            return rec

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        return await asyncio.gather(*(one(http, r) for r in reqs))


def run_arm(arm: str, args, url: str, model: str, adapters: dict[str, str], reqs, warm) -> dict:
    """One fresh deployment: warm (every adapter once), then reqs; -> the arm's figures."""
    from ray import serve

    import serve_app
    from tests.serve_fixtures import replica_stats

    num_replicas = 1 if arm == "1 replica" else args.replicas
    app = serve_app.build_app(
        {
            "model": model,
            "served_model_name": "base",
            "adapters": adapters,
            "num_replicas": num_replicas,
            "num_cpus": 0.5,
            "router": "pow2" if arm.endswith("pow2") else "affinity",
            "max_loras": max(1, args.num_adapters),
            "max_lora_rank": args.rank,
            "max_cpu_loras": max(1, args.num_adapters),
            "max_num_seqs": 64,
            "kv_cache_memory_gb": args.kv_cache_gb,
            "routing_stats_period_s": 1.0,
            "report_interval_s": 1.0,
        }
    )
    serve.run(app, name=APP, route_prefix="/")
    try:
        asyncio.run(send_all(url, warm, len(warm)))
        before = replica_stats(APP, num_replicas)
        t0 = time.perf_counter()
        recs = asyncio.run(send_all(url, reqs, args.concurrency))
        wall = time.perf_counter() - t0
        after = replica_stats(APP, num_replicas)
    finally:
        serve.delete(APP)
    ok = [r for r in recs if r["error"] is None and r["usage"] is not None]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
    hits = sum(after[k]["prefix_cache_hits"] - before[k]["prefix_cache_hits"] for k in after)
    queries = sum(
        after[k]["prefix_cache_queries"] - before[k]["prefix_cache_queries"] for k in after
    )
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "arm": arm,
        "ok": len(ok),
        "errors": [r["error"] for r in recs if r["error"] is not None],
        "hit_rate": cached / max(1, prompt),
        "replica_hit_rate": hits / max(1, queries),
        "ttft_p50": percentile(ttft, 50) if ttft else float("nan"),
        "ttft_p99": percentile(ttft, 99) if ttft else float("nan"),
        "wall_s": wall,
        "texts": [r["text"] for r in recs],
    }


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import ray
    from ray import serve

    from engine.models.loader import resolve_model
    from tests.serve_fixtures import free_port

    path = str(resolve_model(args.model))
    port = free_port()
    ray.init(
        include_dashboard=False, _node_ip_address="127.0.0.1", namespace="prefix-bench",
        log_to_driver=False,
    )  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory(prefix="raylora-bench-") as tmp:
            n = args.num_adapters
            paths = make_random_adapters(
                Path(path), Path(tmp), n, args.rank, ALL_LINEARS, args.seed
            )
            adapters = {f"pc-lora-{t}": str(p) for t, p in enumerate(paths)}
            tokenizer = _tokenizer(path)
            reqs = build_workload(
                tokenizer, args.num_requests, n, args.system_len, tuple(args.user_words),
                args.output_len, args.seed, list(adapters),
            )  # fmt: skip
            # every adapter once, with other system prompts: the caches start cold
            warm = build_workload(
                tokenizer, n + 1, n, 32, output_len=2, seed=args.seed + 1,
                lora_names=list(adapters),
            )  # fmt: skip
            log(f"machine: {machine()}")
            log(
                f"workload: {len(reqs)} chat requests, {n} adapters (rank {args.rank}) + base, "
                f"system prompts {args.system_len} tokens, {args.output_len} output tokens, "
                f"{args.concurrency} in flight; model {path}"
            )
            arms = ["1 replica", f"{args.replicas} affinity", f"{args.replicas} pow2"]
            results: dict[str, list[dict]] = {a: [] for a in arms}
            for i in range(args.alternations):
                for arm in arms if i % 2 == 0 else arms[::-1]:
                    r = run_arm(arm, args, url, path, adapters, reqs, warm)
                    results[arm].append(r)
                    log(
                        f"  {i + 1} {arm:12s} hit rate {r['hit_rate']:.3f} (replicas "
                        f"{r['replica_hit_rate']:.3f}), TTFT p50 {r['ttft_p50']:.2f} s "
                        f"p99 {r['ttft_p99']:.2f} s, {r['ok']}/{len(reqs)} ok, {r['wall_s']:.0f} s"
                    )
    finally:
        serve.shutdown()
        ray.shutdown()
    return report(results, arms, len(reqs))


def report(results: dict[str, list[dict]], arms: list[str], num_requests: int) -> dict:
    med = {a: {k: statistics.median(r[k] for r in rs) for k in ("hit_rate", "ttft_p50", "ttft_p99")}
           for a, rs in results.items()}  # fmt: skip
    log()
    log(f"{'arm':14s}{'hit rate':>10s}{'vs 1':>8s}{'TTFT p50':>10s}{'TTFT p99':>10s}")
    ref = med[arms[0]]["hit_rate"]
    for a in arms:
        m = med[a]
        ratio = m["hit_rate"] / ref if ref else float("nan")
        log(f"{a:14s}{m['hit_rate']:10.3f}{ratio:7.2f}x{m['ttft_p50']:9.2f}s{m['ttft_p99']:9.2f}s")
    ratio = med[arms[1]]["hit_rate"] / ref if ref else float("nan")
    texts = [r["texts"] for rs in results.values() for r in rs]
    same = sum(all(t[i] == texts[0][i] for t in texts) for i in range(num_requests))
    errors = [e for rs in results.values() for r in rs for e in r["errors"]]
    log(f"greedy outputs identical across every arm and run: {same}/{num_requests}")
    log(f"failed requests: {len(errors)}{'  ' + errors[0] if errors else ''}")
    log(
        f"ratio {arms[1]} / {arms[0]} hit rate: {ratio:.2f}x  {verdict(ratio, HIT_RATE_TARGET, True)}"
    )
    return {"medians": med, "hit_rate_ratio": ratio, "identical": same, "errors": errors}


if __name__ == "__main__":
    out = main()
    sys.exit(1 if out["errors"] or not out["hit_rate_ratio"] >= HIT_RATE_TARGET else 0)
