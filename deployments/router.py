"""AdapterAffinityRouter: Ray Serve request router that keeps each adapter on few replicas.

It runs in every process that holds a handle to the LLMServer deployment (proxy, ingress
replicas). The ranking itself is `deployments.routing_policy.rank_replicas`; this file only
builds the `ReplicaView`s from what Ray and the AdapterRegistry know:

- load: the router's queue-length cache (updated on every send, completion and probe),
  else the replica's own `num_running + num_waiting` from `record_routing_stats`, else 0;
- residency: the union of the replica's `record_routing_stats` lists (pushed through the
  controller every `request_routing_stats_period_s`), the model ids it registered with
  `serve.multiplexed`, and the AdapterRegistry snapshot, refreshed by a background task.

Base-model requests with a long prompt (a tenant's system prompt) are ranked like adapter
requests, on the key `prefix_routing_key` makes of the prompt's first 512 characters: its
requests stay on one replica, where the engine's prefix cache holds that prefix's KV, until
that replica passes the load bound; the replicas this router sent the key to count as its
holders (`on_request_routed`). Adapter requests are routed on the adapter alone: an
adapter's requests already share replicas, and its cached prefixes are its own.

Requests in flight: the router counts, per replica, the adapters of the requests it sent
that have not finished (`on_request_routed` until Ray's `on_request_completed`, and from
the ranking that chose a replica alone until then: router_memory `InFlight`); a tail
adapter skips a holder whose max_loras slots they or popular adapters all keep, where the
replica it would go to instead reports `reads_shared` or the holder's slots all run
(`rank_replicas`' `in_tail`, docs/routing.md).

Routing never waits on the registry (deployments/router_registry.py: the snapshot is
refreshed in the background, and one older than `registry_max_age_s` is ignored).

Placement (deployments/placement.py, which says how homes are chosen and grown): the router
counts every request it routes (`on_request_routed`; base requests count in the total) and
replans at `first_replan`, twice that, ... requests, then every `replan_every`, within the
slots the replicas have (`max_loras`: the kwarg, else their `routing_stats["max_loras"]`;
with neither, no placement: every adapter stays on its holders); the homes apply only while
the mean load per replica is over `placement_min_load` (placement.FleetLoad; 0: always).

Configure through `request_router_config.request_router_kwargs`, which Ray passes to
`initialize_state` (its keyword arguments, with their defaults).

max_batch: a replica with this many requests is over the load bound whatever the mean
(routing_policy.load_bound); None: the smallest `routing_stats["max_num_seqs"]` the replicas
report (their engines' batch size), no cap while none reports it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import replace
from functools import partial
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.placement import (
    DEFAULT_FIRST_REPLAN,
    DEFAULT_HALF_LIFE,
    DEFAULT_MAX_MOVES,
    DEFAULT_MIN_PLACED_COUNT,
    DEFAULT_PLACEMENT_MIN_LOAD,
    DEFAULT_REBALANCE_OVER,
    DEFAULT_REPLAN_EVERY,
    AdapterPopularity,
    PlacementConfig,
    PlacementPlanner,
)
from deployments.router_memory import InFlight, RecentRoutes
from deployments.router_registry import RegistrySnapshots, SnapshotFetch
from deployments.routing_policy import (
    DEFAULT_COUNT_SLACK,
    DEFAULT_LOAD_BOUND_C,
    DEFAULT_MIN_LOAD_BOUND,
    ReplicaView,
    is_adapter_key,
    is_prefix_key,
    prefix_routing_key,
    rank_replicas,
    tail_rank,
)

MAX_PREFIX_KEYS = 4096  # prefix keys remembered (key -> replicas it was routed to), LRU


class AdapterAffinityRouter(RegistrySnapshots, RequestRouter):
    """Adapter requests stay on the replicas holding the adapter (a hot one on up to k
    placed homes); a new adapter goes to a replica with the fewest adapters; base requests
    with a long prompt follow their prefix key's hash order; other base requests: power of
    two. Tiers: `rank_replicas`; Ray takes the first tier with a replica whose queue is not
    full, the least loaded within it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()  # defaults; Ray calls it again with request_router_kwargs

    def initialize_state(
        self,
        load_bound_c: float = DEFAULT_LOAD_BOUND_C,
        min_load_bound: int = DEFAULT_MIN_LOAD_BOUND,
        count_slack: float = DEFAULT_COUNT_SLACK,
        recent_routes_s: float = 2.0,
        registry_refresh_s: float = 2.0,
        registry_max_age_s: float = 30.0,
        use_registry: bool = True,
        seed: int | None = None,
        fetch_snapshot: SnapshotFetch | None = None,
        max_loras: int | None = None,
        use_placement: bool = True,
        popularity_half_life: int = DEFAULT_HALF_LIFE,
        replan_every: int = DEFAULT_REPLAN_EVERY,
        first_replan: int = DEFAULT_FIRST_REPLAN,
        min_placed_count: float = DEFAULT_MIN_PLACED_COUNT,
        rebalance_over: float = DEFAULT_REBALANCE_OVER,
        max_moves: int = DEFAULT_MAX_MOVES,
        max_batch: int | None = None,
        idle_first: bool = True,
        placement_min_load: float = DEFAULT_PLACEMENT_MIN_LOAD,
    ) -> None:
        if load_bound_c < 1.0:
            raise ValueError(f"load_bound_c must be >= 1, got {load_bound_c}")
        self._load_bound_c = float(load_bound_c)
        self._min_load_bound = int(min_load_bound)
        self._count_slack = float(count_slack)
        self._rng = random.Random(seed)
        self._max_loras = None if max_loras is None else int(max_loras)
        self._use_placement = bool(use_placement)
        self._half_life = int(popularity_half_life)
        self._replan_every = int(replan_every)
        self._first_replan = int(first_replan)
        self._min_placed_count = float(min_placed_count)
        self._rebalance_over = float(rebalance_over)
        self._max_moves = int(max_moves)
        self._placement_min_load = float(placement_min_load)
        if max_batch is not None and int(max_batch) < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._max_batch = None if max_batch is None else int(max_batch)
        self._idle_first = bool(idle_first)
        # what the placement counts: every routed request, from the first one; the planner
        # is made when the slot count is known (the kwarg, or the replicas' routing stats)
        self._popularity = AdapterPopularity(self._half_life)
        self._planner: PlacementPlanner | None = None
        if self._use_placement and self._max_loras is not None:
            self._planner = self._new_planner(self._max_loras)
        self._init_snapshots(registry_refresh_s, registry_max_age_s, use_registry, fetch_snapshot)
        # prefix key -> the replicas this router sent it to, most recent last (LRU of keys):
        # they hold that prefix's KV, as residency tells where an adapter is
        self._prefix_holders: OrderedDict[str, list[str]] = OrderedDict()
        # adapters this router sent each replica lately, counted as held there until the
        # replica's own reports show them (router_memory.RecentRoutes)
        self._recent = RecentRoutes(recent_routes_s)
        # the adapters of this router's requests not finished yet, per replica: a tail
        # adapter avoids a replica whose slots they all take (rank_replicas' `in_tail`)
        self._inflight = InFlight()

    # -- placement ----------------------------------------------------------------------

    def _new_planner(self, max_loras: int) -> PlacementPlanner:
        cfg = PlacementConfig(
            max_loras=max_loras,
            min_count=self._min_placed_count,
            rebalance_over=self._rebalance_over,
            max_moves=self._max_moves,
        )
        return PlacementPlanner(
            cfg,
            replan_every=self._replan_every,
            popularity=self._popularity,
            first_replan=self._first_replan,
            min_load=self._placement_min_load,
        )

    def _home(
        self, adapter_id: str, candidates: list[RunningReplica], views: list[ReplicaView]
    ) -> tuple[str, ...] | None:
        """The adapter's placed replicas, or None (not placed, or no placement)."""
        if not self._use_placement or not is_adapter_key(adapter_id):
            return None
        if self._planner is None:  # the slot count from the replicas, once one reports it
            max_loras = self._slots(candidates)
            if max_loras is None:
                return None
            self._planner = self._new_planner(max_loras)
        ids = [r.replica_id.unique_id for r in candidates]
        return self._planner.home(adapter_id, ids, views)

    def _batch_size(self, candidates: list[RunningReplica]) -> int | None:
        """The kwarg, else the smallest max_num_seqs the replicas report (None: none does)."""
        if self._max_batch is not None:
            return self._max_batch
        return _smallest_reported(candidates, "max_num_seqs")

    def _slots(self, candidates: list[RunningReplica]) -> int | None:
        """max_loras: the kwarg, else the smallest the replicas report (None: none does)."""
        if self._max_loras is not None:
            return self._max_loras
        return _smallest_reported(candidates, "max_loras")

    @property
    def popularity(self) -> AdapterPopularity:
        """The request counts the placement uses (kept from the first routed request)."""
        return self._popularity

    # -- views --------------------------------------------------------------------------

    def _view(self, replica: RunningReplica, residency: dict[str, dict]) -> ReplicaView:
        stats = replica.routing_stats or {}
        slots = set(stats.get("adapters_in_slots", ()))
        cpu = set(stats.get("adapters_in_cpu", ()))
        cpu.update(replica.multiplexed_model_ids)
        rid = replica.replica_id
        reported = residency.get(rid.unique_id) or residency.get(rid.to_full_id_str())
        if reported:
            slots.update(reported.get("slots", ()))
            cpu.update(reported.get("cpu", ()))
        load = self._replica_queue_len_cache.get(rid)
        if load is None:
            load = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        shared = bool(stats.get("reads_shared", False))  # unknown: a move may cost a cold read
        return ReplicaView(
            rid.unique_id, float(load), frozenset(slots), frozenset(cpu), reads_shared=shared
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._last_route_time = now = self._get_curr_time_s()
        self._ensure_refresh_task()
        if not candidate_replicas:
            return []
        adapter_id = ""
        if pending_request is not None:
            adapter_id = pending_request.metadata.multiplexed_model_id or ""
            if not adapter_id:  # a base request: route by its prompt prefix, if it has one
                adapter_id = _prefix_key(pending_request)
            # Back off between full passes over the tiers (Ray loops without sleeping
            # while should_backoff is False).
            pending_request.routing_context.should_backoff = True
        # A replica whose engine loop died answers 503 until Serve replaces it (after its
        # next failed health check): route around it while any other replica is left.
        live = [r for r in candidate_replicas if not (r.routing_stats or {}).get("engine_dead")]
        candidate_replicas = live or candidate_replicas
        residency = self._snapshot_residency()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r, residency) for r in candidate_replicas]
        request_id = pending_request.metadata.internal_request_id if pending_request else ""
        views = self._inflight.apply(self._recent.apply(views, now), now, request_id)
        sent_to = self._prefix_holders.get(adapter_id) if is_prefix_key(adapter_id) else None
        if sent_to:  # keeps the other fields (what RecentRoutes added)
            views = [
                replace(v, adapters_in_cpu=v.adapters_in_cpu | {adapter_id})
                if v.replica_id in sent_to
                else v
                for v in views
            ]
        slots = self._slots(candidate_replicas)
        tiers = rank_replicas(
            adapter_id,
            views,
            load_bound_c=self._load_bound_c,
            min_load_bound=self._min_load_bound,
            count_slack=self._count_slack,
            rng=self._rng,
            home=self._home(adapter_id, candidate_replicas, views),
            max_batch=self._batch_size(candidate_replicas),
            max_loras=slots,
            in_tail=None
            if slots is None
            else partial(self._popularity.in_tail, rank=tail_rank(len(candidate_replicas), slots)),
            idle_first=self._idle_first,
        )
        self._note_choice(adapter_id, tiers, request_id, now)
        return [[by_id[v.replica_id] for v in tier] for tier in tiers]

    def _note_choice(
        self, adapter_id: str, tiers: list[list[ReplicaView]], request_id: str, now: float
    ) -> None:
        """A first tier of one replica is where Ray sends the request unless its queue is
        full. Ray routes a burst's requests concurrently and calls on_request_routed only
        after the replica accepted (a round trip), so the next request of the burst must
        see this one: as running there (InFlight.chosen: a tail adapter needs a slot) and,
        if the replica neither holds nor reads the adapter (a new home, or a placed
        adapter's next home), as reading it (else a burst for a new adapter sees it held
        nowhere and may open another home: two disk reads). If Ray sends it elsewhere,
        on_request_routed corrects the first; the second expires after recent_routes_s."""
        if not is_adapter_key(adapter_id) or not tiers or len(tiers[0]) != 1:
            return
        (first,) = tiers[0]
        if request_id:
            self._inflight.chosen(request_id, first.replica_id, adapter_id, now)
        if not first.holds(adapter_id) and not first.in_cpu(adapter_id):
            self._recent.record(first.replica_id, adapter_id, now)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Count the request for the placement and remember where a base request's prefix
        went (Ray calls this once per routed request; choose_replicas may run several
        times for one)."""
        adapter_id = ""
        if pending_request is not None:
            adapter_id = pending_request.metadata.multiplexed_model_id or ""
        self._popularity.record(adapter_id)
        now = self._get_curr_time_s()
        self._recent.record(replica_id.unique_id, adapter_id, now)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            self._inflight.sent(request_id, replica_id.unique_id, adapter_id, now)
        key = _prefix_key(pending_request) if pending_request is not None else ""
        if not key or adapter_id:
            return
        holders = self._prefix_holders.pop(key, [])
        rid = replica_id.unique_id
        self._prefix_holders[key] = [h for h in holders if h != rid][-3:] + [rid]
        while len(self._prefix_holders) > MAX_PREFIX_KEYS:
            self._prefix_holders.popitem(last=False)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Ray calls this once per request it routed, when it finished or failed."""
        self._inflight.done(internal_request_id)


def _smallest_reported(replicas: list[RunningReplica], field: str) -> int | None:
    """The smallest engine limit the replicas report in their routing stats (None: none yet)."""
    known = [int(v) for r in replicas if (v := (r.routing_stats or {}).get(field))]
    return min(known) if known else None


def _prefix_key(pending_request: PendingRequest) -> str:
    """The prefix routing key of a request to LLMServer.generate/complete, or ""."""
    from deployments.protocol import GenerateRequest

    args = getattr(pending_request, "args", None) or ()
    request = args[0] if args else None
    if not isinstance(request, GenerateRequest):
        return ""
    return prefix_routing_key(request.prompt, request.prompt_token_ids, request.messages)
