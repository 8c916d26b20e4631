"""AdapterAffinityRouter with fake replicas, a fake clock and a fake registry (no cluster):
affinity, the load bound, bursts, base requests and their prefixes, the registry snapshot.
Placement, the batch bound and the tail rule: tests/test_router_placement.py."""

import asyncio
from collections import Counter

import pytest
from ray.serve.request_router import PendingRequest

from deployments.routing_policy import rendezvous_order
from tests.router_fakes import (
    IDS,
    Clock,
    FakeRegistry,
    FakeReplica,
    first_choice,
    make_router,
    request,
    route,
    set_load,
)


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

    return request("", args=[GenerateRequest("r", prompt=prompt)])


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
