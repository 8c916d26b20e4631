"""Fakes for AdapterAffinityRouter's tests (tests/test_router*.py): replicas, a clock, a
registry, and routing one request through a router with them: no cluster."""

import asyncio

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.router import AdapterAffinityRouter

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


def request(adapter: str, request_id: str = "r", args: list | None = None) -> PendingRequest:
    """A pending request for `adapter` ("" for the base model; `args`: the method's, where a
    prompt matters). Make it inside a running event loop (its future needs one)."""
    meta = RequestMetadata(
        request_id=request_id, internal_request_id=request_id, multiplexed_model_id=adapter
    )
    return PendingRequest(args=args or [], kwargs={}, metadata=meta)


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
