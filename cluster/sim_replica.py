"""The simulator's model of one replica: its config, requests, and the engine scheduler as far
as routing cares (max_num_seqs, max_loras slots, CPU cache, oldest-admissible admission with
the drain rule, adapter loads that stall the step). See cluster/sim.py for the whole simulator.

Adapter loads, as raylora's engine does them (engine/async_llm_engine.py, model_runner.py):
- disk -> CPU cache: `AsyncLLMEngine.generate` reads a missing adapter in a worker thread when
  the request arrives, off the engine lock: steps go on, only that request waits
  (`async_disk_loads=True`). vLLM reads it inside the step instead (`async_disk_loads=False`:
  a cold load then stalls the step for disk_load_ms).
- CPU cache -> slot: `ModelRunner.execute` copies the weights before the forward, so the whole
  step waits: every running request on the replica is delayed by cpu_load_ms
  (`stall_loads=True`, as in vLLM too). An adapter the CPU cache dropped between its read and
  its admission is read again inside the step (`LoRAManager.activate`), stalling it for
  disk_load_ms.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from deployments.routing_policy import DEFAULT_LOAD_BOUND_C, DEFAULT_MIN_LOAD_BOUND, ReplicaView

EVICTIONS = ("lru", "popularity")


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
    disk_load_ms: float = 150.0  # disk (or object storage) -> CPU cache
    async_disk_loads: bool = True  # raylora: read at arrival in a worker thread; vLLM: in-step
    stall_loads: bool = True  # a slot load delays every running request (the step waits)
    # "lru" is what raylora's engine does (SlotTable, LoRAManager); "popularity" evicts the
    # idle adapter with the fewest fleet-wide requests (an engine change, simulated only)
    eviction: str = "lru"
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
    min_load_bound: int = DEFAULT_MIN_LOAD_BOUND
    seed: int = 0

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")

    def mean_service_ms_full_batch(self) -> float:
        step = self.decode_ms_per_token * (1 + self.batch_slowdown * (self.max_num_seqs - 1))
        return self.prompt_tokens * self.prefill_ms_per_token + self.output_tokens * step

    def unloaded_service_ms(self) -> float:
        """Time to first token of a mean request on an idle replica with its adapter loaded."""
        return self.prompt_tokens * self.prefill_ms_per_token

    def arrival_rate_per_ms(self) -> float:
        capacity = self.num_replicas * self.max_num_seqs / self.mean_service_ms_full_batch()
        return self.utilization * capacity


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
    stall_index: int = 0  # replica stalls recorded before this request's admission
    stall_seen: float = 0.0  # replica.stall_total when finish was last moved

    @property
    def routing_key(self) -> str:
        """What affinity routing hashes: the adapter, or a base tenant's prefix."""
        return self.adapter or (f"prefix:{self.tenant}" if self.tenant else "")


Popularity = Callable[[str], float]  # adapter -> fleet-wide request count (for eviction)


class Replica:
    """The engine scheduler of one replica, as far as routing cares."""

    def __init__(
        self,
        replica_id: str,
        cfg: SimConfig,
        check: bool,
        top: frozenset[str] = frozenset(),
        popularity: Popularity | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.top = top  # the fleet's num_replicas * max_loras most popular adapters
        self.cfg = cfg
        self.check = check
        self.popularity = popularity or (lambda _a: 0.0)
        self.num_running = 0
        self.running_by_adapter: dict[str, int] = {}  # adapter -> running requests
        self.slots: OrderedDict[str, float] = OrderedDict()  # adapter -> ready time; LRU order
        self.cpu: OrderedDict[str, float] = OrderedDict()  # adapter -> read done at; LRU order
        self.queues: dict[str, deque[Request]] = {}  # adapter -> waiting, oldest first
        self.num_waiting = 0
        self.num_served = 0
        self.slot_loads = 0
        self.top_slot_loads = 0  # slot loads of adapters in self.top: reloads the floor excludes
        self.disk_loads = 0
        # step stalls: times and the running sum of their lengths (cum[i] = sum of the first i)
        self.stall_times: list[float] = []
        self.stall_cum: list[float] = [0.0]
        self.stall_total = 0.0
        self.stall_until = 0.0  # the step being held up by loads ends then
        self.prefix_cache: OrderedDict[str, int] = OrderedDict()  # tenant -> tokens; LRU
        self.prefix_cache_size = 0
        self.prompt_tokens_seen = 0
        self.prompt_tokens_cached = 0
        self.load_area = 0.0  # integral of (running + waiting) dt
        self.running_area = 0.0  # integral of running dt
        self._last_t = 0.0
        self._view: ReplicaView | None = None
        # what routers were last told (cluster/sim.py's residency push); None = instant
        self.published: ReplicaView | None = None

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    def view(self) -> ReplicaView:
        """Exact residency now (instant knowledge)."""
        if self._view is None or self._view.load != self.load:
            # base tenants' cached prefixes count as held keys (Request.routing_key)
            held = frozenset(self.cpu).union(
                f"prefix:{t}" for t in self.prefix_cache if t.startswith("base-")
            )
            self._view = ReplicaView(self.replica_id, self.load, frozenset(self.slots), held)
        return self._view

    def reported_view(self) -> ReplicaView:
        """Residency as the routers last heard it, with the load as of now (Ray tracks
        queue lengths itself, on every send and completion)."""
        if self.published is None:
            return self.view()
        p = self.published
        if p.load != self.load:
            p = self.published = ReplicaView(
                p.replica_id, self.load, p.adapters_in_slots, p.adapters_in_cpu
            )
        return p

    def _tick(self, now: float) -> None:
        self.load_area += self.load * (now - self._last_t)
        self.running_area += self.num_running * (now - self._last_t)
        self._last_t = now

    def enqueue(self, req: Request, now: float) -> float:
        """Queue `req`; returns when it can be admitted (after an async disk read)."""
        self._tick(now)
        ready = now
        if req.adapter and self.cfg.async_disk_loads:
            if req.adapter in self.cpu:
                self.cpu.move_to_end(req.adapter)  # the engine touches it on add_request
                ready = max(now, self.cpu[req.adapter])
            else:
                self.disk_loads += 1
                ready = now + self.cfg.disk_load_ms
                self._cpu_insert(req.adapter, ready)
        self.queues.setdefault(req.adapter, deque()).append(req)
        self.num_waiting += 1
        self._view = None
        return ready

    def _cpu_insert(self, adapter: str, ready: float) -> None:
        self.cpu[adapter] = ready
        if len(self.cpu) > self.cfg.max_cpu_loras:
            idle = [a for a in self.cpu if a not in self.slots and a != adapter]
            if idle:
                del self.cpu[self._victim(idle)]

    def _victim(self, candidates: list[str]) -> str:
        """LRU first in `candidates`; with popularity eviction, the least requested of them."""
        if self.cfg.eviction == "popularity":
            return min(candidates, key=self.popularity)  # min keeps the LRU among ties
        return candidates[0]

    def _can_get_slot(self) -> bool:
        return len(self.slots) < self.cfg.max_loras or any(
            self.running_by_adapter.get(a, 0) == 0 for a in self.slots
        )

    def _acquire_slot(self, adapter: str, now: float) -> tuple[float, float]:
        """Load `adapter` into a free or idle slot: (ready time, the step's stall)."""
        cfg = self.cfg
        if len(self.slots) >= cfg.max_loras:
            idle = [a for a in self.slots if self.running_by_adapter.get(a, 0) == 0]
            del self.slots[self._victim(idle)]
        cost = cfg.cpu_load_ms
        if adapter in self.cpu and self.cpu[adapter] <= now:
            self.cpu.move_to_end(adapter)
        else:  # never read (vLLM: read in the step) or dropped since: read in the step
            self.disk_loads += 1
            self._cpu_insert(adapter, now)
            cost += cfg.disk_load_ms
        self.slot_loads += 1
        self.top_slot_loads += adapter in self.top
        if self.check:
            assert len(self.slots) < cfg.max_loras
        if not cfg.stall_loads:  # loads overlap the steps: only this adapter waits
            self.slots[adapter] = now + cost
            return now + cost, 0.0
        # the copy runs in the step, after any copy the step already waits for
        ready = self.stall_until = max(now, self.stall_until) + cost
        self.slots[adapter] = ready
        return ready, cost

    def _stall(self, now: float, ms: float) -> None:
        """The step waits `ms`: everything in flight finishes that much later."""
        if ms <= 0:
            return
        self.stall_times.append(now)
        self.stall_total += ms
        self.stall_cum.append(self.stall_total)

    def stalled(self, t_unstalled: float, since_index: int) -> float:
        """`t_unstalled` moved by the stalls after admission (index `since_index`) that
        happen before it: the fixed point of t = t_unstalled + stalls before t."""
        base = self.stall_cum[since_index]
        extra = 0.0
        while True:
            j = bisect.bisect_left(self.stall_times, t_unstalled + extra, lo=since_index)
            moved = self.stall_cum[j] - base
            if moved == extra:
                return t_unstalled + extra
            extra = moved

    def _prefix_lookup(self, req: Request) -> int:
        """Cached prompt tokens for `req`; afterwards its prefix is cached (LRU)."""
        cfg = self.cfg
        self.prompt_tokens_seen += req.prompt_tokens
        if not req.tenant or cfg.prefix_cache_tokens <= 0:
            return 0
        if req.tenant in self.prefix_cache:
            self.prefix_cache.move_to_end(req.tenant)
            # the last prompt token is always computed (the engine needs its logits)
            cached = min(req.prefix_tokens, req.prompt_tokens - 1)
            self.prompt_tokens_cached += cached
            return cached
        self.prefix_cache[req.tenant] = req.prefix_tokens
        self.prefix_cache_size += req.prefix_tokens
        while self.prefix_cache_size > cfg.prefix_cache_tokens and len(self.prefix_cache) > 1:
            _, tokens = self.prefix_cache.popitem(last=False)
            self.prefix_cache_size -= tokens
        return 0

    def _pop(self, adapter: str) -> Request:
        req = self.queues[adapter].popleft()
        self.num_waiting -= 1
        return req

    def _admissible_heads(self, now: float) -> list[tuple[int, str]]:
        """(seq, adapter) of each queue's oldest request the engine has, oldest first: a
        request whose adapter is still being read is not in the engine's queue yet."""
        cpu = self.cpu
        return sorted(
            (q[0].seq, a)
            for a, q in self.queues.items()
            if q and (not a or not self.cfg.async_disk_loads or cpu.get(a, 0.0) <= now)
        )

    def schedule(self, now: float) -> list[Request]:
        """Admit the oldest admissible waiting requests; return them with finish times set."""
        cfg = self.cfg
        self._tick(now)
        started: list[Request] = []
        while self.num_running < cfg.max_num_seqs and self.num_waiting:
            heads = self._admissible_heads(now)
            if not heads:
                break
            seq, adapter = heads[0]
            if adapter and adapter not in self.slots and not self._can_get_slot():
                # Oldest admissible among base and slot-holding adapters, unless the
                # oldest request has starved for a slot: then drain (base only).
                starving = now - self.queues[adapter][0].arrival > cfg.starvation_ms
                pick = next(
                    (a for _, a in heads if not a or (a in self.slots and not starving)), None
                )
                if pick is None:
                    break
                adapter = pick
            req = self._pop(adapter)
            ready = now
            if adapter:
                if adapter not in self.slots:
                    ready, stall = self._acquire_slot(adapter, now)
                    self._stall(now, stall)  # the running requests wait for the copy
                else:
                    self.slots.move_to_end(adapter)
                    self.cpu.move_to_end(adapter)
                    ready = max(now, self.slots[adapter], self.stall_until)
                self.running_by_adapter[adapter] = self.running_by_adapter.get(adapter, 0) + 1
            else:
                ready = max(now, self.stall_until)  # joins the step the loads hold up
            self.num_running += 1
            if self.check:
                active = sum(1 for n in self.running_by_adapter.values() if n > 0)
                assert active <= cfg.max_loras and self.num_running <= cfg.max_num_seqs
            step = cfg.decode_ms_per_token * (1 + cfg.batch_slowdown * (self.num_running - 1))
            req.cached_tokens = self._prefix_lookup(req)
            req.first = ready + (req.prompt_tokens - req.cached_tokens) * cfg.prefill_ms_per_token
            req.finish = req.first + req.output_tokens * step
            req.stall_index = len(self.stall_times)
            req.stall_seen = self.stall_total
            started.append(req)
        self._view = None
        return started

    def finish_moved(self, req: Request) -> bool:
        """Move `req`'s finish by the stalls since it was last set; True if it moved."""
        delta = self.stall_total - req.stall_seen
        if delta <= 0:
            return False
        req.finish += delta
        req.stall_seen = self.stall_total
        return True

    def complete(self, req: Request, now: float) -> None:
        self._tick(now)
        req.ttft = self.stalled(req.first, req.stall_index) - req.arrival
        self.num_running -= 1
        self.num_served += 1
        if req.adapter:
            self.running_by_adapter[req.adapter] -= 1
        self._view = None
