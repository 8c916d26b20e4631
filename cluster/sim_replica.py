"""The simulator's model of one replica: the engine scheduler as far as routing cares (max_num_seqs, max_loras slots, CPU cache, oldest-admissible admission with
the drain rule, adapter loads that stall the step). See cluster/sim.py for the whole simulator.

Two engines (`ENGINES`), each the one its router ships with (`SYSTEM_ENGINE`):
- raylora (deployments/llm_server.py, engine/async_llm_engine.py, scheduler.py, lora/manager.py):
  the replica reads an adapter missing from the CPU cache in a worker thread when the request
  arrives (`AsyncLLMEngine.add_lora`), off the engine lock: steps go on, only that request
  waits (`async_disk_loads=True`; a read measured quicker than a GIL switch interval is
  made under the lock, LoRAManager.quick_read, but the reads modelled here take 150 ms or
  more). Slots and CPU cache evict the idle adapter this replica was
  asked for least (its decayed request counts, `eviction="frequency"`), LRU among ties.
- vLLM under Ray Serve LLM: the adapter is read into vLLM's CPU cache inside the engine step,
  stalling it (`async_disk_loads=False`); slots and CPU cache are LRU (`eviction="lru"`).
  From object storage, Ray Serve LLM's multiplex loader downloads the adapter to local disk
  first, off the step (the request waits); vLLM then reads the local copy in the step.
Both: the CPU cache -> slot copy runs inside the step, before the forward, so every running
request waits for it (`stall_loads=True`). An adapter the CPU cache dropped between its read
and its admission is read again inside the step.

raylora's engine reads an adapter some replica already read from the cold tier out of the
fleet's shared tier instead (`shared_tier_ms`, deployments/shared_adapters.py); vLLM's never
does. The model keeps every adapter there (the app's tier is LRU under a byte budget).

Tiers: slots <- CPU cache <- cold tier (`disk_load_ms`). With a remote cold tier
(`local_read_ms` set: object storage), each replica keeps what it fetched on local disk (Ray
Serve LLM's LoraModelLoader disk cache, the Hugging Face cache for raylora), and a CPU-cache
miss of a local copy costs `local_read_ms`. Cold loads count reads from the cold tier.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import replace

from cluster.sim_config import Request, SimConfig
from deployments.placement import EVICTION_HALF_LIFE, AdapterPopularity
from deployments.routing_policy import ReplicaView

Popularity = Callable[[str], float]  # adapter -> fleet-wide request count (for eviction)


class NextRequest:
    """When each adapter is next asked for, from the whole trace: what clairvoyant eviction
    (Belady's rule, `eviction="clairvoyant"`) ranks by. No engine knows this; the simulator
    uses it as a reference for how much any eviction could gain."""

    def __init__(self, trace: Iterable[Request]) -> None:
        self.arrivals: dict[str, list[float]] = {}
        for req in trace:  # in arrival order
            if req.adapter:
                self.arrivals.setdefault(req.adapter, []).append(req.arrival)

    def after(self, adapter: str, now: float) -> float:
        """The arrival time of `adapter`'s first request after `now` (inf: none)."""
        times = self.arrivals.get(adapter, ())
        i = bisect.bisect_right(times, now)
        return times[i] if i < len(times) else float("inf")


class Replica:
    """The engine scheduler of one replica, as far as routing cares."""

    def __init__(
        self,
        replica_id: str,
        cfg: SimConfig,
        check: bool,
        top: frozenset[str] = frozenset(),
        popularity: Popularity | None = None,
        shared: dict[str, float] | None = None,
        next_request: NextRequest | None = None,
    ) -> None:
        """shared: the fleet's shared tier (cfg.shared_tier_ms), one dict for all replicas;
        next_request: the trace's future (clairvoyant eviction only)."""
        if cfg.eviction == "clairvoyant" and next_request is None:
            raise ValueError("clairvoyant eviction needs the trace's future (next_request)")
        self.next_request = next_request
        self.replica_id = replica_id
        self.shared = shared if shared is not None else {}
        self.top = top  # the fleet's num_replicas * max_loras most popular adapters
        self.cfg = cfg
        self.check = check
        self.popularity = popularity or (lambda _a: 0.0)
        # this replica's own decayed request counts (what its engine sees): frequency eviction
        self.local = AdapterPopularity(EVICTION_HALF_LIFE)
        self.num_running = 0
        self.running_by_adapter: dict[str, int] = {}  # adapter -> running requests
        self.slots: OrderedDict[str, float] = OrderedDict()  # adapter -> ready time; LRU order
        self.cpu: OrderedDict[str, float] = OrderedDict()  # adapter -> read done at; LRU order
        self.queues: dict[str, deque[Request]] = {}  # adapter -> waiting, oldest first
        self.num_waiting = 0
        self.num_served = 0
        self.slot_loads = 0
        self.evictions = 0  # slot loads that evicted an adapter
        # of those, where the adapter the eviction rule ranks last was running (not evictable)
        self.forced_evictions = 0
        self.admitted: list[str] | None = None  # adapters in admission order, if recorded
        self.top_slot_loads = 0  # slot loads of adapters in self.top: reloads the floor excludes
        self.disk_loads = 0  # reads into the CPU cache, from any tier
        self.cold_loads = 0  # of those, from the cold tier (all of them without a local tier)
        self.on_disk: dict[str, float] = {}  # remote tier: adapter -> its local copy is ready at
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
            self._view = ReplicaView(
                self.replica_id,
                self.load,
                frozenset(self.slots),
                held,
                reads_shared=self.cfg.async_disk_loads and self.cfg.shared_tier_ms is not None,
            )
        return self._view

    def reported_view(self) -> ReplicaView:
        """Residency as the routers last heard it, with the load as of now (Ray tracks
        queue lengths itself, on every send and completion)."""
        if self.published is None:
            return self.view()
        p = self.published
        if p.load != self.load:
            p = self.published = replace(p, load=self.load)
        return p

    def _tick(self, now: float) -> None:
        self.load_area += self.load * (now - self._last_t)
        self.running_area += self.num_running * (now - self._last_t)
        self._last_t = now

    def enqueue(self, req: Request, now: float) -> float:
        """Queue `req`; returns when it can be admitted (after an async disk read)."""
        self._tick(now)
        self.local.record(req.adapter)
        ready = now
        a = req.adapter
        if a and self.cfg.async_disk_loads:
            if a in self.cpu:
                self.cpu.move_to_end(a)  # the engine touches it on add_request
                ready = max(now, self.cpu[a])
            else:
                ready = self._read(a, now)
                self._cpu_insert(a, ready, now)
        elif a and self.cfg.local_read_ms is not None and a not in self.cpu:
            # Ray Serve LLM: the multiplex loader fetches to local disk before vLLM sees it
            ready = self.on_disk.get(a)
            if ready is None:
                self.cold_loads += 1
                ready = self.on_disk[a] = now + self.cfg.disk_load_ms
            ready = max(now, ready)
        self.queues.setdefault(req.adapter, deque()).append(req)
        self.num_waiting += 1
        self._view = None
        return ready

    def _read(self, adapter: str, now: float) -> float:
        """Read `adapter` into the CPU cache from its nearest tier: when the read is done."""
        self.disk_loads += 1
        cfg = self.cfg
        if cfg.local_read_ms is not None and adapter in self.on_disk:
            return max(now, self.on_disk[adapter]) + cfg.local_read_ms
        if cfg.shared_tier_ms is not None and cfg.async_disk_loads:
            if adapter in self.shared:  # another replica read it: from the shared tier
                return max(now, self.shared[adapter]) + cfg.shared_tier_ms
            self.shared[adapter] = now + cfg.disk_load_ms  # published once read
        self.cold_loads += 1
        if cfg.local_read_ms is not None:
            self.on_disk[adapter] = now + cfg.disk_load_ms
        return now + cfg.disk_load_ms

    def _cpu_insert(self, adapter: str, ready: float, now: float) -> None:
        self.cpu[adapter] = ready
        if len(self.cpu) > self.cfg.max_cpu_loras:
            idle = [a for a in self.cpu if a not in self.slots and a != adapter]
            if idle:
                del self.cpu[self._victim(idle, now)]

    def _victim(self, candidates: list[str], now: float) -> str:
        """LRU first in `candidates`; with popularity eviction, the least requested of them
        (fleet counts; with "shares", the smallest true rate); clairvoyant, the one asked for
        next the latest after `now` (from the whole trace, wherever those requests are routed:
        a reference, not an optimum)."""
        if self.cfg.eviction == "clairvoyant":  # requests waiting here are asked for now
            future = self.next_request  # set: __init__ checks
            return max(
                candidates, key=lambda a: -1.0 if self.queues.get(a) else future.after(a, now)
            )
        if self.cfg.eviction in ("popularity", "shares"):  # fleet counts / true rates
            return min(candidates, key=self.popularity)  # min keeps the LRU among ties
        if self.cfg.eviction == "frequency":
            return min(candidates, key=self.local.count)
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
            victim = self._victim(idle, now)
            self.evictions += 1
            self.forced_evictions += victim != self._victim(list(self.slots), now)
            del self.slots[victim]
        cost = cfg.cpu_load_ms
        if adapter in self.cpu and self.cpu[adapter] <= now:
            self.cpu.move_to_end(adapter)
        else:  # never read (vLLM: read in the step) or dropped since: read in the step
            cost += self._read(adapter, now) - now
            self._cpu_insert(adapter, now, now)
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
        pending = self.cpu if self.cfg.async_disk_loads else self.on_disk
        return sorted(
            (q[0].seq, a) for a, q in self.queues.items() if q and pending.get(a, 0.0) <= now
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
            req.admitted_at = now
            ready = now
            if adapter:
                if self.admitted is not None:
                    self.admitted.append(adapter)
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
