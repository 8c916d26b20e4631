"""AdapterAffinityRouter and AdapterRegistry end to end, on one local Ray Serve app.

Tiny model, 2 LLMServer replicas (half a CPU each), 4 tiny PEFT adapters, called through
a DeploymentHandle to LLMServer with `multiplexed_model_id` (the driver's handle runs the
AdapterAffinityRouter). Which replica served a request is read from the replicas' own
`stats()`: the adapters each holds (a replica only loads an adapter it served) and the
requests in flight at each replica.

Checks: sequential requests for an adapter stay on the replica that first read it, and new
adapters are dealt out evenly (one disk read each); a hot adapter, once the placement gives it
two homes, grows onto the other replica when its holder passes the load bound;
base-model requests spread; a restarted registry is rebuilt from the replicas' periodic
reports; a killed replica loses no new request and leaves the registry.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from deployments.protocol import GenerateRequest, ReplicaOutput, SamplingSpec
from tests.serve_fixtures import make_tiny_adapters, replica_stats, start_ray, stop_ray

pytestmark = [pytest.mark.slow]

APP = "raylora"
ADAPTERS = ["r0", "r1", "r2", "r3"]
HOT = "r3"  # not used by the affinity test, so both replicas start without it
ENGINE = {"max_loras": 2, "max_cpu_loras": 8, "max_num_seqs": 8, "num_kv_blocks": 128}
# min_load_bound=2: a replica with 2 requests of an adapter in flight is full once the
# total load is low (bound = max(2, ceil(1.25 * (total + 1) / 2))); replan_every=8: the
# placement sees a burst's adapter as hot (k = ceil(share x 2 x 1.5) = 2 homes) once 16 of
# its requests are counted; a seed makes the base-model power of two choices repeatable.
# max_loras: what build_app passes (the routing-stats path, for a router without it, is
# tests/test_router.py's): the placement exists from the first request, not from whenever
# the controller first pushes the replicas' routing stats (seconds late on a busy machine).
ROUTER_KWARGS = {
    "min_load_bound": 2,
    "seed": 0,
    "registry_refresh_s": 1.0,
    "replan_every": 8,
    "max_loras": ENGINE["max_loras"],
}
STALE_AFTER_S = 5.0  # the registry forgets a replica that stopped reporting after this
WAIT_S = 30.0


def poll(check: Callable[[], Any], timeout_s: float = WAIT_S, period_s: float = 0.5) -> Any:
    """check() until it returns something truthy (returned) or timeout_s passes (-> last)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = check()
        if out or time.monotonic() > deadline:
            return out
        time.sleep(period_s)


def request(max_tokens: int = 8, ignore_eos: bool = False) -> GenerateRequest:
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return GenerateRequest(uuid.uuid4().hex, spec, prompt="The quick brown fox")


def check_output(out: ReplicaOutput) -> ReplicaOutput:
    assert out.finished, out
    assert out.outputs[0].finish_reason in ("stop", "length"), out
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    import serve_app
    from deployments.registry import get_or_create_registry

    root = tmp_path_factory.mktemp("routing-adapters")
    adapters = make_tiny_adapters(tiny_model_dir, root, ADAPTERS)
    start_ray(namespace="raylora-routing-tests")  # loopback only; no HTTP proxy
    try:
        # Created here (before the replicas get_or_create it) to shorten its staleness
        # expiry; a restart re-runs the constructor with the same arguments.
        registry = get_or_create_registry(stale_after_s=STALE_AFTER_S)
        ray.get(registry.snapshot.remote())
        args = {
            "model": tiny_model_dir,
            "adapters": ",".join(f"{n}={p}" for n, p in adapters.items()),
            "num_replicas": "2",
            "num_cpus": "0.5",
            "report_interval_s": "1",
            "routing_stats_period_s": "1",
            **{k: str(v) for k, v in ENGINE.items()},
        }
        app = serve_app.build_app(args)
        # build_app exposes only load_bound_c of the router kwargs: set them all here.
        llm = app._bound_deployment.init_args[0]
        llm._bound_deployment = llm._bound_deployment.options(
            request_router_config=RequestRouterConfig(
                request_router_class="deployments.router:AdapterAffinityRouter",
                request_router_kwargs=ROUTER_KWARGS,
                request_routing_stats_period_s=1.0,
            )
        )
        serve.run(app, name=APP, route_prefix=None)
        yield {"handle": serve.get_deployment_handle("LLMServer", app_name=APP)}
    finally:
        stop_ray()


def snapshot() -> dict:
    import ray

    from deployments.registry import get_registry

    return ray.get(get_registry().snapshot.remote(), timeout=10)


def registry_pid() -> int | None:
    """The registry actor's process id; None while it is restarting."""
    import ray

    from deployments.registry import get_registry

    try:
        return ray.get(get_registry().__ray_call__.remote(lambda self: os.getpid()), timeout=5)
    except Exception:
        return None


def holders(stats: dict[str, dict], adapter: str) -> list[str]:
    return sorted(rid for rid, s in stats.items() if adapter in s["adapters_in_cpu"])


def replica_actor_name(replica_id: str) -> str:
    """The Serve replica actor's name ("SERVE_REPLICA::app#LLMServer#<id>"), from the GCS."""
    import ray

    for actor in ray._private.state.actors().values():
        name = actor.get("Name") or ""
        if actor["State"] == "ALIVE" and name.endswith(f"#LLMServer#{replica_id}"):
            return name
    raise LookupError(f"no live actor for replica {replica_id}")


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.timeout(240)  # includes building the app
def test_sequential_requests_stay_on_the_replica_that_read_the_adapter(served):
    handle = served["handle"]
    for _ in range(3):  # faster than the replicas report: the router's recent routes count
        for adapter in ADAPTERS[:3]:
            out = handle.options(multiplexed_model_id=adapter).complete.remote(request())
            check_output(out.result(timeout_s=60))
    stats = replica_stats(APP, want=2)
    assert len(stats) == 2, list(stats)
    held = {r: s["adapters_in_cpu"] for r, s in stats.items()}
    for adapter in ADAPTERS[:3]:
        assert len(holders(stats, adapter)) == 1, (adapter, held)
    # new adapters go to the replica with the fewest: 2 and 1, not 3 and 0
    assert sorted(len(a) for a in held.values()) == [1, 2], held
    assert sum(s["lora"]["loads"] for s in stats.values()) == 3  # each read from disk once


def burst(handle, num: int, max_tokens: int, while_running: Callable[[], bool] | None = None):
    """num concurrent requests of max_tokens tokens (EOS ignored); meanwhile, call
    while_running() until it returns True (up to 5 s). Returns whether it did."""
    responses = [handle.complete.remote(request(max_tokens, ignore_eos=True)) for _ in range(num)]
    seen = bool(while_running and poll(while_running, timeout_s=5, period_s=0.05))
    for r in responses:
        check_output(r.result(timeout_s=90))
    return seen


@pytest.mark.timeout(150)
def test_hot_adapter_spills_to_second_replica(served):
    handle = served["handle"].options(multiplexed_model_id=HOT)
    before = replica_stats(APP, want=2)
    assert holders(before, HOT) == []
    # Placed with 2 homes at the first replan after 16 of its requests are counted
    # (replan_every 8, min_placed_count 16: within the second burst), it grows onto
    # the second when its holder has 2 requests in flight (min_load_bound 2). A burst is
    # routed concurrently and the tiny model is fast: a burst may finish requests before
    # the router sees them in flight, so allow a few.
    after = before
    for _ in range(5):
        burst(handle, 12, 300)
        after = replica_stats(APP, want=2)
        if holders(after, HOT) == sorted(after):
            break
    assert holders(after, HOT) == sorted(after), {r: s["adapters_in_cpu"] for r, s in after.items()}


@pytest.mark.timeout(150)
def test_base_model_requests_spread(served):
    handle = served["handle"].options(multiplexed_model_id="")
    busy: set[str] = set()  # replicas seen with a request in flight

    def both_busy() -> bool:
        for rid, s in replica_stats(APP, want=2, timeout_s=5).items():
            if s["num_inflight"] > 0:
                busy.add(rid)
        return len(busy) == 2

    for _ in range(5):  # the tiny model may finish a burst between two looks
        if burst(handle, 8, 300, while_running=both_busy):
            break
    assert len(busy) == 2, busy


@pytest.mark.timeout(120)
def test_restarted_registry_is_rebuilt_from_reports(served):
    import ray

    from deployments.registry import get_registry

    stats = replica_stats(APP, want=2)
    expected = {rid: sorted(s["adapters_in_cpu"]) for rid, s in stats.items()}
    assert all(expected.values()), expected
    old = get_registry()
    old_pid = registry_pid()
    killed_at = time.time()
    ray.kill(old, no_restart=False)
    # ray.kill returns before the actor is gone: first wait for the new incarnation, so
    # the old state cannot pass for a rebuilt one.
    assert poll(lambda: registry_pid() not in (None, old_pid)), "registry did not restart"

    def rebuilt() -> dict | None:
        try:
            snap = snapshot()
        except Exception:  # restarting
            return None
        residency = snap["residency"]
        cpu = {r: sorted(e["cpu"]) for r, e in residency.items()}
        fresh = all(e["last_report"] >= killed_at for e in residency.values())
        ok = fresh and cpu == expected and set(snap["adapters"]) >= set(ADAPTERS)
        return snap if ok else None

    snap = poll(rebuilt)
    assert snap, f"registry not rebuilt: {snapshot()} (want residency {expected})"


@pytest.mark.timeout(180)
def test_killed_replica_loses_no_new_request_and_leaves_registry(served):
    import ray

    from deployments.client import RayLoRAClient

    stats = replica_stats(APP, want=2)
    adapter = ADAPTERS[0]
    (victim,) = holders(stats, adapter)
    (survivor,) = set(stats) - {victim}
    assert poll(lambda: victim in snapshot()["residency"]), snapshot()
    ray.kill(ray.get_actor(replica_actor_name(victim), namespace="serve"), no_restart=True)

    # Through the ingress (which retries a request whose replica died): nothing fails.
    client = RayLoRAClient(app_name=APP)
    for i in range(4):
        out = client.complete(f"after the kill {i}", adapter=adapter, max_tokens=8, temperature=0)
        assert out["choices"][0]["finish_reason"] in ("stop", "length")

    # The registry forgets the dead replica once it stops reporting (staleness expiry).
    def forgotten() -> bool:
        return victim not in snapshot()["residency"]

    assert poll(forgotten, timeout_s=STALE_AFTER_S + WAIT_S), snapshot()["residency"]

    # Serve replaces it; direct handle requests then succeed and land on live replicas.
    assert poll(lambda: running_replicas() == 2, timeout_s=90, period_s=1)
    handle = served["handle"].options(multiplexed_model_id=adapter)
    for _ in range(3):
        check_output(handle.complete.remote(request()).result(timeout_s=60))
    live = replica_stats(APP, want=2)
    assert victim not in live and survivor in live, list(live)
    assert holders(live, adapter), {r: s["adapters_in_cpu"] for r, s in live.items()}
    assert victim not in snapshot()["residency"]
