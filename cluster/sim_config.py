"""The simulator's configuration (SimConfig), the engines a policy runs on (ENGINES,
SYSTEM_ENGINE, engine_config) and its requests. cluster/sim_replica.py says what each
engine does with adapters."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deployments.placement import DEFAULT_MAX_MOVES
from deployments.routing_policy import DEFAULT_LOAD_BOUND_C, DEFAULT_MIN_LOAD_BOUND

EVICTIONS = ("lru", "frequency", "popularity", "shares", "clairvoyant")
# engine -> its SimConfig fields (see the module docstring)
ENGINES: dict[str, dict] = {
    "raylora": {"eviction": "frequency", "async_disk_loads": True},
    "vllm": {"eviction": "lru", "async_disk_loads": False},
    # a reference no engine can be: raylora's, evicting by the trace's future (Belady's rule)
    "clairvoyant": {"eviction": "clairvoyant", "async_disk_loads": True},
    # a reference no engine can be either: raylora's, told the adapters' true rates
    "shares": {"eviction": "shares", "async_disk_loads": True},
}
# router -> the engine of its system: raylora's routers on raylora's engine; Ray's routers on
# vLLM's, as Ray Serve LLM runs them (any router not named here: vLLM)
SYSTEM_ENGINE = {"affinity": "raylora", "affinity_hash": "raylora"}


@dataclass(slots=True)
class SimConfig:
    num_replicas: int = 16
    max_loras: int = 8  # GPU adapter slots per replica
    max_cpu_loras: int = 64  # CPU cache per replica (holds slot adapters too): ~1000/16
    max_num_seqs: int = 16  # 2 running requests per slot
    max_ongoing_requests: int = 32  # Ray's per-replica cap used when routing: 2 x max_num_seqs
    num_adapters: int = 1000
    zipf_s: float = 1.1
    base_fraction: float = 0.1  # requests for the base model (no adapter)
    num_requests: int = 50_000
    utilization: float = 0.7
    prompt_tokens: int = 512  # mean; uniform in [mean/2, 3*mean/2]
    output_tokens: int = 128  # mean; uniform in [mean/2, 3*mean/2]
    # Placeholders until calibrated against benchmarks/ (docs/routing.md says which).
    prefill_ms_per_token: float = 0.05
    decode_ms_per_token: float = 12.0  # one decode step at batch size 1
    batch_slowdown: float = 0.02  # step time grows by this fraction per extra running seq
    cpu_load_ms: float = 3.0  # CPU cache -> GPU slot
    disk_load_ms: float = 150.0  # the cold tier (local disk, or object storage) -> CPU cache
    local_read_ms: float | None = None  # a remote cold tier: local copy -> CPU cache
    async_disk_loads: bool = True  # raylora: read at arrival in a worker thread; vLLM: in-step
    # raylora's shared adapter tier (deployments/shared_adapters.py: the Ray object store, refs
    # held by the registry): once any replica read an adapter from the cold tier, raylora's
    # engine (async_disk_loads) fetches it there at this cost (~40 MB at 10 Gbit/s across
    # nodes). None: no such tier (vLLM's engine never has one).
    shared_tier_ms: float | None = 30.0
    stall_loads: bool = True  # a slot load delays every running request (the step waits)
    # which engine each policy runs on: "system" = its own system's (SYSTEM_ENGINE), a name in
    # ENGINES = that one for every policy, "config" = the eviction/async fields as set here
    engine: str = "system"
    # "lru": vLLM; "frequency": raylora (the idle adapter with the fewest decayed requests at
    # this replica); "popularity": the fewest fleet-wide requests; "shares": the smallest
    # share of the workload's law (the true rates); "clairvoyant": the one whose next request
    # in the trace comes last (the last three simulated only)
    eviction: str = "frequency"
    starvation_ms: float = 500.0
    # How routers learn residency. Ray: a replica pushes its multiplexed ids when they change,
    # checked every PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S (0.1 s), the controller broadcasts
    # them on its next loop (CONTROL_LOOP_INTERVAL_S, 0.1 s): 50-150 ms late here. 0 = instant.
    residency_push_ms: float = 100.0
    # Shared prompt prefixes (a tenant's system prompt): every adapter is a tenant with its
    # own, and base requests belong to one of num_base_tenants tenants (uniformly). 0 = none.
    system_prompt_tokens: int = 0
    num_base_tenants: int = 4
    # Each replica's prefix cache (the KV blocks of full prompt blocks, kept after a request
    # ends): how many prefix tokens it holds, LRU by tenant. 0 = no prefix caching.
    prefix_cache_tokens: int = 0
    load_bound_c: float = DEFAULT_LOAD_BOUND_C
    max_moves: int = DEFAULT_MAX_MOVES  # placement.rebalance's moves per plan (0: off)
    min_load_bound: int = DEFAULT_MIN_LOAD_BOUND
    seed: int = 0

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.engine not in ("system", "config", *ENGINES):
            raise ValueError(f"engine must be system, config or one of {list(ENGINES)}")

    def mean_service_ms_full_batch(self) -> float:
        step = self.decode_ms_per_token * (1 + self.batch_slowdown * (self.max_num_seqs - 1))
        return self.prompt_tokens * self.prefill_ms_per_token + self.output_tokens * step

    def unloaded_service_ms(self) -> float:
        """Time to first token of a mean request on an idle replica with its adapter loaded."""
        return self.prompt_tokens * self.prefill_ms_per_token

    def arrival_rate_per_ms(self) -> float:
        capacity = self.num_replicas * self.max_num_seqs / self.mean_service_ms_full_batch()
        return self.utilization * capacity


def engine_config(policy: str, cfg: SimConfig) -> tuple[str, str, SimConfig]:
    """(router, engine, the config it runs with) for a policy named "router" or
    "router@engine" (an engine named in the policy wins over cfg.engine)."""
    router, _, engine = policy.partition("@")
    if not engine:
        engine = cfg.engine if cfg.engine != "system" else SYSTEM_ENGINE.get(router, "vllm")
    if engine == "config":
        return router, engine, cfg
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} in {policy!r}; choose from {list(ENGINES)}")
    return router, engine, replace(cfg, **ENGINES[engine])


@dataclass(slots=True)
class Request:
    seq: int  # arrival order
    adapter: str  # "" = base model
    arrival: float
    prompt_tokens: int  # the system prompt (prefix_tokens) included
    output_tokens: int
    tenant: str = ""  # whose system prompt the prompt starts with ("" = none)
    prefix_tokens: int = 0
    ttft: float = -1.0
    finish: float = -1.0
    cached_tokens: int = 0  # prompt tokens the replica's prefix cache served
    first: float = -1.0  # first-token time before the stalls that come after admission
    admitted_at: float = -1.0  # when the engine admitted it (its adapter's slot held from then)
    stall_index: int = 0  # replica stalls recorded before this request's admission
    stall_seen: float = 0.0  # replica.stall_total when finish was last moved

    @property
    def routing_key(self) -> str:
        """What affinity routing hashes: the adapter, or a base tenant's prefix."""
        return self.adapter or (f"prefix:{self.tenant}" if self.tenant else "")
