"""Popularity-aware placement of adapters: pure Python, no Ray, shared by the Serve router and
the simulator (cluster/sim_router.py).

The plain rule (routing_policy.rank_replicas without a placement) sends each adapter to the
first replica in its rendezvous order and spills along that order under load. Two things
that rule cannot see cost adapter loads:
- hashing puts Binomial(top adapters, 1/n) of the fleet's most popular adapters on each
  replica: some get more than their slots hold, and reload them all day;
- a hot adapter spills one replica at a time, to replicas that then load it, evict someone
  else for it, and soon drop it again.
`plan_placement` fixes both from fleet-wide request counts (`AdapterPopularity`): the most
popular adapters, in popularity order, each get k replicas, k from their share of the
traffic (llm-d bounds each LoRA to k pods for the same reason), chosen along the adapter's
own rendezvous order but skipping replicas whose slots are already spoken for
(`max_loras - reserve_slots` placed adapters) or whose placed traffic would pass
load_bound_c x the mean. `reserve_slots` stay free on every replica for the adapters that
are not placed (the tail: one load per request whatever the router does, see
cluster/sim.py's slot_load_floor). Adapters that do not fit are not placed: they keep the
plain hash rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deployments.routing_policy import DEFAULT_LOAD_BOUND_C, rendezvous_order

DEFAULT_HALF_LIFE = 20_000  # requests: counts halve over this many routed requests
DEFAULT_REPLAN_EVERY = 1_000  # requests between two placements
DEFAULT_REPLICATION_HEADROOM = 1.25  # k = ceil(share * n * headroom)
DEFAULT_MIN_PLACED_SHARE = 0.0005  # below 1 request in 2,000 an adapter is not worth a slot

Placement = Mapping[str, tuple[str, ...]]  # adapter -> its replicas, in preference order


class AdapterPopularity:
    """Fleet-wide request counts per adapter, decayed: every `half_life` recorded requests
    all counts halve, so a shift in traffic shows within a few half-lives.

    The Serve router records every request it routes (base requests count in the total), so
    its shares are the fleet's when it is the only router, and an unbiased sample of them
    when several routers share the traffic.
    """

    def __init__(self, half_life: int = DEFAULT_HALF_LIFE) -> None:
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1, got {half_life}")
        self.half_life = half_life
        self.counts: dict[str, float] = {}  # adapter -> decayed count
        self.total = 0.0  # decayed count of all requests, base included
        self.num_recorded = 0

    def record(self, adapter_id: str) -> None:
        self.num_recorded += 1
        self.total += 1
        if adapter_id:
            self.counts[adapter_id] = self.counts.get(adapter_id, 0.0) + 1
        if self.num_recorded % self.half_life == 0:
            self.total /= 2
            self.counts = {a: c / 2 for a, c in self.counts.items() if c >= 0.25}

    def count(self, adapter_id: str) -> float:
        return self.counts.get(adapter_id, 0.0)

    def shares(self) -> dict[str, float]:
        """adapter -> its share of all requests (base included)."""
        if self.total <= 0:
            return {}
        return {a: c / self.total for a, c in self.counts.items()}


def replication_factor(share: float, num_replicas: int, headroom: float) -> int:
    """Replicas an adapter with `share` of all traffic is placed on: its traffic in replicas'
    worth (share x n), times headroom so each holder stays under the load bound, at least 1."""
    return max(1, min(num_replicas, math.ceil(share * num_replicas * headroom - 1e-9)))


@dataclass(frozen=True)
class PlacementConfig:
    max_loras: int  # GPU slots per replica
    reserve_slots: int | None = None  # None: max(1, max_loras // 4)
    headroom: float = DEFAULT_REPLICATION_HEADROOM
    load_bound_c: float = DEFAULT_LOAD_BOUND_C
    min_share: float = DEFAULT_MIN_PLACED_SHARE
    balance_slack: float = DEFAULT_LOAD_BOUND_C  # a replica's placed traffic / the mean

    def placed_per_replica(self) -> int:
        reserve = max(1, self.max_loras // 4) if self.reserve_slots is None else self.reserve_slots
        return max(0, self.max_loras - reserve)


def plan_placement(
    shares: Mapping[str, float], replica_ids: Sequence[str], cfg: PlacementConfig
) -> dict[str, tuple[str, ...]]:
    """Place the most popular adapters (see the module docstring); returns adapter ->
    replicas in its rendezvous order. Deterministic in (shares, replica set): routers with
    the same counts agree, and a replica leaving only moves what it held."""
    n = len(replica_ids)
    per_replica = cfg.placed_per_replica()
    if n == 0 or per_replica == 0:
        return {}
    ranked = sorted(((s, a) for a, s in shares.items()), key=lambda x: (-x[0], x[1]))
    # the adapters that fit in the slots, most popular first, with their k
    budget = n * per_replica
    chosen: list[tuple[str, float, int]] = []
    for share, adapter in ranked:
        k = replication_factor(share, n, cfg.headroom)
        if k > budget or share < cfg.min_share:
            break
        chosen.append((adapter, share, k))
        budget -= k
    # their traffic may put at most slack x the mean of it on one replica
    cap = cfg.balance_slack * sum(share for _, share, _ in chosen) / n
    num_placed = dict.fromkeys(replica_ids, 0)
    placed_load = dict.fromkeys(replica_ids, 0.0)
    placement: dict[str, tuple[str, ...]] = {}
    for adapter, share, k in chosen:
        each = share / k
        order = rendezvous_order(adapter, replica_ids)
        room = [r for r in order if num_placed[r] < per_replica]
        picks = [r for r in room if placed_load[r] + each <= cap + 1e-12][:k]
        if len(picks) < k:  # the load cap binds: the least loaded with a slot left
            rest = sorted((r for r in room if r not in picks), key=lambda r: placed_load[r])
            picks += rest[: k - len(picks)]
        for rid in picks:
            num_placed[rid] += 1
            placed_load[rid] += each
        placement[adapter] = tuple(r for r in order if r in picks)
    return placement


class PlacementPlanner:
    """Counts requests and keeps a placement, recomputed every `replan_every` requests or
    when the replica set changes. What both the Serve router and the simulator hold."""

    def __init__(
        self,
        cfg: PlacementConfig,
        *,
        half_life: int = DEFAULT_HALF_LIFE,
        replan_every: int = DEFAULT_REPLAN_EVERY,
    ) -> None:
        self.cfg = cfg
        self.popularity = AdapterPopularity(half_life)
        self.replan_every = replan_every
        self._placement: dict[str, tuple[str, ...]] = {}
        self._replica_ids: tuple[str, ...] = ()
        self._planned_at = -1

    def record(self, adapter_id: str) -> None:
        self.popularity.record(adapter_id)

    def placement(self, replica_ids: Sequence[str]) -> Placement:
        ids = tuple(sorted(replica_ids))
        n = self.popularity.num_recorded
        if ids != self._replica_ids or n - self._planned_at >= self.replan_every:
            self._placement = plan_placement(self.popularity.shares(), ids, self.cfg)
            self._replica_ids, self._planned_at = ids, n
        return self._placement
