"""deployments/placement.py: popularity counts, the hot adapters' homes, and the moves that
even out the adapters that are not hot (`rebalance`), against hand-worked cases and
brute-force properties."""

import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.routing_policy import ReplicaView, rank_replicas, rendezvous_order


def test_popularity_decays_by_half_each_half_life():
    from deployments.placement import AdapterPopularity

    pop = AdapterPopularity(half_life=4)
    for a in ("x", "x", "", "y"):  # the 4th record halves everything
        pop.record(a)
    assert pop.count("x") == 1.0 and pop.count("y") == 0.5 and pop.total == 2.0
    assert pop.shares() == {"x": 0.5, "y": 0.25}
    for a in ("x", "x", "x", "x"):
        pop.record(a)
    assert pop.count("x") == (1 + 4) / 2 and pop.count("y") == 0.25
    for _ in range(8):  # two more half-lives: 0.25 -> 0.125, then under 0.25 it is dropped
        pop.record("x")
    assert "y" not in pop.counts and pop.total == ((3 + 4) / 2 + 4) / 2


def test_replication_factor_by_hand():
    from deployments.placement import replication_factor

    assert replication_factor(0.16, 16, 1.25) == 4  # 0.16 x 16 x 1.25 = 3.2
    assert replication_factor(0.05, 16, 1.25) == 1  # exactly 1.0
    assert replication_factor(0.001, 16, 1.25) == 1
    assert replication_factor(0.9, 4, 2.0) == 4  # never more than the fleet


def test_placement_by_hand():
    """4 replicas x 4 slots, headroom 1.5: 'a' (40% of traffic) gets ceil(0.4 x 4 x 1.5) = 3
    homes, the first three of a's own order without holders (a replica holding 'a' comes
    first). 'b' (10%) and 'c' (5%) get one home each (k = 1): held nowhere, each goes to the
    first replica in its order whose estimated traffic stays under 1.25 x the mean placed
    traffic (1.25 x 0.55 / 4 = 0.172): only the one without 'a' (0.133 + 0.1 is over it).
    'd' (under min_share) is not placed. With min_replicas 2 (the default before the fleet's
    slots were shared out) only 'a' is."""
    from deployments.placement import PlacementConfig, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    shares = {"a": 0.4, "b": 0.1, "c": 0.05, "d": 0.0001}
    cfg = PlacementConfig(max_loras=4, headroom=1.5)  # the numbers below
    a_homes = tuple(rendezvous_order("a", ids)[:3])
    last = rendezvous_order("a", ids)[3]
    assert plan_placement(shares, ids, cfg) == {"a": a_homes, "b": (last,), "c": (last,)}
    hot_only = PlacementConfig(max_loras=4, headroom=1.5, min_replicas=2)
    assert plan_placement(shares, ids, hot_only) == {"a": a_homes}
    homes = plan_placement(shares, ids, cfg, holders={"a": [last]})["a"]
    assert homes == (last, *rendezvous_order("a", ids)[:2])
    # a holder with a placed slot left keeps its adapter: b stays on r0
    assert plan_placement(shares, ids, cfg, holders={"b": ["r0"]})["b"] == ("r0",)


def test_no_replica_gets_more_popular_adapters_than_its_placed_slots():
    """20 adapters of equal share, all first sent to r0 (k = 1 each: 0.045 x 4 x 2 < 1): r0
    keeps max_loras - 1 = 3 of them, the 9 the other replicas' placed slots take move
    off it (3 each), the last 8 are past the fleet's 12 placed slots and stay unplaced."""
    from deployments.placement import PlacementConfig, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    shares = {f"x{i:02d}": 0.045 for i in range(20)}
    plc = plan_placement(shares, ids, PlacementConfig(max_loras=4), {a: ["r0"] for a in shares})
    assert len(plc) == 12 and all(len(h) == 1 for h in plc.values())
    assert Counter(h[0] for h in plc.values()) == {r: 3 for r in ids}
    assert sorted(plc) == sorted(shares)[:12]  # equal shares: by name
    # with 8 slots (6 placed a replica) r0 keeps 7 of them, one slot free beside them: an
    # adapter is not moved off a holder that can keep it in a slot
    plc = plan_placement(shares, ids, PlacementConfig(max_loras=8), {a: ["r0"] for a in shares})
    where = Counter(h[0] for h in plc.values())
    assert len(plc) == 20 and where["r0"] == 7 and max(where[r] for r in ids[1:]) == 6


def test_where_a_move_is_a_cold_read_an_adapter_with_k_1_is_homed_only_where_it_is_held():
    """cold_moves (a replica reads no shared tier): the 20 adapters of the test above, all on
    r0, stay there: r0 homes the 3 its placed slots take, none moves off it for balance (each
    move would be a read from disk), the rest are not placed. A hot adapter still gets its k
    homes, new ones included; one with k = 1 held nowhere gets no home (new_home deals it)
    and takes no placed slot from a less requested one that can have one, nor does one whose
    holders have no room. The planner reads
    the gate off the replicas' views."""
    from deployments.placement import PlacementConfig, PlacementPlanner, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    shares = {f"x{i:02d}": 0.045 for i in range(20)}
    held = {a: ["r0"] for a in shares}
    plc = plan_placement(shares, ids, PlacementConfig(max_loras=4), held, cold_moves=True)
    assert plc == {a: ("r0",) for a in sorted(shares)[:3]}
    shares = {"a": 0.4, "b": 0.1, "c": 0.05}
    cfg = PlacementConfig(max_loras=4, headroom=1.5)
    a_homes = tuple(rendezvous_order("a", ids)[:3])
    assert plan_placement(shares, ids, cfg, {"c": ["r2"]}, cold_moves=True) == {
        "a": a_homes,
        "c": ("r2",),
    }
    # one placed slot a replica (4 in all), 'a' takes 3: 'b', held nowhere, does not take the
    # last from 'c', whose holder has room for it
    last = rendezvous_order("a", ids)[3]
    tight = PlacementConfig(max_loras=2, headroom=1.5)
    assert plan_placement(shares, ids, tight, {"c": [last]}, cold_moves=True) == {
        "a": a_homes,
        "c": (last,),
    }
    # 'b' held where 'a' took the one placed slot: not placed, and its placed slot goes to
    # 'c', past the budget, whose holder has room
    held = {"b": [a_homes[0]], "c": [last]}
    assert plan_placement(shares, ids, tight, held, cold_moves=True) == {
        "a": a_homes,
        "c": (last,),
    }
    planner = PlacementPlanner(cfg, first_replan=1)
    for a in ["a"] * 32 + ["b"] * 16 + [""] * 60:  # b: k = 1
        planner.record(a)
    disk_only = [ReplicaView(r, 0.0, frozenset(), frozenset(), reads_shared=False) for r in ids]
    assert set(planner.placement(ids, lambda: disk_only)) == {"a"}
    tiered = [replace(v, reads_shared=True) for v in disk_only]
    again = PlacementPlanner(cfg, popularity=planner.popularity)
    assert set(again.placement(ids, lambda: tiered)) == {"a", "b"}
    assert set(PlacementPlanner(cfg, popularity=planner.popularity).placement(ids)) == {"a", "b"}


def test_an_adapter_with_few_requests_counted_is_not_placed():
    """A share from a handful of requests is noise: below min_count requests an adapter is
    not placed, whatever its share; the planner replans at 32, 64, 128, ... requests, then
    every replan_every."""
    from deployments.placement import PlacementConfig, PlacementPlanner, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    cfg = PlacementConfig(max_loras=4, min_count=16)
    shares = {"a": 0.4, "b": 0.3}  # both k >= 2
    assert set(plan_placement(shares, ids, cfg, counts={"a": 16, "b": 12})) == {"a"}
    assert plan_placement(shares, ids, cfg, counts={"a": 15, "b": 12}) == {}
    planner = PlacementPlanner(cfg, replan_every=200)
    planned = []
    for i in range(700):
        before = planner._planned_at
        planner.placement(ids)
        if planner._planned_at != before:
            planned.append(i)
        planner.record("a" if i % 2 else "")
    assert planned == [0, 32, 64, 128, 256, 456, 656]
    assert set(planner.placement(ids)) == {"a"}


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=60),
    n=st.integers(1, 12),
    max_loras=st.integers(1, 8),
    held=st.lists(st.integers(0, 11), max_size=30),
    min_replicas=st.sampled_from([1, 2]),
)
def test_placement_respects_slots_holders_and_popularity(weights, n, max_loras, held, min_replicas):
    from deployments.placement import PlacementConfig, plan_placement, replication_factor

    total = sum(weights) / 0.9  # 10% base
    shares = {f"ad-{i}": w / total for i, w in enumerate(weights)}
    ids = [f"r{i}" for i in range(n)]
    holders: dict[str, list[str]] = {}
    for j, r in enumerate(held):  # adapter j % len holds on replica r % n
        holders.setdefault(f"ad-{j % len(weights)}", []).append(f"r{r % n}")
    # moves (single homes of adapters that are not placed) are told from placed adapters
    # by their number of homes only while placed ones have at least two
    cfg = PlacementConfig(
        max_loras=max_loras, max_moves=min_replicas - 1, min_replicas=min_replicas
    )
    everything = plan_placement(shares, ids, cfg, holders)
    plc = {a: h for a, h in everything.items() if len(h) >= cfg.min_replicas}  # the hot ones
    singles = {a: h[0] for a, h in everything.items() if len(h) < cfg.min_replicas}
    check_moves(shares, ids, cfg, holders, plc, singles)
    per_replica = Counter(r for homes in plc.values() for r in homes)
    # a new home within placed_per_replica; a holder keeps up to max_loras - 1
    assert all(v <= max(cfg.placed_per_replica(), max_loras - 1) for v in per_replica.values())
    for a, homes in plc.items():
        k = replication_factor(shares[a], n, cfg.headroom)
        # k homes, fewer only where the placed slots left are on fewer replicas
        assert cfg.min_replicas <= len(homes) <= k and len(set(homes)) == len(homes)
        if len(homes) < k:
            assert (
                sum(v < cfg.placed_per_replica() for v in per_replica.values())
                + (n - len(per_replica))
                < k
            )
        order = rendezvous_order(a, ids)
        here = [r for r in homes if r in holders.get(a, ())]
        assert list(homes[: len(here)]) == [r for r in order if r in here]  # holders first
        assert list(homes[len(here) :]) == [r for r in order if r in homes[len(here) :]]
        # a holder is left out only when it keeps no slot free beside its placed adapters
        for r in set(holders.get(a, ())) - set(homes):
            assert per_replica[r] >= max_loras - 1 or len(here) == k
    # placed adapters are the most popular ones (a prefix of the popularity order)
    ranked = sorted(shares, key=lambda a: (-shares[a], a))
    assert ranked[: len(plc)] == sorted(plc, key=lambda a: (-shares[a], a))


def estimated_traffic(
    shares: dict[str, float],
    ids: list[str],
    holders: dict[str, list[str]],
    hot: dict[str, tuple[str, ...]],
    singles: dict[str, str],
) -> dict[str, float]:
    """Reference: each replica's share of the traffic if the hot adapters' traffic splits
    evenly over their homes, a moved adapter's goes to its single home, and every other
    adapter's splits over its holders."""
    out = dict.fromkeys(ids, 0.0)
    for a, share in shares.items():
        where = list(hot.get(a, ())) or ([singles[a]] if a in singles else holders.get(a, []))
        for r in where:
            out[r] += share / len(where)
    return out


def check_moves(shares, ids, cfg, holders, hot, singles) -> None:
    """The moves of one plan (no earlier ones): at most max_moves, each of an adapter that
    is not hot, held by one replica alone, to another replica; the busiest replica's
    estimated traffic must have been over rebalance_over / n, and no replica ends busier
    than the busiest was."""
    assert len(singles) <= cfg.max_moves
    before = estimated_traffic(shares, ids, holders, hot, {})
    after = estimated_traffic(shares, ids, holders, hot, singles)
    for a, home in singles.items():
        assert a not in hot and holders.get(a) == [holders[a][0]] and home != holders[a][0]
        assert max(before.values()) > cfg.rebalance_over / len(ids)
        assert before[holders[a][0]] == max(before.values())
    assert max(after.values()) <= max(before.values()) + 1e-12
    assert abs(sum(after.values()) - sum(before.values())) < 1e-9


def test_rebalance_moves_the_adapter_that_best_evens_the_busiest_replica():
    """Moves are off by default (max_moves 0), and they move adapters that are not placed:
    here min_replicas 2 places only adapters with k >= 2. With max_moves 1: 4 replicas,
    nothing hot (k = ceil(share x 4 x 1.5) = 1 for shares <= 1/6). r0 holds b, c, d (0.16 + 0.12 +
    0.08 = 0.36 of all traffic, over 1.3 / 4 = 0.325); r3, the least busy (0.02), takes the
    one that best evens the two: b (max(0.20, 0.18) = 0.20, against 0.24 for c and 0.28
    for d). The router then sends b to r3 although r0 has it in a slot.
    The next plan keeps the move (r0 now holds b too) and moves nothing more (r0: 0.20)."""
    from deployments.placement import PlacementConfig, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    shares = {"b": 0.16, "c": 0.12, "d": 0.08, "e": 0.05, "f": 0.05, "g": 0.02}
    holders = {"b": ["r0"], "c": ["r0"], "d": ["r0"], "e": ["r1"], "f": ["r2"], "g": ["r3"]}
    no_moves = PlacementConfig(
        max_loras=4, headroom=1.5, min_replicas=2
    )  # max_moves: the default, 0
    assert plan_placement(shares, ids, no_moves, holders) == {}
    cfg = PlacementConfig(max_loras=4, headroom=1.5, min_replicas=2, max_moves=1)
    plc = plan_placement(shares, ids, cfg, holders)
    assert plc == {"b": ("r3",)}
    views = [ReplicaView(r, 0, frozenset(), frozenset()) for r in ids]
    views[0] = ReplicaView("r0", 0, frozenset({"b"}), frozenset({"b", "c", "d"}))
    tiers = rank_replicas("b", views, rng=random.Random(0), home=plc["b"])
    assert [r.replica_id for r in tiers[0]] == ["r3"]
    holders["b"] = ["r0", "r3"]
    assert plan_placement(shares, ids, cfg, holders, prev=plc) == {"b": ("r3",)}
    assert plan_placement(shares, ids, cfg, holders) == {}  # without it b counts half at r0
    # no move under the threshold, none without enough requests counted
    calm = {**shares, "b": 0.10}
    assert plan_placement(calm, ids, cfg, {**holders, "b": ["r0"]}) == {}
    counts = {a: 15.0 for a in shares}
    few = PlacementConfig(4, headroom=1.5, min_replicas=2, min_count=16, max_moves=1)
    assert plan_placement(shares, ids, few, holders, counts) == {}


def test_a_moved_adapter_that_turns_hot_is_placed_with_its_holders_first():
    """A single home is dropped once the adapter is hot: it gets k homes, holders first."""
    from deployments.placement import PlacementConfig, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    cfg = PlacementConfig(max_loras=4, headroom=1.5, min_replicas=2, max_moves=1)
    plc = plan_placement({"b": 0.4}, ids, cfg, {"b": ["r3", "r0"]}, prev={"b": ("r3",)})
    assert len(plc["b"]) == 3 and set(plc["b"][:2]) == {"r0", "r3"}


def test_in_tail_is_outside_the_rank_most_requested_by_brute_force():
    from deployments.placement import TAIL_REFRESH, AdapterPopularity

    rng = random.Random(7)
    pop = AdapterPopularity(half_life=500)
    names = [f"a{i}" for i in range(60)]
    weights = [1 / (i + 1) for i in range(60)]
    for n in range(1, 3000):
        pop.record(rng.choices(names, weights)[0] if rng.random() < 0.9 else "")
        if n % TAIL_REFRESH:
            continue  # the threshold is recomputed every TAIL_REFRESH records
        for rank in (5, 20):
            counts = sorted(pop.counts.values(), reverse=True)
            for a in names:
                expected = len(counts) > rank and pop.count(a) <= counts[rank]
                assert pop.in_tail(a, rank) == expected, (n, rank, a)
    assert not AdapterPopularity().in_tail("a", 3)  # nothing counted: no tail yet


def _loaded(ids: list[str], load: float) -> list[ReplicaView]:
    return [ReplicaView(r, load, frozenset(), frozenset()) for r in ids]


def test_fleet_load_gate_by_hand():
    """An exponential average over 100 observations of the mean load per replica: on at
    2.0, off under 1.0. From 2.0 on an idle fleet: 2 x 0.99^k < 1 first at k = 69. Between
    the thresholds it keeps its state. From 1.5 at 3 per replica: 3 - 1.5 x 0.99^k >= 2
    first at k = 41."""
    from deployments.placement import FleetLoad

    ids = ["r0", "r1", "r2", "r3"]
    gate = FleetLoad(min_load=2.0, window=100)
    assert [gate.observe(_loaded(ids, 0.0)) for _ in range(69)] == [True] * 68 + [False]
    assert not any(gate.observe(_loaded(ids, 1.5)) for _ in range(2000))
    assert [gate.observe(_loaded(ids, 3.0)) for _ in range(41)] == [False] * 40 + [True]
    mixed = [
        ReplicaView(r, x, frozenset(), frozenset()) for r, x in zip(ids, (6, 0, 0, 0), strict=True)
    ]
    assert all(gate.observe(mixed) for _ in range(2000))  # the fleet's mean, 1.5: stays on
    assert abs(gate.mean - 1.5) < 1e-6
    always = FleetLoad(min_load=0.0)
    assert all(always.observe(_loaded(ids, 0.0)) for _ in range(1000))
    with pytest.raises(ValueError, match="min_load"):
        FleetLoad(min_load=-1.0)


def test_planner_homes_only_while_the_fleet_is_loaded():
    """PlacementPlanner.home: the placed homes while the fleet is loaded, None while it is
    light (FleetLoad), the plan kept up to date meanwhile; min_load 0 places at any load."""
    from deployments.placement import PlacementConfig, PlacementPlanner

    ids = [f"r{i}" for i in range(4)]
    cfg = PlacementConfig(max_loras=4)
    for min_load, placed_when_light in ((2.0, False), (0.0, True)):
        planner = PlacementPlanner(cfg, first_replan=1, min_load=min_load)
        for a in ["hot"] * 60 + [""] * 40:
            planner.record(a)
        busy, idle = _loaded(ids, 4.0), _loaded(ids, 0.0)
        homes = planner.home("hot", ids, busy)
        assert homes is not None and len(homes) == 4  # k = ceil(0.6 x 4 x 2), all four
        assert planner.home("cold", ids, busy) is None  # never counted: not placed
        light = [planner.home("hot", ids, idle) for _ in range(200)]
        assert (light[-1] == homes) is placed_when_light
        for _ in range(1000):  # the plan follows the counts while the gate is off
            planner.record("b")
        planner.home("hot", ids, idle)
        assert "b" in planner.placement(ids)
