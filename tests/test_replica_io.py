"""deployments/replica_io.py: the AutoscalingSampler's custom metrics an LLMServer reports for
cluster.autoscaling.AdapterAwarePolicy, computed by hand here (the Ray test in
test_autoscaling_cluster.py checks only their names on a live replica); the adapter names a
replica starts with."""

import pytest

from deployments.replica_io import AutoscalingSampler, LoRAIds, initial_adapters
from deployments.routing_policy import prefix_routing_key

pytestmark = pytest.mark.timeout(30)


def test_autoscaling_metrics_count_requests_blocked_on_slots_and_rates():
    now = [100.0]
    sampler = AutoscalingSampler(clock=lambda: now[0])
    stats = {"adapters_in_slots": ["a", "b"], "lora": {"activations": 5}}
    # 2 adapters in flight, 2 slots: nobody waits for a slot, even for one not in a slot
    now[0] = 102.0
    got = sampler.sample(stats, 10, {"a": 3, "c": 1}, max_loras=2)
    assert got == {
        "num_adapters_wanted": 2.0,
        "max_loras": 2.0,
        "num_waiting_for_slot": 0.0,
        "adapter_loads_per_s": 2.5,  # 5 activations in 2 s
        "requests_per_s": 5.0,
    }
    # 3 adapters in flight for 2 slots: the requests of those not in a slot wait (c: 4, d: 2)
    now[0] = 106.0
    stats = {"adapters_in_slots": ["a", "b"], "lora": {"activations": 13}}
    got = sampler.sample(stats, 30, {"a": 1, "c": 4, "d": 2}, max_loras=2)
    assert got["num_waiting_for_slot"] == 6.0 and got["num_adapters_wanted"] == 3.0
    assert got["adapter_loads_per_s"] == 2.0 and got["requests_per_s"] == 5.0
    # two samples in the same instant: rates over at least 1 ms, not a division by zero
    got = sampler.sample(stats, 31, {}, max_loras=2)
    assert got["requests_per_s"] == pytest.approx(1000.0) and got["adapter_loads_per_s"] == 0.0


def test_initial_adapters_refuse_a_name_the_router_reads_as_a_prefix_key():
    """A configured adapter named like a base request's prompt-prefix key would be routed by
    hash, blind to where it is held: the replica refuses to start with it, naming it."""
    key = prefix_routing_key("You are a helpful assistant. " * 20, None, None)
    for name in (key, "prefix:sql"):
        with pytest.raises(ValueError, match="may not begin with 'prefix:'"):
            initial_adapters({"sql": "/a/sql", name: "/a/x"}, demo_adapters=False)
    assert initial_adapters({"sql": "/a/sql", "my-prefix:x": "/a/x"}, False) == {
        "sql": "/a/sql",
        "my-prefix:x": "/a/x",
    }
    with pytest.raises(ValueError, match="non-empty"):
        initial_adapters({"": "/a/x"}, demo_adapters=False)


def test_lora_ids_are_stable_per_name_dropped_when_forgotten_and_never_reused():
    ids = LoRAIds()
    a, b = ids.get("a"), ids.get("b")
    assert (ids.get("a"), ids.get("b")) == (a, b) and a != b and min(a, b) >= 1
    ids.forget("a")
    ids.forget("never-held")
    assert len(ids) == 1
    c = ids.get("c")  # a count-based id (len + 1) would give c b's id here
    assert c not in (a, b) and ids.get("b") == b
    assert ids.get("a") not in (a, b, c)  # a name loaded again gets a new id
