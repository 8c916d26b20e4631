"""The app on a fake 3-node Ray cluster (ray.cluster_utils.Cluster): a head and 2 workers.

Each worker offers one `llm_slot` custom resource and each LLMServer replica asks for one,
so the 2 replicas land on different workers (and none on the head, which keeps the ingress,
as a real head node would). Checks: adapter affinity and the AdapterRegistry across nodes;
a worker node that dies loses no non-streaming request (the ingress retries a request whose
replica died, see `deployments/ingress.py:ServeLLMBackend.complete`); new requests keep
being served; a new node brings the deployment back to 2 replicas.
"""

import os
import threading
import time

import pytest

from tests.serve_fixtures import REPO, make_tiny_adapters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "raylora"
ADAPTERS = [f"m{i}" for i in range(6)]
ENGINE = {"max_loras": 2, "max_cpu_loras": 8, "max_num_seqs": 8, "num_kv_blocks": 128}
LOOPBACK = "127.0.0.1"
# Fast node-death detection (defaults take ~30 s).
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


def llm_replica_nodes() -> dict[str, str]:
    """LLMServer replica actor name -> node id, from the GCS actor table (no dashboard)."""
    import ray

    out = {}
    for actor in ray._private.state.actors().values():
        if actor["State"] == "ALIVE" and "LLMServer" in actor.get("ActorClassName", ""):
            out[actor["Name"]] = actor["Address"]["NodeID"]
    return out


def with_actor_options(app, **ray_actor_options):
    """Replace the ray_actor_options of an Application's top deployment (its bound
    arguments stay)."""
    app._bound_deployment = app._bound_deployment.options(ray_actor_options=ray_actor_options)
    return app


def add_worker(c):
    return c.add_node(node_ip_address=LOOPBACK, num_cpus=1, resources={"llm_slot": 1})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    import serve_app

    root = tmp_path_factory.mktemp("adapters")
    adapters = make_tiny_adapters(tiny_model_dir, root, ADAPTERS)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p
    )
    # Every node on loopback: conftest.py sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, without
    # which ray.init(address="127.0.0.1:port") rewrites loopback to the host's routable IP.
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "node_ip_address": LOOPBACK,
            "num_cpus": 1,
            "resources": {"head": 1},
            "include_dashboard": False,
            "_system_config": SYSTEM_CONFIG,
        },
    )
    workers = [add_worker(c) for _ in range(2)]
    try:
        ray.init(address=c.address, namespace="raylora-tests", _node_ip_address=LOOPBACK)
        serve.start(proxy_location="Disabled")  # the test talks through handles
        args = {
            "model": tiny_model_dir,
            "adapters": ",".join(f"{n}={p}" for n, p in adapters.items()),
            "num_replicas": "2",
            "report_interval_s": "1",
            "routing_stats_period_s": "1",
            **{k: str(v) for k, v in ENGINE.items()},
        }
        app = with_actor_options(serve_app.build_app(args), num_cpus=0, resources={"head": 0.01})
        llm = app._bound_deployment.init_args[0]
        with_actor_options(llm, num_cpus=0.5, resources={"llm_slot": 1})
        serve.run(app, name=APP, route_prefix=None)
        yield {"cluster": c, "workers": workers}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    from deployments.client import RayLoRAClient

    return RayLoRAClient(app_name=APP)


def complete(client, adapter: str, i: int) -> dict:
    out = client.complete(f"request {i}", adapter=adapter, max_tokens=8, temperature=0)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    return out


def test_replicas_on_different_worker_nodes(cluster):
    nodes = llm_replica_nodes()
    worker_ids = {w.node_id for w in cluster["workers"]}
    assert len(nodes) == 2, nodes
    assert set(nodes.values()) == worker_ids


def test_affinity_and_registry_across_nodes(cluster, client):
    from deployments.registry import get_registry
    from tests.serve_fixtures import replica_stats

    for rnd in range(3):
        for adapter in ADAPTERS:
            complete(client, adapter, rnd)
    stats = replica_stats(APP, want=2)
    assert len(stats) == 2
    holders = {a: [rid for rid, s in stats.items() if a in s["adapters_in_cpu"]] for a in ADAPTERS}
    # Affinity: with sequential requests every adapter stays on exactly one replica.
    assert all(len(h) == 1 for h in holders.values()), holders
    loads = sum(s["lora"]["loads"] for s in stats.values())
    assert loads == len(ADAPTERS), loads  # each adapter read from disk once, cluster-wide

    # The registry (a single actor, somewhere in the cluster) knows both replicas' residency.
    deadline = time.monotonic() + 15
    while True:
        residency = get_registry().snapshot.remote()
        import ray

        residency = ray.get(residency)["residency"]
        reported = {a: [r for r, e in residency.items() if a in e["cpu"]] for a in ADAPTERS}
        if reported == holders or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert reported == holders
    assert set(residency) == set(stats)
    # ... and it lives on the head node, so losing a worker node never restarts it empty.
    from deployments.registry import _on_head_node

    head = cluster["cluster"].head_node.node_id
    assert _on_head_node() == {"resources": {"node:__internal_head__": 0.001}}
    registry_id = get_registry()._actor_id.hex()
    assert ray._private.state.actors()[registry_id]["Address"]["NodeID"] == head


def test_node_loss_loses_no_request(cluster, client):
    from ray import serve

    c, workers = cluster["cluster"], cluster["workers"]
    stop = threading.Event()
    done: list[tuple[float, str]] = []
    errors: list[str] = []

    def loop(worker: int) -> None:
        i = worker
        while not stop.is_set():
            adapter = ADAPTERS[i % len(ADAPTERS)]
            i += 1
            try:
                complete(client, adapter, i)
                done.append((time.monotonic(), adapter))
            except Exception as e:  # counted, not swallowed
                errors.append(repr(e))

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        num_before = len(done)
        victim = workers[0]
        c.remove_node(victim, allow_graceful=False)
        removed_at = time.monotonic()
        time.sleep(12)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    after = [d for d in done if d[0] > removed_at + 5]
    print(f"\n{num_before} requests before the node loss, {len(done)} in all, errors {errors[:3]}")
    assert not errors, errors[:3]
    assert num_before > 0
    assert {a for _, a in after} == set(ADAPTERS), "every adapter served by the survivor"
    nodes = llm_replica_nodes()
    assert victim.node_id not in nodes.values()

    # A new node: Serve schedules the replacement replica there.
    new = add_worker(c)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status = serve.status().applications[APP].deployments["LLMServer"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    assert set(llm_replica_nodes().values()) == {workers[1].node_id, new.node_id}
    for adapter in ADAPTERS:
        complete(client, adapter, -1)
