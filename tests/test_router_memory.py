"""deployments/router_memory.py: what a router remembers of its own sends."""

from deployments.router_memory import InFlight, RecentRoutes
from deployments.routing_policy import ReplicaView


def view(rid: str, slots=(), cpu=()) -> ReplicaView:
    return ReplicaView(rid, 0, frozenset(slots), frozenset(cpu))


def test_inflight_counts_a_routers_requests_until_they_finish():
    inflight = InFlight(max_age_s=60)
    inflight.sent("q1", "r0", "a", now=0)
    inflight.sent("q2", "r0", "a", now=0)
    inflight.sent("q3", "r0", "b", now=0)
    inflight.sent("q3", "r0", "b", now=0)  # the same request twice: counted once
    inflight.sent("q4", "r1", "", now=0)  # base requests hold no slot
    inflight.sent("q5", "r1", "prefix:abc", now=0)
    views = inflight.apply([view("r0"), view("r1")])
    assert views[0].adapters_running == {"a", "b"} and views[1].adapters_running == set()
    inflight.done("q1")
    inflight.done("q3")
    inflight.done("q3")  # twice, or never sent: ignored
    inflight.done("nope")
    assert inflight.apply([view("r0")])[0].adapters_running == {"a"}
    inflight.done("q2")
    assert inflight.apply([view("r0")])[0].adapters_running == set()
    # a completion that never comes expires after max_age_s
    for i in range(1024):
        inflight.sent(f"old{i}", "r2", f"x{i % 3}", now=0)
    for i in range(1024):
        inflight.sent(f"new{i}", "r3", "y", now=100)
    assert inflight.apply([view("r2"), view("r3")])[0].adapters_running == set()
    assert inflight.apply([view("r3")])[0].adapters_running == {"y"}


def test_recent_routes_count_as_reading_until_reported_or_expired():
    recent = RecentRoutes(grace_s=2.0)
    recent.record("r0", "a", 10.0)
    recent.record("r0", "", 10.0)  # base requests are not counted
    recent.record("r1", "b", 10.0)
    views = recent.apply([view("r0"), view("r1", cpu=["b"])], 11.0)
    assert views[0].adapters_reading == {"a"}  # sent, not reported yet
    assert views[1].adapters_reading == set()  # r1 reports it: nothing left to add
    assert recent.apply([view("r0")], 12.5)[0].adapters_reading == set()  # after grace_s


def test_a_chosen_request_runs_there_until_sent_done_or_expired():
    inflight = InFlight(chosen_s=2.0)
    inflight.chosen("q1", "r0", "a", now=0)
    inflight.chosen("q2", "r0", "", now=0)  # base requests hold no slot
    inflight.chosen("q3", "r1", "prefix:abc", now=0)
    views = inflight.apply([view("r0"), view("r1")], now=1)
    assert views[0].adapters_running == {"a"} and views[1].adapters_running == set()
    assert views[0].load == 0  # Ray counts the load itself as it sends
    assert inflight.apply([view("r0")])[0].adapters_running == set()  # no clock: sent only
    assert inflight.apply([view("r0")], now=1, request_id="q1")[0].adapters_running == set()
    inflight.chosen("q1", "r1", "a", now=1)  # ranked again: the later choice replaces it
    views = inflight.apply([view("r0"), view("r1")], now=1)
    assert views[0].adapters_running == set() and views[1].adapters_running == {"a"}
    inflight.sent("q1", "r0", "a", now=1)  # Ray sent it to r0 after all (r1's queue full)
    views = inflight.apply([view("r0"), view("r1")], now=10)
    assert views[0].adapters_running == {"a"} and views[1].adapters_running == set()
    inflight.chosen("q1", "r1", "a", now=10)  # sent already: a later ranking changes nothing
    assert inflight.apply([view("r1")], now=10)[0].adapters_running == set()
    inflight.done("q1")
    inflight.chosen("q4", "r0", "b", now=10)
    inflight.done("q4")  # finished (failed) before Ray reported it routed
    inflight.chosen("q5", "r1", "c", now=10)
    assert inflight.apply([view("r0"), view("r1")], now=11.9)[1].adapters_running == {"c"}
    views = inflight.apply([view("r0"), view("r1")], now=12.1)  # sent nowhere: expired
    assert views[0].adapters_running == set() and views[1].adapters_running == set()


def test_a_burst_of_tail_requests_sees_the_requests_chosen_before_it():
    """Ray ranks a burst's requests concurrently and reports each routed only after its
    replica accepted it. r0 holds the tail adapters "x" and "t" in its CPU cache and has one
    slot: "x", ranked first, takes it, so "t", ranked before "x" is reported routed, goes to
    r1 where a slot is free, as it would once "x" is reported (test_router's
    test_a_tail_adapter_avoids_a_holder_whose_slots_this_routers_requests_take)."""
    import asyncio

    from ray.serve.request_router import PendingRequest

    from tests.router_fakes import FakeReplica, make_router, request

    router = make_router(max_loras=1, use_placement=False)
    reps = [FakeReplica("r0", cpu=["t", "x"]), FakeReplica("r1")]
    for _ in range(3):  # five adapters more requested than "t" and "x" (the tail rank: 2 x 1)
        for a in ("b1", "b2", "b3", "b4", "b5"):
            router.popularity.record(a)
    router.popularity.record("t")
    router.popularity.record("x")
    assert router.popularity.in_tail("t", 2) and router.popularity.in_tail("x", 2)

    async def rank(adapter: str, rid: str) -> tuple[PendingRequest, list[str]]:
        pending = request(adapter, rid)
        tiers = await router.choose_replicas(reps, pending)
        return pending, [r.replica_id.unique_id for r in tiers[0]]

    async def burst() -> None:
        clock = router._get_curr_time_s
        x, first = await rank("x", "q1")
        assert first == ["r0"]
        assert (await rank("t", "q2"))[1] == ["r1"]  # "x" not reported routed yet
        assert (await rank("x", "q1"))[1] == ["r0"]  # x ranked again: its own choice ignored
        router.on_request_routed(x, reps[1].replica_id, None)  # Ray sent "x" to r1 after all
        router.on_request_completed(reps[1].replica_id, "q2")  # "t" failed before routed
        assert (await rank("t", "q3"))[1] == ["r0"]  # r1's slot is x's now
        router.on_request_completed(reps[1].replica_id, "q1")
        clock.t += 2.5  # what RecentRoutes noted (read at r1) expires
        assert (await rank("x", "q4"))[1] == ["r0"]  # chosen for r0, never sent
        assert (await rank("t", "q5"))[1] == ["r1"]
        clock.t += 2.5  # both choices expire
        assert (await rank("t", "q6"))[1] == ["r0"]

    asyncio.run(burst())
