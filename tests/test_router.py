"""AdapterAffinityRouter with fake replicas, a fake clock and a fake registry: no cluster."""

import asyncio
from collections import Counter

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.router import AdapterAffinityRouter
from deployments.routing_policy import rendezvous_order

DEP = DeploymentID(name="LLMServer", app_name="raylora")
IDS = [f"r{i}" for i in range(6)]


class FakeReplica:
    """The RunningReplica attributes the router reads."""

    def __init__(self, uid: str, slots=(), cpu=(), running=0, waiting=0, multiplexed=()):
        self.replica_id = ReplicaID(unique_id=uid, deployment_id=DEP)
        self.routing_stats = {
            "adapters_in_slots": list(slots),
            "adapters_in_cpu": list(cpu),
            "num_running": running,
            "num_waiting": waiting,
        }
        self.multiplexed_model_ids = set(multiplexed)
        self.max_ongoing_requests = 64


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeRegistry:
    def __init__(self) -> None:
        self.snapshot: dict = {"version": 0, "adapters": {}, "residency": {}}
        self.fail = False
        self.calls = 0

    async def fetch(self) -> dict:
        self.calls += 1
        if self.fail:
            raise ConnectionError("registry restarting")
        return self.snapshot


def make_router(registry: FakeRegistry | None = None, clock: Clock | None = None, **kwargs):
    router = AdapterAffinityRouter(
        deployment_id=DEP,
        handle_source=DeploymentHandleSource.UNKNOWN,
        get_curr_time_s=clock or Clock(),
    )
    registry = registry or FakeRegistry()
    router.initialize_state(seed=0, fetch_snapshot=registry.fetch, **kwargs)
    return router


def request(adapter: str) -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id="r", multiplexed_model_id=adapter)
    return PendingRequest(args=[], kwargs={}, metadata=meta)


def route(router, replicas, adapter: str, pr: list | None = None):
    """choose_replicas in a fresh loop (PendingRequest needs one for its future)."""

    async def go():
        pending = request(adapter)
        if pr is not None:
            pr.append(pending)
        return await router.choose_replicas(replicas, pending)

    return asyncio.run(go())


def first_choice(router, replicas, adapter: str) -> str:
    return route(router, replicas, adapter)[0][0].replica_id.unique_id


def set_load(router, replica: FakeReplica, n: int) -> None:
    router.replica_queue_len_cache.update(replica.replica_id, n)


def test_affinity_same_adapter_same_replica_while_under_bound():
    router = make_router(use_registry=False)
    reps = [FakeReplica(i) for i in IDS]
    home = rendezvous_order("ad-1", IDS)[0]
    for r in reps:
        set_load(router, r, 3)
    assert {first_choice(router, reps, "ad-1") for _ in range(20)} == {home}
    # A replica that holds the adapter in a slot wins over the home without it.
    other = rendezvous_order("ad-1", IDS)[3]
    reps = [FakeReplica(i, slots=["ad-1"] if i == other else []) for i in IDS]
    assert first_choice(router, reps, "ad-1") == other


def test_an_adapter_stays_on_its_holder_over_the_bound():
    """Moving an adapter costs a cold read and someone else's slot: it stays on its holder
    however loaded (Ray's queue cap, applied to every tier, is the spill); the next tier is
    the new home, the least loaded of the replicas with the fewest adapters."""
    router = make_router(use_registry=False)
    order = rendezvous_order("hot", IDS)
    reps = {i: FakeReplica(i, cpu=["hot"] if i == order[0] else []) for i in IDS}
    for i, r in reps.items():
        set_load(router, r, 20 if i == order[0] else (2 if i == order[1] else 1))
    tiers = route(router, list(reps.values()), "hot")
    assert [r.replica_id.unique_id for r in tiers[0]] == [order[0]]
    assert [r.replica_id.unique_id for r in tiers[1]] == [order[2]]  # 0 adapters, load 1


def test_a_burst_of_new_adapters_is_dealt_one_per_replica():
    """Residency reaches the router late; the adapters it just sent count until it does
    (router_memory.RecentRoutes), so six new adapters at once land on six replicas."""
    router = make_router(use_registry=False)
    reps = [FakeReplica(i) for i in IDS]
    picks = []
    for k in range(len(IDS)):
        pending: list = []
        tiers = route(router, reps, f"new-{k}", pending)
        pick = tiers[0][0]
        router.on_request_routed(pending[0], pick.replica_id, None)
        picks.append(pick.replica_id.unique_id)
    assert sorted(picks) == sorted(IDS)
    # A second request for each, before any replica reported it, goes where the first went
    # (it is being read there), not to a new home: one disk read per adapter.
    assert [first_choice(router, reps, f"new-{k}") for k in range(len(IDS))] == picks


def test_a_burst_for_one_new_adapter_opens_one_home():
    """Ray routes a burst concurrently and reports each route (on_request_routed) only
    after the replica accepted it: the first request's new home counts as reading the
    adapter from the moment it is chosen, so the rest of the burst follows it there."""
    router = make_router(use_registry=False)
    reps = [FakeReplica(i) for i in IDS]
    first = first_choice(router, reps, "new")
    set_load(router, reps[IDS.index(first)], 3)  # sent, not yet accepted nor reported
    assert {first_choice(router, reps, "new") for _ in range(5)} == {first}
    # Ray sent it elsewhere after all: the note expires; no other replica read it since.
    router._get_curr_time_s.t += 10.0
    assert first_choice(router, reps, "new") != first  # the least loaded new home again


def test_load_from_routing_stats_when_cache_is_empty():
    router = make_router(use_registry=False)
    order = rendezvous_order("ad-2", IDS)
    reps = [FakeReplica(i, running=30 if i == order[0] else 0) for i in IDS]
    assert first_choice(router, reps, "ad-2") == order[1]


def test_base_requests_spread_over_all_replicas():
    router = make_router(use_registry=False)
    reps = [FakeReplica(i) for i in IDS]
    counts = Counter(first_choice(router, reps, "") for _ in range(600))
    assert set(counts) == set(IDS)
    assert min(counts.values()) > 600 / len(IDS) * 0.6


def test_replica_leaving_reranks():
    router = make_router(use_registry=False)
    order = rendezvous_order("ad-3", IDS)
    reps = [FakeReplica(i, slots=["ad-3"] if i == order[0] else []) for i in IDS]
    assert first_choice(router, reps, "ad-3") == order[0]
    left = [r for r in reps if r.replica_id.unique_id != order[0]]
    assert first_choice(router, left, "ad-3") == order[1]


def test_registry_snapshot_residency_and_staleness():
    registry, clock = FakeRegistry(), Clock()
    router = make_router(registry, clock, registry_max_age_s=30.0)
    order = rendezvous_order("ad-4", IDS)
    holder = order[2]
    registry.snapshot = {
        "version": 1,
        "adapters": {"ad-4": {}},
        "residency": {holder: {"slots": ["ad-4"], "cpu": ["ad-4"], "last_report": clock.t}},
    }
    reps = [FakeReplica(i) for i in IDS]  # routing_stats know nothing yet
    assert asyncio.run(router.refresh_registry_once())
    assert first_choice(router, reps, "ad-4") == holder

    # The registry goes down: the last snapshot is kept while it is fresh enough.
    registry.fail = True
    clock.t += 10
    assert not asyncio.run(router.refresh_registry_once())
    assert first_choice(router, reps, "ad-4") == holder
    # Too old: ignored, routing falls back to the hash order (no error).
    clock.t += 60
    assert first_choice(router, reps, "ad-4") == order[0]


def test_background_refresh_never_blocks_routing():
    registry = FakeRegistry()
    gate = asyncio.Event

    async def go():
        blocked = gate()

        async def slow_fetch():
            registry.calls += 1
            await blocked.wait()
            return registry.snapshot

        router = make_router(registry)
        router._fetch_snapshot = slow_fetch
        reps = [FakeReplica(i) for i in IDS]
        tiers = await asyncio.wait_for(router.choose_replicas(reps, request("ad-5")), 1.0)
        await asyncio.sleep(0)
        router._refresh_task.cancel()
        return tiers

    tiers = asyncio.run(go())
    assert tiers[0][0].replica_id.unique_id == rendezvous_order("ad-5", IDS)[0]
    assert registry.calls == 1


def test_should_backoff_and_bad_kwargs():
    router = make_router(use_registry=False)
    pending: list = []
    route(router, [FakeReplica("r0")], "a", pending)
    assert pending[0].routing_context.should_backoff
    with pytest.raises(TypeError):
        router.initialize_state(load_bound=2)  # typo of load_bound_c
    with pytest.raises(ValueError):
        router.initialize_state(load_bound_c=0.5)


def _base_request(prompt: str) -> PendingRequest:
    from deployments.protocol import GenerateRequest

    meta = RequestMetadata(request_id="r", internal_request_id="r", multiplexed_model_id="")
    return PendingRequest(args=[GenerateRequest("r", prompt=prompt)], kwargs={}, metadata=meta)


def test_base_requests_with_a_shared_system_prompt_stay_on_one_replica():
    """A base tenant's requests (same long system prompt, other user turns) go where the
    first one went, while it is under the load bound, so the engine's prefix cache serves
    them; short prompts keep power of two choices; another tenant hashes elsewhere."""
    router = make_router()
    replicas = [FakeReplica(uid) for uid in IDS]
    by_id = {r.replica_id.unique_id: r for r in replicas}

    def send(prompt: str) -> str:
        async def go():
            pending = _base_request(prompt)
            tiers = await router.choose_replicas(replicas, pending)
            chosen = tiers[0][0]
            router.on_request_routed(pending, chosen.replica_id, None)
            return chosen.replica_id.unique_id

        return asyncio.run(go())

    system_a = "You are the billing assistant of ACME. " * 20  # ~800 characters
    system_b = "You are a pirate who answers in rhymes. " * 20
    homes_a = {send(f"{system_a}\nUser: question {i}") for i in range(10)}
    homes_b = {send(f"{system_b}\nUser: question {i}") for i in range(10)}
    assert len(homes_a) == 1 and len(homes_b) == 1
    key_a = next(iter(router._prefix_holders))
    assert key_a.startswith("prefix:")
    # over the load bound, the tenant spills along its hash order, and the holder is kept
    home = homes_a.pop()
    by_id[home].routing_stats["num_running"] = 40
    spilled = send(f"{system_a}\nUser: one more")
    assert spilled != home
    short = Counter(send(f"hi {i}") for i in range(60))  # no prefix: spread
    assert len(short) >= 4


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
            meta = RequestMetadata(
                request_id=rid, internal_request_id=rid, multiplexed_model_id=adapter
            )
            pending = PendingRequest(args=[], kwargs={}, metadata=meta)
            router.on_request_routed(pending, replica.replica_id, None)

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
