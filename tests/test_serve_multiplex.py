"""LLMServer replicas report their CPU-cache adapters to Ray Serve as multiplexed model ids,
and Ray's own router sees and uses them (the `ray_multiplex` peer of benchmarks/routing.py).

One local Serve app: the tiny model, 2 LLMServer replicas with Ray's default router
(`router=pow2`) and CPU caches of 2 adapters. What Ray's router knows is read from the
driver's own router for the handle (`RunningReplica.multiplexed_model_ids`, as the controller
broadcast them); what each replica holds from its `stats()`. A second app with
`report_multiplexed_ids=false` shows the ids come from this reporting and nothing else.
"""

from __future__ import annotations

import time
import uuid

import pytest

from deployments.protocol import GenerateRequest, SamplingSpec
from tests.serve_fixtures import make_tiny_adapters, replica_stats, start_ray, stop_ray

pytestmark = [pytest.mark.slow]

APP, APP_OFF = "multiplex", "no-multiplex"
ADAPTERS = ["m0", "m1", "m2", "m3", "m4"]
ENGINE = {"max_loras": 1, "max_cpu_loras": 2, "max_num_seqs": 4, "num_kv_blocks": 64}


def request() -> GenerateRequest:
    spec = SamplingSpec(max_tokens=2, temperature=0)
    return GenerateRequest(uuid.uuid4().hex, spec, prompt="The quick brown fox")


def router_ids(handle) -> dict[str, set[str]]:
    """replica id -> multiplexed model ids, as this process's Ray router for `handle` has
    them (Ray internals, pinned Ray version: the point is what the router really sees)."""
    request_router = handle._router._asyncio_router.request_router
    return {
        rid.unique_id: set(r.multiplexed_model_ids)
        for rid, r in request_router.curr_replicas.items()
    }


def cpu_caches(app: str, num_replicas: int) -> dict[str, set[str]]:
    return {r: set(s["adapters_in_cpu"]) for r, s in replica_stats(app, num_replicas).items()}


def until_equal(get_a, get_b, timeout_s: float = 15.0):
    """Poll until get_a() == get_b(); -> the last pair."""
    deadline = time.monotonic() + timeout_s
    while True:
        a, b = get_a(), get_b()
        if a == b or time.monotonic() > deadline:
            return a, b
        time.sleep(0.2)


@pytest.fixture(scope="module")
def handles(tmp_path_factory, tiny_model_dir):
    from ray import serve

    import serve_app

    root = tmp_path_factory.mktemp("multiplex-adapters")
    adapters = make_tiny_adapters(tiny_model_dir, root, ADAPTERS)
    start_ray(namespace="raylora-multiplex-tests")  # loopback only; no HTTP proxy
    try:
        common = {
            "model": tiny_model_dir,
            "adapters": ",".join(f"{n}={p}" for n, p in adapters.items()),
            "num_cpus": "0.5",
            "router": "pow2",
            **{k: str(v) for k, v in ENGINE.items()},
        }
        serve.run(serve_app.build_app({**common, "num_replicas": "2"}), name=APP, route_prefix=None)
        off = {**common, "num_replicas": "1", "report_multiplexed_ids": "false"}
        serve.run(serve_app.build_app(off), name=APP_OFF, route_prefix=None)
        get = serve.get_deployment_handle
        yield {"on": get("LLMServer", app_name=APP), "off": get("LLMServer", app_name=APP_OFF)}
    finally:
        stop_ray()


@pytest.mark.timeout(240)  # includes building both apps
def test_ray_router_sees_each_replicas_cpu_cache_and_routes_to_it(handles):
    handle = handles["on"]
    first = handle.options(multiplexed_model_id="m0")
    first.complete.remote(request()).result(timeout_s=60)
    ids, caches = until_equal(lambda: router_ids(handle), lambda: cpu_caches(APP, 2))
    assert ids == caches, (ids, caches)
    (holder,) = [r for r, held in caches.items() if "m0" in held]

    # Ray's router now sends m0 only to the replica reporting it: 10 more requests, no new
    # holder and no second read. (Without ids each would pick either replica: 2^-10.)
    for _ in range(10):
        first.complete.remote(request()).result(timeout_s=60)
    stats = replica_stats(APP, 2)
    assert [r for r, s in stats.items() if "m0" in s["adapters_in_cpu"]] == [holder]
    assert sum(s["lora"]["loads"] for s in stats.values()) == 1


@pytest.mark.timeout(120)
def test_evictions_reach_the_router_too(handles):
    handle = handles["on"]
    # 5 adapters into 2 x 2 cache entries: at least one is evicted, and must leave the
    # router's view as well (ids are pushed on every change of the cache, not only on growth).
    for adapter in ADAPTERS:
        handle.options(multiplexed_model_id=adapter).complete.remote(request()).result(timeout_s=60)
    ids, caches = until_equal(lambda: router_ids(handle), lambda: cpu_caches(APP, 2))
    assert ids == caches, (ids, caches)
    evicted = set(ADAPTERS) - set().union(*caches.values())
    assert evicted, caches
    assert not evicted & set().union(*ids.values()), ids


@pytest.mark.timeout(120)
def test_no_ids_when_reporting_is_off(handles):
    handle = handles["off"]
    handle.options(multiplexed_model_id="m1").complete.remote(request()).result(timeout_s=60)
    assert cpu_caches(APP_OFF, 1) == {next(iter(router_ids(handle))): {"m1"}}
    time.sleep(2.0)  # well past the 0.1 s push period and the controller's broadcast
    assert router_ids(handle) == {rid: set() for rid in router_ids(handle)}
