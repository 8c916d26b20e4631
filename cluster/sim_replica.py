"""The simulator's model of one replica: its config, requests, and the engine scheduler as far
as routing cares (max_num_seqs, max_loras slots, CPU cache, oldest-admissible admission with
the drain rule). See cluster/sim.py for the whole simulator."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass

from deployments.routing_policy import DEFAULT_MIN_LOAD_BOUND, ReplicaView


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
    disk_load_ms: float = 150.0  # disk -> CPU cache -> GPU slot
    starvation_ms: float = 500.0
    # Shared prompt prefixes (a tenant's system prompt): every adapter is a tenant with its
    # own, and base requests belong to one of num_base_tenants tenants (uniformly). 0 = none.
    system_prompt_tokens: int = 0
    num_base_tenants: int = 4
    # Each replica's prefix cache (the KV blocks of full prompt blocks, kept after a request
    # ends): how many prefix tokens it holds, LRU by tenant. 0 = no prefix caching.
    prefix_cache_tokens: int = 0
    load_bound_c: float = 1.25
    min_load_bound: int = DEFAULT_MIN_LOAD_BOUND
    seed: int = 0

    def mean_service_ms_full_batch(self) -> float:
        step = self.decode_ms_per_token * (1 + self.batch_slowdown * (self.max_num_seqs - 1))
        return self.prompt_tokens * self.prefill_ms_per_token + self.output_tokens * step

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

    @property
    def routing_key(self) -> str:
        """What affinity routing hashes: the adapter, or a base tenant's prefix."""
        return self.adapter or (f"prefix:{self.tenant}" if self.tenant else "")


class Replica:
    """The engine scheduler of one replica, as far as routing cares."""

    def __init__(
        self, replica_id: str, cfg: SimConfig, check: bool, top: frozenset[str] = frozenset()
    ) -> None:
        self.replica_id = replica_id
        self.top = top  # the fleet's num_replicas * max_loras most popular adapters
        self.cfg = cfg
        self.check = check
        self.num_running = 0
        self.running_by_adapter: dict[str, int] = {}  # adapter -> running requests
        self.slots: OrderedDict[str, float] = OrderedDict()  # adapter -> ready time; LRU order
        self.cpu: OrderedDict[str, None] = OrderedDict()  # LRU
        self.queues: dict[str, deque[Request]] = {}  # adapter -> waiting, oldest first
        self.heads: list[tuple[int, str]] = []  # (seq of a queue head, adapter); lazy
        self.num_waiting = 0
        self.num_served = 0
        self.slot_loads = 0
        self.top_slot_loads = 0  # slot loads of adapters in self.top: reloads the floor excludes
        self.disk_loads = 0
        self.prefix_cache: OrderedDict[str, int] = OrderedDict()  # tenant -> tokens; LRU
        self.prefix_cache_size = 0
        self.prompt_tokens_seen = 0
        self.prompt_tokens_cached = 0
        self.load_area = 0.0  # integral of (running + waiting) dt
        self.running_area = 0.0  # integral of running dt
        self._last_t = 0.0
        self._view: ReplicaView | None = None

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    def view(self) -> ReplicaView:
        if self._view is None or self._view.load != self.load:
            # base tenants' cached prefixes count as held keys (Request.routing_key)
            held = frozenset(self.cpu).union(
                f"prefix:{t}" for t in self.prefix_cache if t.startswith("base-")
            )
            self._view = ReplicaView(self.replica_id, self.load, frozenset(self.slots), held)
        return self._view

    def _tick(self, now: float) -> None:
        self.load_area += self.load * (now - self._last_t)
        self.running_area += self.num_running * (now - self._last_t)
        self._last_t = now

    def enqueue(self, req: Request, now: float) -> None:
        self._tick(now)
        q = self.queues.setdefault(req.adapter, deque())
        if not q:
            heapq.heappush(self.heads, (req.seq, req.adapter))
        q.append(req)
        self.num_waiting += 1
        self._view = None

    def _oldest(self) -> tuple[int, str] | None:
        while self.heads:
            seq, adapter = self.heads[0]
            q = self.queues.get(adapter)
            if q and q[0].seq == seq:
                return seq, adapter
            heapq.heappop(self.heads)
        return None

    def _can_get_slot(self) -> bool:
        return len(self.slots) < self.cfg.max_loras or any(
            self.running_by_adapter.get(a, 0) == 0 for a in self.slots
        )

    def _acquire_slot(self, adapter: str, now: float) -> float:
        """Load `adapter` into a free or idle slot; return when it is ready."""
        cfg = self.cfg
        if len(self.slots) >= cfg.max_loras:
            idle = next(a for a in self.slots if self.running_by_adapter.get(a, 0) == 0)
            del self.slots[idle]
        if adapter in self.cpu:
            self.cpu.move_to_end(adapter)
            ready = now + cfg.cpu_load_ms
        else:
            self.disk_loads += 1
            self.cpu[adapter] = None
            if len(self.cpu) > cfg.max_cpu_loras:
                victim = next(a for a in self.cpu if a not in self.slots and a != adapter)
                del self.cpu[victim]
            ready = now + cfg.disk_load_ms
        self.slot_loads += 1
        self.top_slot_loads += adapter in self.top
        self.slots[adapter] = ready
        if self.check:
            assert len(self.slots) <= cfg.max_loras
        return ready

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
        q = self.queues[adapter]
        req = q.popleft()
        if q:
            heapq.heappush(self.heads, (q[0].seq, adapter))
        self.num_waiting -= 1
        return req

    def schedule(self, now: float) -> list[Request]:
        """Admit the oldest admissible waiting requests; return them with finish times set."""
        cfg = self.cfg
        self._tick(now)
        started: list[Request] = []
        while self.num_running < cfg.max_num_seqs and self.num_waiting:
            oldest = self._oldest()
            assert oldest is not None
            seq, adapter = oldest
            if adapter and adapter not in self.slots and not self._can_get_slot():
                # Oldest admissible among base and slot-holding adapters, unless the
                # oldest request has starved for a slot: then drain (base only).
                starving = now - self.queues[adapter][0].arrival > cfg.starvation_ms
                pick = None
                for a in ("", *self.slots) if not starving else ("",):
                    q = self.queues.get(a)
                    if q and (pick is None or q[0].seq < pick[0]):
                        pick = (q[0].seq, a)
                if pick is None:
                    break
                adapter = pick[1]
            req = self._pop(adapter)
            ready = now
            if adapter:
                if adapter not in self.slots:
                    ready = self._acquire_slot(adapter, now)
                else:
                    self.slots.move_to_end(adapter)
                    self.cpu.move_to_end(adapter)
                    ready = max(now, self.slots[adapter])
                self.running_by_adapter[adapter] = self.running_by_adapter.get(adapter, 0) + 1
            self.num_running += 1
            if self.check:
                active = sum(1 for n in self.running_by_adapter.values() if n > 0)
                assert active <= cfg.max_loras and self.num_running <= cfg.max_num_seqs
            step = cfg.decode_ms_per_token * (1 + cfg.batch_slowdown * (self.num_running - 1))
            req.cached_tokens = self._prefix_lookup(req)
            first = ready + (req.prompt_tokens - req.cached_tokens) * cfg.prefill_ms_per_token
            req.ttft = first - req.arrival
            req.finish = first + req.output_tokens * step
            started.append(req)
        self._view = None
        return started

    def complete(self, req: Request, now: float) -> None:
        self._tick(now)
        self.num_running -= 1
        self.num_served += 1
        if req.adapter:
            self.running_by_adapter[req.adapter] -= 1
        self._view = None
