"""Soak test: mixed traffic against a running app while it is being broken, then a verdict.

    python benchmarks/soak.py                      # starts the default app here (2 replicas)
    python benchmarks/soak.py --url http://host:8000 --ray-address auto   # any running app

Traffic: `--requests` requests (2,000) over `--adapters` adapters (100, loaded through the
API at the start; Zipf popularity) plus a share of base-model requests, half of them
streaming, at most `--concurrency` (64) at once, bounded by `--time-limit-s`. Meanwhile
(benchmarks/soak_faults.py): adapters are unloaded and new ones loaded, some streaming
clients hang up mid-stream, one LLMServer replica is killed and the AdapterRegistry is
killed. Everything stays on loopback when the app is local.

It prints completed / lost / 5xx / 4xx by cause, how every stream ended, p50/p99 latency
and each fault's recovery time, and exits 1 on: a non-streaming request lost, a 5xx
outside a kill window, a stream that ended with neither [DONE] nor an error event, a
replica recovery of 30 s or more, a registry recovery of 5 s or more, or an adapter the
registry restart resurrected or lost. `--json` writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local Ray on loopback
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.soak_faults import FaultRecord, churn, kill_registry, kill_replica  # noqa: E402
from engine.paths import adapters_dir, cache_dir  # noqa: E402

APP = "raylora"
PROMPTS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "List three colours.",
    "Say hello to a friend.",
    "Describe a cat in a few words.",
]
KILL_GRACE_S = 2.0  # requests that end this soon after a recovery still count as in its window
MAX_REPLICA_RECOVERY_S, MAX_REGISTRY_RECOVERY_S = 30.0, 5.0


@dataclass
class Result:
    start: float
    end: float
    stream: bool
    status: int | None  # None: no HTTP response at all
    outcome: str  # ok | lost | http_<status>:<code> | error_event | truncated | disconnected


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app (default: start one here)")
    p.add_argument("--ray-address", help="its Ray cluster, for the replica/registry kills")
    p.add_argument("--model", default="default", help="model of the local app")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--base-share", type=float, default=0.1)
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--disconnect-share", type=float, default=0.05, help="of the streams")
    p.add_argument("--max-tokens", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    p.add_argument("--churn", type=int, default=5, help="adapters unloaded and replaced")
    p.add_argument("--faults", default="churn,disconnect,replica,registry")
    p.add_argument("--time-limit-s", type=float, default=1800.0)
    p.add_argument("--adapter-dir", help="where the soak's adapters are (made if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the app and its adapters


def make_adapters(model: str, folder: Path, num: int) -> list[Path]:
    """`num` rank-8 q/v PEFT adapters for `model` (made once, kept in `folder`)."""
    from benchmarks.common import make_random_adapters
    from engine.models.loader import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"bench-lora-{i}" for i in range(num)]
    if not all((p / "adapter_config.json").is_file() for p in paths):
        make_random_adapters(resolve_model(model), folder, num, 8, ["q_proj", "v_proj"], seed=7)
    return paths


def start_local_app(args, adapter_dir: Path) -> str:
    """The default app's configuration (serve_app's), on a local Ray on loopback."""
    import ray
    from ray import serve

    import serve_app
    from tests.serve_fixtures import free_port

    port = free_port()
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", namespace="soak")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = {
        **serve_app._default_args(),
        "model": args.model,
        "num_replicas": str(args.replicas),
        "adapter_roots": [str(adapter_dir), str(adapters_dir())],
        "report_interval_s": "1",
        "routing_stats_period_s": "1",
    }
    serve.run(serve_app.build_app(config), name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------- traffic


async def one_request(http, rng, live, base, i, args, disconnect) -> Result:
    stream = rng.random() < args.stream_share
    model = base
    if live and rng.random() >= args.base_share:
        weights = [1.0 / (k + 1) ** args.zipf for k in range(len(live))]
        model = rng.choices(live, weights)[0]
    body = {
        "model": model,
        "prompt": f"{rng.choice(PROMPTS)} ({i})",
        "max_tokens": rng.randint(*args.max_tokens),
        "temperature": rng.choice([0.0, 0.7]),
        "stream": stream,
    }
    hang_up = stream and disconnect and rng.random() < args.disconnect_share
    start = time.monotonic()
    try:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            return Result(start, time.monotonic(), False, r.status_code, _outcome(r))
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Result(start, time.monotonic(), True, r.status_code, _outcome(r))
            outcome = "truncated"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    outcome = "ok" if outcome == "truncated" else outcome
                    break
                if '"error"' in data and "error" in json.loads(data):
                    outcome = "error_event"
                elif hang_up:
                    return Result(start, time.monotonic(), True, 200, "disconnected")
            return Result(start, time.monotonic(), True, 200, outcome)
    except (httpx.HTTPError, OSError) as e:
        return Result(start, time.monotonic(), stream, None, f"lost:{type(e).__name__}")


def _outcome(r: httpx.Response) -> str:
    if r.status_code == 200:
        return "ok"
    try:
        code = r.json()["error"].get("code")
    except Exception:
        code = "no_error_json"
    return f"http_{r.status_code}:{code}"


async def run(args) -> dict:
    rng = random.Random(args.seed)
    faults = set(args.faults.split(",")) if args.faults else set()
    adapter_dir = Path(args.adapter_dir or cache_dir() / "soak-adapters")
    local = args.url is None
    if local:
        paths = make_adapters(args.model, adapter_dir, args.adapters + args.churn)
        url = start_local_app(args, adapter_dir)
    else:
        url = args.url
        if args.ray_address:
            import ray

            ray.init(address=args.ray_address, namespace="soak")
        paths = [adapter_dir / f"bench-lora-{i}" for i in range(args.adapters + args.churn)]
    can_kill = local or args.ray_address is not None
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        base = (await http.get("/v1/models")).json()["data"][0]["id"]
        load_start = time.monotonic()
        live = []
        for i, path in enumerate(paths[: args.adapters]):
            name = f"soak-{i}"
            r = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            )
            if r.status_code != 200:
                raise SystemExit(f"loading {name} from {path}: {r.status_code} {r.text}")
            live.append(name)
        load_s = time.monotonic() - load_start
        print(
            f"loaded {len(live)} adapters in {load_s:.1f} s; {args.requests} requests, "
            f"concurrency {args.concurrency}, faults {sorted(faults)}",
            flush=True,
        )
        results: list[Result] = []
        records: list[FaultRecord] = []
        unloaded: set[str] = set()
        sem = asyncio.Semaphore(args.concurrency)
        deadline = time.monotonic() + args.time_limit_s

        async def worker(i: int) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    return
                results.append(
                    await one_request(http, rng, live, base, i, args, "disconnect" in faults)
                )
                if len(results) % max(1, args.requests // 10) == 0:
                    print(f"  {len(results)}/{args.requests} done", flush=True)

        async def fault_plan() -> None:
            plan = []  # (share of requests done, action)
            if "churn" in faults:
                plan += [
                    (0.1 + 0.8 * k / max(1, args.churn), ("churn", k)) for k in range(args.churn)
                ]
            if "replica" in faults and can_kill:
                plan.append((0.3, ("replica", 0)))
            if "registry" in faults and can_kill:
                plan.append((0.6, ("registry", 0)))
            for share, (kind, k) in sorted(plan):
                while len(results) < share * args.requests and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if kind == "churn":
                    name = f"soak-new-{k}"
                    rec = await churn(http, live, name, str(paths[args.adapters + k]))
                    unloaded.add(rec.detail["unloaded"])
                elif kind == "replica":
                    rec = await kill_replica(APP, args.replicas)
                else:
                    rec = await kill_registry(set(unloaded))
                print(f"  fault {rec.kind}: recovered in {rec.recovery_s}", flush=True)
                records.append(rec)

        t0 = time.monotonic()
        plan_task = asyncio.create_task(fault_plan())
        await asyncio.gather(*(worker(i) for i in range(args.requests)))
        await plan_task
        wall_s = time.monotonic() - t0
    return report(results, records, wall_s, load_s, args)


# ---------------------------------------------------------------- the verdict


def report(results: list[Result], records: list[FaultRecord], wall_s, load_s, args) -> dict:
    kills = [r for r in records if r.kind in ("replica", "registry")]

    def in_kill_window(x: Result) -> bool:
        return any(k.covers(x.start, x.end, KILL_GRACE_S) for k in kills)

    def count(pred) -> int:
        return sum(1 for x in results if pred(x))

    by_cause: dict[str, int] = {}
    for x in results:
        if x.status is not None and 400 <= x.status < 500:
            by_cause[x.outcome] = by_cause.get(x.outcome, 0) + 1
    latencies = sorted(x.end - x.start for x in results if x.outcome == "ok")

    def pct(q: float) -> float | None:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    rep = {
        "requests": len(results),
        "wall_s": round(wall_s, 1),
        "adapter_load_s": round(load_s, 1),
        "completed": count(lambda x: x.outcome == "ok"),
        "lost_non_streaming": count(lambda x: not x.stream and x.status is None),
        "lost_streaming": count(lambda x: x.stream and x.status is None),
        "5xx": count(lambda x: x.status is not None and x.status >= 500),
        "5xx_outside_kill_windows": count(
            lambda x: x.status is not None and x.status >= 500 and not in_kill_window(x)
        ),
        "4xx_by_cause": by_cause,
        "streams": {
            o: count(lambda x, o=o: x.stream and x.outcome == o)
            for o in ("ok", "error_event", "truncated", "disconnected")
        },
        "stream_errors_outside_kill_windows": count(
            lambda x: (
                x.stream and x.outcome in ("error_event", "truncated") and not in_kill_window(x)
            )
        ),
        "latency_p50_s": pct(0.5),
        "latency_p99_s": pct(0.99),
        "faults": [{"kind": r.kind, "recovery_s": r.recovery_s, **r.detail} for r in records],
    }
    failures = []
    if rep["lost_non_streaming"]:
        failures.append(f"{rep['lost_non_streaming']} non-streaming requests lost")
    if rep["5xx_outside_kill_windows"]:
        failures.append(f"{rep['5xx_outside_kill_windows']} 5xx outside the kill windows")
    if rep["streams"]["truncated"]:
        failures.append(f"{rep['streams']['truncated']} streams ended without [DONE] or an error")
    for r in records:
        limit = {"replica": MAX_REPLICA_RECOVERY_S, "registry": MAX_REGISTRY_RECOVERY_S}.get(r.kind)
        if limit is not None and (r.recovery_s is None or r.recovery_s >= limit):
            failures.append(f"{r.kind} recovery {r.recovery_s} s (limit {limit} s)")
        if r.detail.get("resurrected") or r.detail.get("lost"):
            failures.append(
                f"registry restart: resurrected {r.detail['resurrected']}, lost {r.detail['lost']}"
            )
    rep["failures"] = failures
    return rep


def print_report(rep: dict) -> None:
    print(
        f"\n{rep['requests']} requests in {rep['wall_s']} s "
        f"(adapters loaded in {rep['adapter_load_s']} s)"
    )
    for key in (
        "completed",
        "lost_non_streaming",
        "lost_streaming",
        "5xx",
        "5xx_outside_kill_windows",
        "stream_errors_outside_kill_windows",
    ):
        print(f"  {key:36s} {rep[key]}")
    print(f"  {'4xx by cause':36s} {rep['4xx_by_cause']}")
    print(f"  {'streams ended':36s} {rep['streams']}")
    p50, p99 = rep["latency_p50_s"], rep["latency_p99_s"]
    if p50 is not None:
        print(f"  {'latency p50 / p99':36s} {p50:.2f} s / {p99:.2f} s")
    for f in rep["faults"]:
        rec = f["recovery_s"]
        extra = {k: v for k, v in f.items() if k not in ("kind", "recovery_s")}
        print(
            f"  fault {f['kind']:10s} recovery {rec if rec is None else round(rec, 2)} s  {extra}"
        )
    print("PASS" if not rep["failures"] else "FAIL: " + "; ".join(rep["failures"]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        rep = asyncio.run(run(args))
    finally:
        if args.url is None:
            from tests.serve_fixtures import stop_ray

            stop_ray()
    print_report(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return rep


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
