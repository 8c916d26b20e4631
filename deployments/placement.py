"""Popularity-aware placement of hot adapters: pure Python, no Ray, shared by the Serve router
and the simulator (cluster/sim_router.py).

An adapter stays on the replicas that hold it (routing_policy.rank_replicas): that keeps
slot and cold loads down, but one replica cannot carry an adapter with more traffic than
a replica's share, and an adapter that takes a large part of one replica unbalances the
fleet. `plan_placement` gives the most requested adapters, down to the fleet's placed
slots, k replicas each, its *home*, from fleet-wide request counts (`AdapterPopularity`):
k = ceil(share x n x headroom) (llm-d bounds each LoRA to k pods for the same reason); an
adapter with k = 1 gets one (`min_replicas` 1), so no replica is dealt more of the popular
adapters than it has slots (where a move is a cold read, only on a replica holding it:
`cold_moves`). Its current holders come first while they have a slot free
beside their placed adapters (a placement does not move an adapter its holder can keep),
then replicas whose estimated traffic stays under `balance_slack` x the mean, in the
adapter's rendezvous order, within `max_loras - reserve_slots` placed adapters per replica
(the other slots are for the adapters that are not placed). The router grows an adapter
onto its next home only when every home holding it is over the load bound, so k is a
bound on its replicas, not a target. A single home is kept by later plans while its
adapter is counted and not placed.

The adapters that are not placed stay where they were first sent, and which of them turn
out popular is luck; with `max_moves` > 0 (off by default, see DEFAULT_MAX_MOVES) `rebalance`
moves up to that many a plan off a replica whose estimated traffic is over
`rebalance_over` times its fair share, to the least busy replica (a home of one replica,
kept by later plans).

Placement applies only while the fleet is loaded (`FleetLoad`): at under ~1 request in
flight per replica nothing queues, and a hot adapter stays on its holders as any other.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from deployments.routing_policy import ReplicaView, holders, rendezvous_order

DEFAULT_HALF_LIFE = 20_000  # requests: counts halve over this many routed requests
# a replica's own counts for frequency eviction of its slots and CPU cache (LLMServer, the
# simulator's replica): they halve over this many requests at that replica
EVICTION_HALF_LIFE = 1_000
DEFAULT_REPLAN_EVERY = 1_000  # requests between two placements, once counts are settled
DEFAULT_FIRST_REPLAN = 32  # the first placements: at 32, 64, 128, ... requests
DEFAULT_MIN_PLACED_COUNT = 16.0  # requests an adapter needs counted before it is placed
# k = ceil(share * n * headroom). An adapter that is not placed (k = 1: share <= 1/(headroom
# n)) sits on one replica beside that replica's part of the rest, which puts the busiest near
# 1 + 1/headroom times the mean when little else fills the others: 1.5 left 7 sweep runs over
# the served max/mean bound of 1.3 (up to 1.46); 2.0 leaves none, for ~1-3% more slot loads
# (sweep 31 -> 35 of 49 runs met; docs/routing.md). One value for the whole sweep.
DEFAULT_REPLICATION_HEADROOM = 2.0
# an adapter is placed when its k is at least this: 1 shares the popular adapters out over
# the replicas' slots (sweep 40 -> 43 of 50 met with the tail rule; docs/routing.md); 2
# places only those one replica cannot carry
DEFAULT_MIN_REPLICAS = 1
DEFAULT_MIN_PLACED_SHARE = 0.0005  # below 1 request in 2,000 an adapter is not worth a slot
DEFAULT_BALANCE_SLACK = 1.25  # a new home's placed traffic, over the mean placed traffic
TAIL_REFRESH = 256  # records between two recomputations of AdapterPopularity.in_tail
DEFAULT_REBALANCE_OVER = 1.3  # a replica's estimated adapter traffic over 1/n: move one off
# adapters moved per plan (each move is one read). Off by default: with headroom 2.0 the
# simulator's sweep meets 36 of 49 runs with one move a plan against 35 without, and on the
# real 4-replica Serve app (benchmarks/routing.py --adapters 40, arm affinity_moves) their
# effect on p99 was 1.31x, 0.89x and 1.42x that of the router without them (docs/routing.md)
DEFAULT_MAX_MOVES = 0

# FleetLoad: placement spreads a hot adapter over k homes so that no replica carries more
# than its share, which buys latency only where requests queue; each home past the first
# costs slot loads. Off under half of this mean load per replica (averaged over LOAD_WINDOW
# routed adapter requests), on again at it. The sweep's runs sit at 4.9-11 per replica
# (never off); the real 4-replica app at 5 requests/s at ~0.5 (docs/routing.md).
DEFAULT_PLACEMENT_MIN_LOAD = 2.0
LOAD_WINDOW = 100

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
        self._tail: tuple[int, int, float] | None = None  # (at num_recorded, rank, count)

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

    def in_tail(self, adapter_id: str, rank: int) -> bool:
        """Outside the `rank` most requested adapters: its count is at most the count of
        the (rank + 1)-th (False while fewer than rank + 1 adapters were counted). The
        threshold is recomputed every TAIL_REFRESH records."""
        cached = self._tail
        if cached is None or cached[1] != rank or self.num_recorded - cached[0] >= TAIL_REFRESH:
            top = heapq.nlargest(rank + 1, self.counts.values())
            cached = self._tail = (self.num_recorded, rank, top[rank] if len(top) > rank else -1)
        return self.count(adapter_id) <= cached[2]

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
    min_share: float = DEFAULT_MIN_PLACED_SHARE
    min_replicas: int = DEFAULT_MIN_REPLICAS
    balance_slack: float = DEFAULT_BALANCE_SLACK  # a new home's placed traffic / the mean
    # an early share is noise: 3 requests out of 32 would give k = 3 of 16 replicas; 16
    # counted requests put a share's relative error near 1/4 (Poisson)
    min_count: float = DEFAULT_MIN_PLACED_COUNT
    rebalance_over: float = DEFAULT_REBALANCE_OVER
    max_moves: int = DEFAULT_MAX_MOVES

    def placed_per_replica(self) -> int:
        reserve = max(1, self.max_loras // 4) if self.reserve_slots is None else self.reserve_slots
        return max(0, self.max_loras - reserve)


def plan_placement(
    shares: Mapping[str, float],
    replica_ids: Sequence[str],
    cfg: PlacementConfig,
    holders: Mapping[str, Sequence[str]] | None = None,
    counts: Mapping[str, float] | None = None,
    prev: Placement | None = None,
    cold_moves: bool = False,
) -> dict[str, tuple[str, ...]]:
    """Place the hot adapters (see the module docstring); returns adapter -> its home, the
    replicas holding it first, each group in the adapter's rendezvous order. Deterministic in
    (shares, replica set, holders): routers that see the same agree.

    holders: adapter -> replicas holding it now (slot or CPU cache); counts: adapter -> its
    requests counted (None: no minimum, cfg.min_count does not apply); prev: the last
    placement (its single homes, `rebalance`, are kept while their adapter is not hot);
    cold_moves: a replica that does not hold an adapter reads it from the cold tier (some
    replica reads no shared tier, `ReplicaView.reads_shared`), so an adapter with k = 1 is
    homed only on a holder with room: its home is for the balance of where the popular
    adapters were dealt, not worth a cold read (a new home of a hot adapter still is); one
    whose holders have none leaves its placed slot to the next adapter held where there is."""
    n = len(replica_ids)
    per_replica = cfg.placed_per_replica()
    if n == 0 or per_replica == 0:
        return {}
    ranked = sorted(((s, a) for a, s in shares.items()), key=lambda x: (-x[0], x[1]))
    held = holders or {}
    budget = n * per_replica  # placed slots, most popular first
    chosen: list[tuple[str, float, int]] = []
    # under cold_moves, the k = 1 adapters past the budget, held somewhere: they take the
    # placed slots of chosen ones that find no holder with room (below), in rank order
    later: list[tuple[str, float, int]] = []
    for share, adapter in ranked:
        k = replication_factor(share, n, cfg.headroom)
        if k < cfg.min_replicas or share < cfg.min_share:
            break
        if counts is not None and counts.get(adapter, 0.0) < cfg.min_count:
            break  # ranked by share: every later one has fewer
        if cold_moves and k == 1 and not held.get(adapter):
            continue  # it can have no home (below): its placed slot goes to the next one
        if k > budget:
            if not (cold_moves and k == 1):
                break
            later.append((adapter, share, k))
            continue
        chosen.append((adapter, share, k))
        budget -= k
    placed = {a for a, _, _ in chosen}
    # estimated traffic per replica: the adapters not placed where they are held (or at
    # their single home), then the placed ones' parts as they are placed
    load = dict.fromkeys(replica_ids, 0.0)
    single = {  # earlier plans' moves, while the adapter is counted and not hot
        a: h[0]
        for a, h in (prev or {}).items()
        if len(h) == 1 and h[0] in load and a in shares and a not in placed
    }
    for adapter, share in shares.items():
        if adapter in placed:
            continue
        where = (
            [single[adapter]]
            if adapter in single
            else [r for r in held.get(adapter, ()) if r in load]
        )
        for rid in where:
            load[rid] += share / len(where)
    cap = cfg.balance_slack * sum(share for _, share, _ in chosen) / n
    num_placed = dict.fromkeys(replica_ids, 0)
    placement: dict[str, tuple[str, ...]] = {}
    spare = 0  # placed slots left by chosen k = 1 adapters no holder had room for
    for i, (adapter, share, k) in enumerate(chosen + later):
        filler = i >= len(chosen)
        if filler and spare == 0:
            break
        each = share / k
        here = set(held.get(adapter, ()))
        order = rendezvous_order(adapter, replica_ids)
        room = [r for r in order if num_placed[r] < per_replica]
        # never move what is already there while its holder keeps a slot free beside its
        # placed adapters (a new home needs room within per_replica)
        picks = [r for r in order if r in here and num_placed[r] < cfg.max_loras - 1][:k]
        new = [r for r in room if r not in here] if k > 1 or not cold_moves else []
        picks += [r for r in new if load[r] + each <= cap + 1e-12][: k - len(picks)]
        if len(picks) < k:  # the cap binds: the least loaded with a slot left
            rest = sorted((r for r in new if r not in picks), key=lambda r: load[r])
            picks += rest[: k - len(picks)]
        if not picks and cold_moves and k == 1:
            if not filler:  # not placed: it stays where it is held
                stays = here & load.keys()
                for rid in stays:
                    load[rid] += share / len(stays)
                spare += 1
            continue
        if len(picks) < cfg.min_replicas:
            # the budget counts slots, but the ones left may be on too few replicas (two
            # free on one): no placement for it, nor for anyone less popular
            break
        each = share / len(picks)  # fewer than k where the slots left are on fewer replicas
        for rid in picks:
            num_placed[rid] += 1
            load[rid] += 0.0 if filler else each  # a filler's traffic is counted where held
        spare -= filler
        placement[adapter] = tuple(
            [r for r in order if r in picks and r in here]
            + [r for r in order if r in picks and r not in here]
        )
    trusted = (
        (lambda a: True) if counts is None else (lambda a: counts.get(a, 0.0) >= cfg.min_count)
    )
    singles = rebalance(shares, load, single, held, placed, trusted, cfg)
    placement.update((a, (rid,)) for a, rid in singles.items())
    return placement


def rebalance(
    shares: Mapping[str, float],
    load: dict[str, float],
    single: Mapping[str, str],
    held: Mapping[str, Sequence[str]],
    placed: set[str],
    trusted: Callable[[str], bool],
    cfg: PlacementConfig,
) -> dict[str, str]:
    """Single homes for adapters that are not hot: adapter -> the one replica it goes to.

    An adapter that is not placed stays where it was first sent (`new_home` deals them by
    count, as Ray does), and which ones turn out popular is luck: three of the 10 most
    requested can share one replica (the sweep's point 10: that replica served 1.45x the
    mean). When the estimated traffic `load` (updated in place) of the busiest replica is
    over `rebalance_over` / n (n replicas; shares count base requests too, so 1/n is a
    replica's fair share of everything), one adapter whose traffic it carries alone moves to
    the least busy replica: the one whose share best evens the two, if that lowers the
    busier of them. At most `max_moves` per plan: each costs one cold read and a slot load.
    The moves of earlier plans (`single`) stay."""
    homes = dict(single)
    n = len(load)
    for _ in range(cfg.max_moves):
        r = max(load, key=lambda x: (load[x], x))
        m = min(load, key=lambda x: (load[x], x))
        if load[r] <= cfg.rebalance_over / n:
            break
        mine = [
            (shares[a], a)
            for a in shares
            if a not in placed
            and trusted(a)
            and (homes.get(a) == r or (a not in homes and list(held.get(a, ())) == [r]))
        ]
        best = min(mine, key=lambda x: (max(load[r] - x[0], load[m] + x[0]), x[1]), default=None)
        if best is None or load[m] + best[0] >= load[r]:
            break
        share, adapter = best
        homes[adapter] = m
        load[r] -= share
        load[m] += share
    return homes


class FleetLoad:
    """Whether the fleet is loaded enough to place hot adapters (DEFAULT_PLACEMENT_MIN_LOAD):
    an exponential average over `window` observations of the mean load per replica, on while
    it is at least `min_load` and until it falls under half of it. It starts on, at
    `min_load`: a fleet that starts busy places from its first requests."""

    def __init__(
        self, min_load: float = DEFAULT_PLACEMENT_MIN_LOAD, window: int = LOAD_WINDOW
    ) -> None:
        if min_load < 0:
            raise ValueError(f"placement min_load must be >= 0, got {min_load}")
        if window < 1:
            raise ValueError(f"load window must be >= 1, got {window}")
        self.min_load = float(min_load)
        self.window = window
        self.mean = self.min_load
        self.placing = True

    def observe(self, views: Sequence[ReplicaView]) -> bool:
        """Add the mean load of `views`; returns whether placement is on."""
        if views:
            load = sum(v.load for v in views) / len(views)
            self.mean += (load - self.mean) / self.window
        if self.placing and self.mean < self.min_load / 2:
            self.placing = False
        elif not self.placing and self.mean >= self.min_load:
            self.placing = True
        return self.placing


class PlacementPlanner:
    """Counts requests and keeps a placement, recomputed every `replan_every` requests or
    when the replica set changes. What both the Serve router and the simulator hold."""

    def __init__(
        self,
        cfg: PlacementConfig,
        *,
        half_life: int = DEFAULT_HALF_LIFE,
        replan_every: int = DEFAULT_REPLAN_EVERY,
        popularity: AdapterPopularity | None = None,
        first_replan: int = DEFAULT_FIRST_REPLAN,
        min_load: float = DEFAULT_PLACEMENT_MIN_LOAD,
    ) -> None:
        """popularity: counts kept so far (a router counts from its first request, before
        it knows the slot count); else a new AdapterPopularity(half_life). min_load:
        `FleetLoad`'s (0: placement whatever the load)."""
        self.cfg = cfg
        self.load = FleetLoad(min_load)
        self.popularity = popularity if popularity is not None else AdapterPopularity(half_life)
        self.replan_every = replan_every
        self.first_replan = first_replan
        self._placement: dict[str, tuple[str, ...]] = {}
        self._replica_ids: tuple[str, ...] = ()
        self._planned_at = -1

    def record(self, adapter_id: str) -> None:
        self.popularity.record(adapter_id)

    def placement(
        self,
        replica_ids: Sequence[str],
        views: Callable[[], Sequence[ReplicaView]] | None = None,
    ) -> Placement:
        """The current placement; replanned when the replica set changes, at first_replan,
        2 x first_replan, 4 x ... recorded requests (a small fleet's hot adapter needs its
        homes before a thousand requests have passed), then every `replan_every` requests.
        views() -> what the router sees of the replicas (called only to replan): who holds
        which adapter, and whether a move is a cold read (`plan_placement`'s cold_moves:
        some replica reads no shared tier)."""
        ids = tuple(sorted(replica_ids))
        n = self.popularity.num_recorded
        interval = min(self.replan_every, max(self.first_replan, self._planned_at))
        if ids != self._replica_ids or n - self._planned_at >= interval:
            seen = views() if views is not None else ()
            cold = not all(v.reads_shared for v in seen)
            pop = self.popularity
            self._placement = plan_placement(
                pop.shares(), ids, self.cfg, holders(seen), pop.counts, self._placement, cold
            )
            self._replica_ids, self._planned_at = ids, n
        return self._placement

    def home(
        self, adapter_id: str, replica_ids: Sequence[str], views: Sequence[ReplicaView]
    ) -> tuple[str, ...] | None:
        """`adapter_id`'s placed replicas, or None: not placed, or the fleet too lightly
        loaded for placement (`FleetLoad`, fed here: call it once per routed request). The
        plan is kept up to date either way, so it is ready when the load comes back."""
        placing = self.load.observe(views)
        placed = self.placement(replica_ids, lambda: views)
        return placed.get(adapter_id) if placing else None
