"""Serve autoscaling of LLMServer with the adapter-aware policy, on a local Ray instance.

The deployment autoscales between 1 and 2 replicas with `cluster.autoscaling:
AdapterAwarePolicy`. `target_ongoing_requests` is set far above the load, so Ray's own rule
(ongoing requests / target) never asks for a second replica: the scale-up can only come from
the custom metrics that `LLMServer.record_autoscaling_stats` reports (3 adapters wanted on a
replica with `max_loras=1`), which proves they reach the policy. When the load stops, the
wanted adapters drop to 0 and the deployment goes back to 1 replica.
"""

import threading
import time

import pytest

from deployments.protocol import GenerateRequest, SamplingSpec
from tests.serve_fixtures import make_tiny_adapters, start_ray, stop_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

APP = "raylora-autoscale"
ADAPTERS = ("s1", "s2", "s3")
ENGINE = {"max_loras": 1, "max_cpu_loras": 4, "max_num_seqs": 8, "num_kv_blocks": 128}
AUTOSCALING = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 100,  # Ray's request-count rule alone stays at 1 replica
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "look_back_period_s": 2.0,
    "metrics_interval_s": 0.5,
    "policy": {
        "policy_function": "cluster.autoscaling:AdapterAwarePolicy",
        "policy_kwargs": {"slot_target": 0.9, "max_miss_ratio": 0.5},
    },
}


def num_running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or "LLMServer" not in app.deployments:
        return 0
    return app.deployments["LLMServer"].replica_states.get("RUNNING", 0)


def wait_for(pred, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if pred():
            return time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tiny_model_dir):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.llm_server import LLMServer

    root = tmp_path_factory.mktemp("adapters")
    adapters = {n: str(p) for n, p in make_tiny_adapters(tiny_model_dir, root, ADAPTERS).items()}
    start_ray()  # loopback only; no HTTP proxy (the test uses a handle)
    try:
        deployment = serve.deployment(
            LLMServer,
            name="LLMServer",
            autoscaling_config=AUTOSCALING,
            ray_actor_options={"num_cpus": 0.5},
            max_ongoing_requests=16,
            graceful_shutdown_timeout_s=5,
            request_router_config=RequestRouterConfig(
                request_router_class="deployments.router:AdapterAffinityRouter",
                request_routing_stats_period_s=1.0,
            ),
        )
        app = deployment.bind(
            engine_config={"model": tiny_model_dir, **ENGINE},
            adapters=adapters,
            report_interval_s=1.0,
            shutdown_timeout_s=2.0,
        )
        yield serve.run(app, name=APP, route_prefix=None)
    finally:
        stop_ray()


def stream_until(llm, stop: threading.Event, worker: int, done: list, errors: list) -> None:
    i = worker
    while not stop.is_set():
        adapter = ADAPTERS[i % len(ADAPTERS)]
        i += 1
        request = GenerateRequest(
            f"w{worker}-{i}",
            SamplingSpec(max_tokens=24, ignore_eos=True, temperature=0),
            prompt=f"request {i} for {adapter}",
        )
        try:
            gen = llm.options(stream=True, multiplexed_model_id=adapter).generate.remote(request)
            items = list(gen)
            assert items and items[-1].finished
            done.append(adapter)
        except Exception as e:  # reported by the test, not swallowed
            errors.append(repr(e))


def test_record_autoscaling_stats_shape(llm):
    stats = llm.record_autoscaling_stats.remote().result()
    assert set(stats) == {
        "num_adapters_wanted",
        "max_loras",
        "num_waiting_for_slot",
        "adapter_loads_per_s",
        "requests_per_s",
    }
    assert stats["max_loras"] == ENGINE["max_loras"]
    assert all(isinstance(v, float) for v in stats.values())


def test_record_routing_stats_reports_what_the_router_bounds_on(llm):
    """The AdapterAffinityRouter's placement takes max_loras, its load bound max_num_seqs."""
    stats = llm.record_routing_stats.remote().result()
    assert stats["max_loras"] == ENGINE["max_loras"]
    assert stats["max_num_seqs"] == ENGINE["max_num_seqs"]
    assert stats["engine_dead"] is False and stats["num_running"] >= 0
    assert isinstance(stats["reads_shared"], bool)  # the values: tests/test_shared_adapters.py


def test_scales_up_under_adapter_load_and_back_down(llm):
    assert num_running_replicas() == 1
    stop, done, errors = threading.Event(), [], []
    workers = [
        threading.Thread(target=stream_until, args=(llm, stop, w, done, errors), daemon=True)
        for w in range(6)
    ]
    for t in workers:
        t.start()
    try:
        up_s = wait_for(lambda: num_running_replicas() == 2, 90, "a second replica")
    finally:
        stop.set()
        for t in workers:
            t.join(60)
    assert not errors, errors[:3]
    assert len(done) > 0 and set(done) == set(ADAPTERS)
    down_s = wait_for(lambda: num_running_replicas() == 1, 60, "back to one replica")
    print(f"\nscale-up after {up_s:.1f}s of load; down {down_s:.1f}s after; {len(done)} streams")
    # still serving after the downscale
    after = GenerateRequest("after", SamplingSpec(max_tokens=4, temperature=0), prompt="after")
    out = llm.options(multiplexed_model_id="s1").complete.remote(after)
    assert out.result().finished
