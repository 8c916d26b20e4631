"""Discrete-event simulator of multi-LoRA routing over a fleet of engine replicas.

Each replica models the engine scheduler: at most `max_num_seqs` requests running, at most
`max_loras` distinct adapters among them (base requests take no slot), adapter tiers
cold tier -> CPU cache (`max_cpu_loras`) -> GPU slots. A waiting request whose adapter cannot
get a slot is skipped and keeps its place (oldest admissible request first); if the oldest
waiting request has waited `starvation_ms` for a slot, the replica drains (admits no adapter
requests) until a slot frees. Service: a request admitted with b requests running takes
prefill_tokens * prefill_ms_per_token to its first token, then output_tokens steps of
decode_ms_per_token * (1 + batch_slowdown * (b - 1)). Each policy runs on its system's engine
(cluster/sim_config.py: raylora's routers on raylora's, Ray's on vLLM's, as Ray Serve LLM
runs them), or every policy on one (`--engine`, or "router@engine"); what the two engines do
with adapters (when the read runs, what stalls the step, which adapter is evicted) is in
cluster/sim_replica.py. Simplification: the batch size (and so the step time) is fixed at
admission. cluster/sim_workload.py: the requests (Poisson arrivals, adapters by a Zipf
law); cluster/sim_floors.py: the loads no router can avoid.

With `system_prompt_tokens`, every prompt starts with its tenant's system prompt (a tenant
per adapter, plus `num_base_tenants` base tenants), and a replica with `prefix_cache_tokens`
keeps the prefixes it computed (LRU by tenant) and prefills only the rest of a prompt that
starts with one: the table's "prefix hit" is the share of prompt tokens served that way.

Routing sees exact per-replica load (running + waiting, what Ray's queue-length cache tracks)
and residency as Ray's controller broadcasts it, 50-150 ms late (`residency_push_ms`); the
policies are in cluster/sim_router.py, the acceptance sweep in cluster/sim_sweep.py.

Utilisation = arrival rate / fleet capacity, capacity = n * max_num_seqs / (service time of a
mean request at a full batch, no adapter loads).

    python -m cluster.sim --replicas 16 --slots 8 --adapters 1000 --zipf 1.1 --requests 50000
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.sim_config import ENGINES, Request, SimConfig, engine_config
from cluster.sim_floors import learner_slot_floor_per_1k, slot_load_floor
from cluster.sim_replica import NextRequest, Replica
from cluster.sim_router import POLICIES, Router
from cluster.sim_workload import adapter_name, adapter_ranks, adapter_shares, workload
from deployments.placement import AdapterPopularity
from deployments.routing_policy import DEFAULT_LOAD_BOUND_C, ReplicaView


@dataclass
class SimResult:
    policy: str
    cfg: SimConfig
    num_completed: int
    slot_loads_per_1k: float
    top_slot_loads_per_1k: float  # of those, loads of the num_replicas * max_loras top adapters
    disk_loads_per_1k: float  # reads into the CPU cache, from any tier
    cold_loads_per_1k: float  # of those, from the cold tier
    ttft_p50_ms: float
    ttft_p99_ms: float
    served_max_over_mean: float
    prefix_hit_rate: float  # prompt tokens served from the replicas' prefix caches
    queue_max_over_mean: float  # time-averaged ongoing requests, max replica / mean
    mean_running: float  # time-averaged running requests per replica (batch occupancy)
    stall_share: float  # of each replica's time, steps held up by adapter loads (mean)
    wall_s: float
    per_replica_served: list[int] = field(default_factory=list)
    # of the slot evictions, those where the adapter the eviction rule ranks last was running
    forced_eviction_share: float = 0.0
    # each replica's adapter requests in the order its engine admitted them (record_admissions)
    admitted: list[list[str]] = field(default_factory=list)
    # (admitted at, finished at, adapter) of each adapter request (record_admissions)
    holds: list[tuple[float, float, str]] = field(default_factory=list)


def _true_shares(cfg: SimConfig) -> Callable[[str], float]:
    """The replicas' popularity with "shares" eviction: the true rates (a reference)."""
    share = adapter_shares(cfg)
    return lambda adapter: share.get(adapter, 0.0)


def _percentile(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


ARRIVAL, DONE, WAKE, PUSH, BROADCAST = range(5)  # event kinds, in tie-break order


def simulate(
    policy: str, cfg: SimConfig, *, check: bool = False, record_admissions: bool = False
) -> SimResult:
    """Run one policy ("router" or "router@engine", cluster/sim_replica.py's engine_config)
    over the workload of `cfg` (same seed -> same requests). record_admissions: fill
    SimResult.admitted and SimResult.holds (cluster/sim_pooled.py's replays)."""
    t0 = time.perf_counter()
    router_name, _, cfg = engine_config(policy, cfg)
    top = frozenset(adapter_name(k) for k in range(cfg.num_replicas * cfg.max_loras))
    # fleet-wide request counts, what a registry fed by every router would hold: read by
    # the replicas only with popularity eviction; with "shares" they read the true rates
    fleet = AdapterPopularity()
    popularity = _true_shares(cfg) if cfg.eviction == "shares" else fleet.count
    shared: dict[str, float] = {}  # raylora's shared adapter tier: adapter -> in it from (ms)
    future = NextRequest(workload(cfg)) if cfg.eviction == "clairvoyant" else None
    replicas = [
        Replica(f"replica-{i:03d}", cfg, check, top, popularity, shared, future)
        for i in range(cfg.num_replicas)
    ]
    if record_admissions:
        for r in replicas:
            r.admitted = []
    router = Router(router_name, replicas, cfg)
    events: list[tuple[float, int, int, Request | None, Replica | None]] = []
    tie = itertools.count()
    arrivals = workload(cfg)
    done: list[Request] = []
    push_ms = cfg.residency_push_ms

    def push(t: float, kind: int, req: Request | None, replica: Replica | None) -> None:
        heapq.heappush(events, (t, next(tie), kind, req, replica))

    def push_arrival() -> None:
        req = next(arrivals, None)
        if req is not None:
            push(req.arrival, ARRIVAL, req, None)

    def start(replica: Replica, now: float) -> None:
        for req in replica.schedule(now):
            push(req.finish, DONE, req, replica)

    push_arrival()
    if push_ms > 0:
        for r in replicas:  # the routers start knowing nothing
            r.published = ReplicaView(r.replica_id, 0, frozenset(), frozenset())
        push(push_ms, PUSH, None, None)
    pushed: list[ReplicaView] = [r.view() for r in replicas]
    now = 0.0
    while events:
        now, _, kind, req, replica = heapq.heappop(events)
        if kind == ARRIVAL:
            fleet.record(req.adapter)
            target = router.route(req)
            ready = target.enqueue(req, now)
            if ready > now:
                push(ready, WAKE, None, target)
            start(target, now)
            push_arrival()
        elif kind == DONE:
            if replica.finish_moved(req):  # a load stalled the step meanwhile
                push(req.finish, DONE, req, replica)
                continue
            replica.complete(req, now)
            router.on_done(req)
            done.append(req)
            start(replica, now)
        elif kind == WAKE:  # an adapter read finished: its requests may start
            start(replica, now)
        elif kind == PUSH:  # each replica sends its ids; the controller passes them on later
            pushed = [r.view() for r in replicas]
            push(now + push_ms / 2, BROADCAST, None, None)
        else:
            for r, v in zip(replicas, pushed, strict=True):
                r.published = v
            if len(events) > 0:  # keep the clock while there is anything else to do
                push(now + push_ms / 2, PUSH, None, None)

    for r in replicas:
        r._tick(now)
        if check:
            assert r.num_running == 0 and r.num_waiting == 0
    ttfts = sorted(r.ttft for r in done)
    served = [r.num_served for r in replicas]
    areas = [r.load_area for r in replicas]
    n = max(1, len(done))
    return SimResult(
        policy=policy,
        cfg=cfg,
        num_completed=len(done),
        slot_loads_per_1k=1000 * sum(r.slot_loads for r in replicas) / n,
        top_slot_loads_per_1k=1000 * sum(r.top_slot_loads for r in replicas) / n,
        disk_loads_per_1k=1000 * sum(r.disk_loads for r in replicas) / n,
        cold_loads_per_1k=1000 * sum(r.cold_loads for r in replicas) / n,
        ttft_p50_ms=_percentile(ttfts, 0.50),
        ttft_p99_ms=_percentile(ttfts, 0.99),
        served_max_over_mean=max(served) / (sum(served) / len(served)),
        prefix_hit_rate=sum(r.prompt_tokens_cached for r in replicas)
        / max(1, sum(r.prompt_tokens_seen for r in replicas)),
        queue_max_over_mean=max(areas) / max(1e-9, sum(areas) / len(areas)),
        mean_running=sum(r.running_area for r in replicas) / max(1e-9, now) / len(replicas),
        stall_share=sum(r.stall_total for r in replicas) / max(1e-9, now) / len(replicas),
        wall_s=time.perf_counter() - t0,
        per_replica_served=served,
        forced_eviction_share=sum(r.forced_evictions for r in replicas)
        / max(1, sum(r.evictions for r in replicas)),
        admitted=[r.admitted or [] for r in replicas],
        holds=[(r.admitted_at, r.finish, r.adapter) for r in done if r.adapter]
        if record_admissions
        else [],
    )


def format_table(results: list[SimResult]) -> str:
    head = (
        f"{'policy':<26}{'loads/1k':>10}{'top/1k':>8}{'cold/1k':>9}{'reads/1k':>9}{'ttft p50':>10}"
        f"{'ttft p99':>10}"
        f"{'served max/mean':>17}{'prefix hit':>12}{'queue max/mean':>16}{'batch':>7}"
        f"{'stall':>7}{'wall s':>8}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.policy:<26}{r.slot_loads_per_1k:>10.1f}{r.top_slot_loads_per_1k:>8.1f}"
            f"{r.cold_loads_per_1k:>9.1f}{r.disk_loads_per_1k:>9.1f}"
            f"{r.ttft_p50_ms:>8.0f}ms{r.ttft_p99_ms:>8.0f}ms"
            f"{r.served_max_over_mean:>17.2f}{r.prefix_hit_rate:>12.1%}"
            f"{r.queue_max_over_mean:>16.2f}"
            f"{r.mean_running:>7.1f}{r.stall_share:>7.1%}{r.wall_s:>8.1f}"
        )
    return "\n".join(rows)


# Service-time presets (SimConfig fields). "cpu-measured" was measured on 2026-11-29 with the
# engine (EngineConfig(model="default"), 2 threads, quiet 2-core AMD EPYC): prefill 2.0 ms per
# token (8 x 256-token prompts in one step), decode step 68.6 ms at batch 1 and 114.3 ms at
# batch 16 (+4.5% per extra running sequence; 275 ms at batch 64 in benchmarks/
# engine_throughput.py agrees), an r=16 all-linear adapter from local disk into the CPU cache
# 23 ms, CPU cache -> slot 6 ms.
SERVICE_PRESETS: dict[str, dict[str, float]] = {
    "gpu-placeholder": {},  # SimConfig's defaults
    "cpu-measured": {
        "prefill_ms_per_token": 2.0,
        "decode_ms_per_token": 68.6,
        "batch_slowdown": 0.045,
        "cpu_load_ms": 6.0,
        "disk_load_ms": 23.0,
    },
}


# Where a cold adapter comes from (SimConfig.disk_load_ms): "local-disk" keeps the service
# preset's figure; "object-storage" is a ~100 MB adapter (r=16, all linears of a 7-8B model in
# bf16) fetched at ~50 MB/s from S3-class storage, kept on the replica's local disk afterwards
# (re-reads cost the preset's local-disk figure, SimConfig.local_read_ms).
COLD_LOAD_PRESETS: dict[str, float | None] = {"local-disk": None, "object-storage": 2000.0}


def add_config_args(ap: argparse.ArgumentParser) -> None:
    """The SimConfig flags of `python -m cluster.sim` (service, cold tier, engine, bound)."""
    ap.add_argument("--cpu-loras", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--load-bound-c", type=float, default=DEFAULT_LOAD_BOUND_C)
    ap.add_argument(
        "--service",
        choices=sorted(SERVICE_PRESETS),
        default="gpu-placeholder",
        help="service-time preset: 'cpu-measured' = raylora's engine on SmolLM2-135M on the "
        "2-core CPU (scripts in docs/routing.md); 'gpu-placeholder' = rough GPU-class times",
    )
    ap.add_argument("--cold-load", choices=sorted(COLD_LOAD_PRESETS), default="local-disk")
    ap.add_argument("--disk-load-ms", type=float, default=None, help="overrides --cold-load")
    ap.add_argument(
        "--engine",
        choices=["system", *ENGINES],
        default="system",
        help="system: each router on its own system's engine (raylora's routers on raylora's, "
        "Ray's on vLLM's, as Ray Serve LLM runs them); raylora / vllm: every policy on that "
        "one (a policy named router@engine picks its own); clairvoyant: raylora's evicting "
        "by the trace's future, shares: by the adapters' true rates (references no engine "
        "can be)",
    )
    ap.add_argument("--no-stall", action="store_true", help="slot loads do not stall the step")
    ap.add_argument(
        "--residency-push-ms",
        type=float,
        default=100.0,
        help="how often replicas push residency (Ray: 100 ms, plus a controller loop); 0 = "
        "routers know it instantly",
    )


def add_shared_tier_args(ap: argparse.ArgumentParser) -> None:
    """--shared-tier-ms and --no-shared-tier (cluster/sim.py and cluster/sim_sweep.py)."""
    ap.add_argument(
        "--shared-tier-ms",
        type=float,
        default=SimConfig().shared_tier_ms,
        help="raylora's shared adapter tier: a read of an adapter another replica already "
        "read costs this (SimConfig.shared_tier_ms)",
    )
    ap.add_argument(
        "--no-shared-tier",
        action="store_true",
        help="raylora's replicas read every adapter they lack from the cold tier (as the real "
        "app's do: its KB adapters read from disk faster than from the shared tier)",
    )


def shared_tier_from_args(args: argparse.Namespace) -> float | None:
    """SimConfig.shared_tier_ms from add_shared_tier_args' flags (None: no tier)."""
    return None if args.no_shared_tier else args.shared_tier_ms


def config_from_args(args: argparse.Namespace, **fields) -> SimConfig:
    service = dict(SERVICE_PRESETS[args.service])
    cold = COLD_LOAD_PRESETS[args.cold_load]
    if cold is not None:  # a remote tier: what was fetched is re-read from local disk
        service["local_read_ms"] = service.get("disk_load_ms", SimConfig().disk_load_ms)
        service["disk_load_ms"] = cold
    if args.disk_load_ms is not None:
        service["disk_load_ms"] = args.disk_load_ms
    return SimConfig(
        max_cpu_loras=args.cpu_loras,
        max_num_seqs=args.max_num_seqs,
        max_ongoing_requests=2 * args.max_num_seqs,
        load_bound_c=args.load_bound_c,
        engine=args.engine,
        stall_loads=not args.no_stall,
        residency_push_ms=args.residency_push_ms,
        **fields,
        **service,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8, help="max_loras per replica")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--base-fraction", type=float, default=0.1)
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-prompt-tokens", type=int, default=0, help="per-tenant prefix")
    ap.add_argument("--base-tenants", type=int, default=4)
    ap.add_argument("--prefix-cache-tokens", type=int, default=0, help="per replica; 0 = off")
    add_config_args(ap)
    add_shared_tier_args(ap)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args(argv)
    cfg = config_from_args(
        args,
        num_replicas=args.replicas,
        max_loras=args.slots,
        num_adapters=args.adapters,
        zipf_s=args.zipf,
        base_fraction=args.base_fraction,
        num_requests=args.requests,
        utilization=args.utilization,
        seed=args.seed,
        system_prompt_tokens=args.system_prompt_tokens,
        num_base_tenants=args.base_tenants,
        prefix_cache_tokens=args.prefix_cache_tokens,
        shared_tier_ms=shared_tier_from_args(args),
    )
    policies = [p for p in args.policies.split(",") if p]
    print(
        f"{cfg.num_replicas} replicas x {cfg.max_loras} slots (cpu cache {cfg.max_cpu_loras}, "
        f"max_num_seqs {cfg.max_num_seqs}), {cfg.num_adapters} adapters Zipf({cfg.zipf_s}), "
        f"{cfg.base_fraction:.0%} base, {cfg.num_requests} requests at "
        f"{cfg.utilization:.0%} utilisation ({1000 * cfg.arrival_rate_per_ms():.0f} req/s), "
        f"cold load {cfg.disk_load_ms:.0f} ms"
        + (f" (then {cfg.local_read_ms:.0f} ms from local disk)" if cfg.local_read_ms else "")
        + f", slot load {cfg.cpu_load_ms:.0f} ms"
        f" ({'stalls the step' if cfg.stall_loads else 'async'}), engines: {cfg.engine}, "
        + (
            f"shared tier {cfg.shared_tier_ms:.0f} ms"
            if cfg.shared_tier_ms is not None
            else "no shared tier"
        )
    )
    results = [simulate(p, cfg) for p in policies]
    print(format_table(results))
    floor = slot_load_floor(cfg, learner_slot_floor_per_1k(cfg, adapter_ranks(cfg)))
    print(
        f"slot-load floor for any router: {floor:.1f} loads/1k (cluster/sim_floors.py: the "
        "slots the tail's own loads keep busy, the rest to the most requested adapters; the "
        "first load of each adapter in the trace; what must be reloaded while the shares "
        "are learned); loads / floor: "
        + ", ".join(f"{r.policy} {r.slot_loads_per_1k / max(floor, 1e-9):.2f}x" for r in results)
    )


if __name__ == "__main__":
    main()
