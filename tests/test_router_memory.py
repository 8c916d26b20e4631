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
