"""Routing simulator: invariants on a small fleet, and affinity vs power of two."""

from dataclasses import replace

import pytest

from cluster.sim import POLICIES, SimConfig, format_table, main, simulate, slot_load_floor

SMALL = SimConfig(
    num_replicas=4,
    max_loras=4,
    max_cpu_loras=16,
    max_num_seqs=8,
    max_ongoing_requests=16,
    num_adapters=60,
    zipf_s=1.1,
    num_requests=3000,
    utilization=0.6,
    prompt_tokens=64,
    output_tokens=16,
)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_within_the_slot_bound(policy):
    # check=True asserts, at every admission, <= max_loras distinct adapters running and
    # <= max_loras adapters in slots, and that every replica ends empty.
    res = simulate(policy, SMALL, check=True)
    assert res.num_completed == SMALL.num_requests
    assert sum(res.per_replica_served) == SMALL.num_requests
    assert 0 < res.ttft_p50_ms <= res.ttft_p99_ms
    assert res.disk_loads_per_1k <= res.slot_loads_per_1k
    assert 0 < res.top_slot_loads_per_1k < res.slot_loads_per_1k  # 16 of 60 adapters are "top"


def test_same_seed_same_result_and_affinity_loads_less_than_p2c():
    a1, a2 = simulate("affinity", SMALL), simulate("affinity", SMALL)
    assert a1.ttft_p99_ms == a2.ttft_p99_ms and a1.slot_loads_per_1k == a2.slot_loads_per_1k
    p2c = simulate("p2c", SMALL)
    assert a1.disk_loads_per_1k < 0.6 * p2c.disk_loads_per_1k
    assert a1.slot_loads_per_1k < p2c.slot_loads_per_1k


def test_no_policy_beats_the_slot_load_floor():
    # The floor is computed from the popularity law alone, not from the simulator: a policy
    # under it would mean the simulator misses loads. 200 adapters for 4 x 4 slots.
    cfg = replace(SMALL, num_adapters=200, zipf_s=0.9)
    floor = slot_load_floor(cfg)
    assert floor > 100
    for policy in POLICIES:
        assert simulate(policy, cfg).slot_loads_per_1k >= 0.95 * floor, policy
    assert slot_load_floor(replace(cfg, num_adapters=16)) < 1e-9  # all fit in slots


def test_base_only_traffic_needs_no_loads():
    res = simulate("affinity", replace(SMALL, base_fraction=1.0, num_requests=500), check=True)
    assert res.slot_loads_per_1k == 0 and res.num_completed == 500


def test_cli_prints_a_table(capsys):
    main(["--replicas", "3", "--adapters", "20", "--requests", "300", "--policies", "affinity,p2c"])
    out = capsys.readouterr().out
    assert "affinity" in out and "p2c" in out and "loads/1k" in out
    assert "slot-load floor for any router" in out
    assert format_table([]).startswith("policy")


def test_prefix_workload_hit_rates():
    """Tenants with 1,024-token system prompts: every policy's prefix hit rate stays under
    the share of prompt tokens a prefix can be (the simulator caches nothing it should not);
    with base tenants only, affinity (which hashes a base request's prefix) keeps each tenant
    on one replica and at least doubles power of two's hit rate."""
    cfg = replace(
        SMALL,
        num_requests=2000,
        system_prompt_tokens=1024,
        num_base_tenants=8,
        prefix_cache_tokens=4096,
        base_fraction=0.3,
    )
    bound = 1024 / (1024 + SMALL.prompt_tokens // 2)  # the shortest user turn
    for policy in ("affinity", "ray_multiplex", "prefix", "p2c"):
        res = simulate(policy, cfg, check=True)
        assert res.num_completed == cfg.num_requests
        assert 0 < res.prefix_hit_rate < bound, policy
    assert simulate("affinity", replace(cfg, prefix_cache_tokens=0)).prefix_hit_rate == 0
    base = replace(cfg, base_fraction=1.0)
    affinity, p2c = simulate("affinity", base), simulate("p2c", base)
    assert affinity.prefix_hit_rate >= 1.5 * p2c.prefix_hit_rate
    assert affinity.ttft_p50_ms < p2c.ttft_p50_ms
