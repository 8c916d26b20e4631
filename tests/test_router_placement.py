"""AdapterAffinityRouter with fake replicas (no cluster): the placement it counts and
applies, the batch bound the replicas report, and the tail rule's kept slots."""

import asyncio

import pytest

from deployments.routing_policy import rendezvous_order
from tests.router_fakes import (
    IDS,
    FakeReplica,
    first_choice,
    make_router,
    request,
    route,
    set_load,
)


def test_placement_counts_routed_requests_and_grows_a_hot_adapter_onto_its_homes():
    """With max_loras known (the kwarg, or the replicas' routing stats), the router counts
    what it routes; after a replan, a hot adapter (half the traffic over 6 replicas:
    k = ceil(0.5 x 6 x 2) = 6) stays first on the replica it was sent to, then grows onto
    one more of its homes at a time (the next tier), then the other homes."""
    for kwargs, stats in (({"max_loras": 4}, None), ({}, 4)):
        router = make_router(use_registry=False, replan_every=10, **kwargs)
        reps = [FakeReplica(i) for i in IDS]
        if stats:
            for r in reps:
                r.routing_stats["max_loras"] = stats
        first_choice(router, reps, "cold-0")  # learns max_loras from the stats if needed
        sent: dict[str, set[str]] = {}
        for k in range(40):
            pending: list = []
            adapter = "hot" if k % 2 == 0 else f"cold-{k}"
            pick = route(router, reps, adapter, pending)[0][0].replica_id
            router.on_request_routed(pending[0], pick, None)
            sent.setdefault(adapter, set()).add(pick.unique_id)
        pop = router.popularity
        assert pop is not None and pop.count("hot") == 20 and pop.total == 40
        (holder,) = sent["hot"]  # every request of it went to one replica
        tiers = [[r.replica_id.unique_id for r in t] for t in route(router, reps, "hot")]
        assert tiers[0] == [holder]
        assert len(tiers[1]) == 1 and tiers[1] != [holder]
        homes = {holder, *tiers[1], *tiers[2]}
        assert len(homes) == 6 and len(tiers[2]) == 4


def test_a_lightly_loaded_fleet_keeps_a_hot_adapter_on_its_holder():
    """placement_min_load (placement.FleetLoad): after 100 requests on an idle fleet the
    placement is off, and a hot adapter whose holder passes the load bound stays there, as
    an adapter that is not placed does; with 0 it grows onto its next home."""
    for min_load, stays in ((None, True), (0.0, False)):
        kwargs = {} if min_load is None else {"placement_min_load": min_load}
        router = make_router(use_registry=False, replan_every=10, max_loras=4, **kwargs)
        reps = [FakeReplica(i) for i in IDS]
        sent: set[str] = set()
        for k in range(100):
            pending: list = []
            adapter = "hot" if k % 2 == 0 else f"cold-{k}"
            pick = route(router, reps, adapter, pending)[0][0].replica_id
            router.on_request_routed(pending[0], pick, None)
            if adapter == "hot":
                sent.add(pick.unique_id)
        (holder,) = sent
        reps[IDS.index(holder)].routing_stats["adapters_in_cpu"] = ["hot"]  # reported now
        set_load(router, reps[IDS.index(holder)], 20)
        assert (first_choice(router, reps, "hot") == holder) is stays


def test_no_placement_without_a_slot_count():
    """The router counts from its first request, but without a slot count (no kwarg, no
    routing stats) it places nothing: a hot adapter stays on its holder alone."""
    router = make_router(use_registry=False, replan_every=4)
    reps = [FakeReplica(i) for i in IDS]
    holder = rendezvous_order("ad-9", IDS)[0]
    for _ in range(20):  # more than PlacementConfig.min_count
        pending: list = []
        assert route(router, reps, "ad-9", pending)[0][0].replica_id.unique_id == holder
        router.on_request_routed(pending[0], reps[IDS.index(holder)].replica_id, None)
    assert router.popularity.count("ad-9") == 20
    reps[IDS.index(holder)].routing_stats["adapters_in_cpu"] = ["ad-9"]  # reported now
    set_load(router, reps[IDS.index(holder)], 20)  # over the bound: placed, it would grow
    tiers = route(router, reps, "ad-9")
    assert [r.replica_id.unique_id for r in tiers[0]] == [holder]
    # learnt from the routing stats: placed now (k = ceil(1 x 6 x 2) = 6), the next home
    # under the bound comes first
    for r in reps:
        r.routing_stats["max_loras"] = 4
    tiers = route(router, reps, "ad-9")
    assert tiers[0][0].replica_id.unique_id != holder


def test_a_full_batch_is_over_the_bound_when_the_replicas_report_their_batch_size():
    """A replica running max_num_seqs requests (its routing stats) is full even while a busy
    fleet lifts the mean bound over it: a new adapter goes elsewhere, where it starts now.
    Loads 8, 7, 7, 7, 7, 7: bound ceil(1.25 x 44 / 6) = 10 without the cap."""
    for kwargs, reported, full_is_picked in (
        ({}, None, True),  # nothing reported: no cap, the emptiest replica wins
        ({}, 8, False),
        ({"max_batch": 8}, None, False),
        ({"max_batch": 9}, 8, True),  # the kwarg wins over the reports
    ):
        router = make_router(use_registry=False, **kwargs)
        reps = [
            FakeReplica(i, cpu=[] if i == "r0" else [f"old-{i}"], running=8 if i == "r0" else 7)
            for i in IDS
        ]
        if reported:
            for r in reps:
                r.routing_stats["max_num_seqs"] = reported
        assert (first_choice(router, reps, "new-ad") == "r0") is full_is_picked, kwargs
    with pytest.raises(ValueError, match="max_batch"):
        make_router(max_batch=0)


def test_a_tail_adapter_avoids_a_holder_whose_slots_this_routers_requests_take():
    """The router counts its own requests in flight per replica (on_request_routed until
    on_request_completed): with max_loras other adapters in flight on the holder, a request
    for an adapter outside the n x max_loras most requested goes where a slot is free."""
    router = make_router(max_loras=1, use_placement=False)
    reps = [FakeReplica("r0", cpu=["t", "b1"]), FakeReplica("r1")]
    for _ in range(3):  # five adapters more requested than "t" (the router's rank: 2 x 1)
        for a in ("b1", "b2", "b3", "b4", "b5"):
            router.popularity.record(a)
    router.popularity.record("t")
    for _ in range(3):
        router.popularity.record("b1")  # the most requested
    assert router.popularity.in_tail("t", 4) and not router.popularity.in_tail("b1", 4)

    def sent(adapter: str, rid: str, replica: FakeReplica) -> None:
        async def go():  # a PendingRequest needs a running loop
            router.on_request_routed(request(adapter, rid), replica.replica_id, None)

        asyncio.run(go())

    assert route(router, reps, "t")[0] == [reps[0]]  # its holder, nothing in flight
    sent("x", "q1", reps[0])  # "x" takes r0's only slot
    assert route(router, reps, "t")[0] == [reps[1]]
    sent("y", "q2", reps[1])  # now both replicas' slots are taken: it waits on its holder
    assert route(router, reps, "t")[0] == [reps[0]]
    router.on_request_completed(reps[1].replica_id, "q2")
    assert route(router, reps, "b1")[0] == [reps[0]]  # a popular adapter waits on its holder
    router.on_request_completed(reps[0].replica_id, "q1")
    # r0 again (with r1, where the router sent "t" lately: RecentRoutes counts it as reading)
    assert reps[0] in route(router, reps, "t")[0]


def test_a_tail_adapter_leaves_a_popular_adapters_slot_only_where_the_read_is_shared():
    """r0 holds the tail adapter "t", and its only slot holds the popular "b1" (idle): a load
    of "t" there would evict it. "t" goes to r1, whose slot is free, if r1 reports
    reads_shared (a read there is a fetch from the shared tier); else it stays on r0, since
    the move would be a disk read (and r0 runs nothing: it does not wait there)."""
    router = make_router(max_loras=1, use_placement=False)
    reps = [FakeReplica("r0", slots=["b1"], cpu=["t", "b1"]), FakeReplica("r1")]
    for a in ("b1", "b1", "b1", "b2", "b2", "b3", "b3", "t"):
        router.popularity.record(a)
    assert router.popularity.in_tail("t", 2) and not router.popularity.in_tail("b1", 2)
    assert route(router, reps, "t")[0] == [reps[0]]
    reps[1].routing_stats["reads_shared"] = True
    assert route(router, reps, "t")[0] == [reps[1]]
    reps[0].routing_stats["adapters_in_slots"] = ["b3"]  # a tail adapter's slot: not kept
    # r0 again (with r1, where the router sent "t" just now: RecentRoutes counts it reading)
    assert set(route(router, reps, "t")[0]) == {reps[0], reps[1]}
