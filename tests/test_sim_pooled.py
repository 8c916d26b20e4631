"""cluster/sim_pooled.py: the pooled cache's eviction rules against brute force, and the
slot floor of a system that must learn the shares (cluster/sim_floors.py) against them."""

from collections import OrderedDict
from collections.abc import Sequence
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.sim_config import SimConfig
from cluster.sim_pooled import RULES, belady_loads, keyed_loads, pooled_loads

SEQS = st.lists(st.sampled_from("abcde"), max_size=12)


def fewest_loads(seq: str, slots: int) -> int:
    """Every eviction choice tried (demand loading): the fewest loads any rule can make."""

    @cache
    def go(i: int, held: frozenset[str]) -> int:
        if i == len(seq):
            return 0
        a = seq[i]
        if a in held:
            return go(i + 1, held)
        if len(held) < slots:
            return 1 + go(i + 1, held | {a})
        return 1 + min(go(i + 1, (held - {b}) | {a}) for b in held)

    return go(0, frozenset())


def lru_loads(seq: Sequence[str], slots: int) -> int:
    held: OrderedDict[str, None] = OrderedDict()
    loads = 0
    for a in seq:
        if a in held:
            held.move_to_end(a)
            continue
        loads += 1
        if len(held) >= slots:
            held.popitem(last=False)
        held[a] = None
    return loads


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(seq=SEQS, slots=st.integers(1, 4))
def test_belady_is_the_fewest_loads_of_any_eviction(seq, slots):
    best = fewest_loads("".join(seq), slots)
    assert belady_loads(seq, slots) == best
    for key in (lambda a, c, _t: c[a], lambda _a, _c, t: t, lambda a, c, t: (c[a], -t)):
        assert keyed_loads(seq, slots, key) >= best


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(seq=SEQS, slots=st.integers(1, 4))
def test_keyed_by_last_use_is_lru(seq, slots):
    assert keyed_loads(seq, slots, lambda _a, _c, t: t) == lru_loads("".join(seq), slots)


@pytest.mark.timeout(60)
def test_lfu_keeps_the_most_requested_where_lru_does_not():
    # 2 slots: after a a b, lfu has c evict b (1 request against a's 2), then b evict c
    seq = list("aabcb")
    assert keyed_loads(seq, 2, lambda a, c, _t: c[a]) == 4  # a, b, c, b
    # lru has c evict a (used before b), and b is still held
    assert keyed_loads(seq, 2, lambda _a, _c, t: t) == 3


@pytest.mark.timeout(60)
def test_pooled_rules_on_a_trace():
    cfg = SimConfig(num_replicas=2, max_loras=3, num_adapters=40, num_requests=600)
    loads = {rule: pooled_loads(cfg, rule) for rule in RULES}
    # nothing beats the clairvoyant rule; with room for every adapter only first loads remain
    assert all(loads["belady"] <= v for v in loads.values())
    roomy = SimConfig(num_replicas=8, max_loras=5, num_adapters=40, num_requests=600)
    assert len({pooled_loads(roomy, rule) for rule in RULES}) == 1
    with pytest.raises(ValueError, match="rule must be one of"):
        pooled_loads(cfg, "fifo")


def test_learner_floor_by_hand():
    """One slot, two adapters with shares 2/3 and 1/3 (Zipf 1), trace ranks 0 1 0 0 1: two
    first loads; before the third request both were asked for once (the slot holds one:
    the tied pair's mean share 1/2 is missed), before the fourth and fifth adapter 1 is the
    less asked for (1/3 each). 2 + 1/2 + 2/3 loads over 5 requests."""
    from cluster.sim_floors import learner_slot_floor_per_1k, slot_load_floor

    cfg = SimConfig(
        num_replicas=1, max_loras=1, num_adapters=2, zipf_s=1.0, base_fraction=0.0, num_requests=5
    )
    assert learner_slot_floor_per_1k(cfg, [0, 1, 0, 0, 1]) == pytest.approx(1000 * (2 + 7 / 6) / 5)
    assert learner_slot_floor_per_1k(cfg, [0, 0, 0]) == pytest.approx(1000 * 1 / 5)  # fits
    learned = learner_slot_floor_per_1k(cfg, [0, 1, 0, 0, 1])
    assert slot_load_floor(cfg, learned) == pytest.approx(1000 * (2 + 7 / 6) / 5)


@pytest.mark.timeout(60)
def test_rules_that_learn_the_shares_stay_over_the_learner_floor():
    """The floor bounds the expected loads of any rule not told the shares: over 120 traces
    LFU and LRU on the pool average over it, while `oracle` (told the shares) averages
    under it: the floor is what learning costs, not a bound for every rule."""
    from dataclasses import replace

    from cluster.sim_floors import learner_slot_floor_per_1k
    from cluster.sim_pooled import rule_loads
    from cluster.sim_workload import adapter_ranks, adapter_trace

    base = SimConfig(
        num_replicas=2,
        max_loras=5,
        num_adapters=60,
        zipf_s=1.2,
        base_fraction=0.0,
        num_requests=600,
    )
    sums = dict.fromkeys(("floor", "lfu", "lru", "oracle"), 0.0)
    for seed in range(120):
        cfg = replace(base, seed=seed)
        seq = adapter_trace(cfg)
        sums["floor"] += learner_slot_floor_per_1k(cfg, adapter_ranks(cfg))
        for rule in ("lfu", "lru", "oracle"):
            sums[rule] += 1000 * rule_loads(cfg, rule, seq, 10) / cfg.num_requests
    mean = {k: v / 120 for k, v in sums.items()}
    assert mean["lfu"] > mean["floor"] + 3 and mean["lru"] > mean["floor"] + 50
    assert mean["oracle"] < mean["floor"] - 3


@pytest.mark.timeout(60)
def test_the_sweep_marks_a_slot_miss_under_the_learner_floor():
    from dataclasses import replace

    from cluster.sim import simulate
    from cluster.sim_floors import learner_slot_floor_per_1k, slot_load_floor
    from cluster.sim_sweep import PEER, Run, _mark
    from cluster.sim_workload import adapter_ranks

    cfg = SimConfig(num_replicas=2, max_loras=2, num_adapters=30, num_requests=300)
    result = simulate(PEER, cfg)
    peer = replace(result, slot_loads_per_1k=100.0)
    ours = replace(result, slot_loads_per_1k=95.0)  # 0.95x the peer's: a miss

    def run(floor: float) -> Run:
        return Run(0, 0, cfg, {"affinity": ours, PEER: peer}, floor, 0.0, floor)

    assert run(89.0).misses()[:1] == ["slot"]
    assert _mark(run(89.0), "slot") == "slot"  # 0.89x the peer is not ruled out
    assert _mark(run(91.0), "slot") == "slot*"  # the floor itself is over 0.9x
    # the run's floor is the larger of the law's and the learner's on its own trace: here
    # (32 slots, 100 adapters) most of the tail is asked for once or twice
    roomy = SimConfig(
        num_replicas=4, max_loras=8, num_adapters=100, zipf_s=1.3, num_requests=600, utilization=0.4
    )
    ranks = adapter_ranks(roomy)
    learn = learner_slot_floor_per_1k(roomy, ranks)
    assert learn > 1.2 * slot_load_floor(roomy) and slot_load_floor(roomy, learn) == learn
    law_wins = learner_slot_floor_per_1k(cfg, adapter_ranks(cfg))
    assert slot_load_floor(cfg, law_wins) == slot_load_floor(cfg)


def _two_slots(eviction: str) -> SimConfig:
    """One replica of two slots whose loads, reads and prefills take no time."""
    return SimConfig(
        num_replicas=1,
        max_loras=2,
        disk_load_ms=0.0,
        cpu_load_ms=0.0,
        prefill_ms_per_token=0.0,
        engine="config",
        eviction=eviction,
        shared_tier_ms=None,
    )


@pytest.mark.timeout(60)
def test_forced_evictions_by_hand():
    """An eviction is forced when the adapter the rule ranks last is running: the engine
    must evict a more requested idle one instead."""
    from cluster.sim_config import Request
    from cluster.sim_replica import Replica

    cfg = _two_slots("frequency")
    r = Replica("r", cfg, check=True)
    r.admitted = []
    bs = [Request(i, "b", 0.0, prompt_tokens=1, output_tokens=1) for i in range(3)]
    for b in bs:
        r.enqueue(b, 0.0)
    assert r.schedule(0.0) == bs
    for b in bs:
        r.complete(b, b.finish)
    a = Request(3, "a", 1000.0, prompt_tokens=1, output_tokens=100)
    r.enqueue(a, 1000.0)
    assert r.schedule(1000.0) == [a]  # the free slot: no eviction
    c = Request(4, "c", 1001.0, prompt_tokens=1, output_tokens=1)
    r.enqueue(c, 1001.0)
    assert r.schedule(1001.0) == [c]
    # a (1 request) ranks last but runs: c evicts b (3 requests)
    assert (r.evictions, r.forced_evictions) == (1, 1) and set(r.slots) == {"a", "c"}
    r.complete(c, c.finish)
    r.complete(a, a.finish)
    d = Request(5, "d", 5000.0, prompt_tokens=1, output_tokens=1)
    r.enqueue(d, 5000.0)
    assert r.schedule(5000.0) == [d]
    # a and c: one request each, both idle; a is the least recently used
    assert (r.evictions, r.forced_evictions) == (2, 1) and set(r.slots) == {"c", "d"}
    assert r.admitted == ["b", "b", "b", "a", "c", "d"]


@pytest.mark.timeout(60)
def test_replica_replay_bounds_the_engine():
    from collections import Counter

    from cluster.sim import simulate
    from cluster.sim_pooled import replica_replay
    from cluster.sim_workload import adapter_trace

    cfg = SimConfig(num_replicas=3, max_loras=2, num_adapters=30, num_requests=400)
    result, loads = replica_replay(cfg)
    admitted = [a for seq in result.admitted for a in seq]
    assert Counter(admitted) == Counter(adapter_trace(cfg))  # each admitted once, somewhere
    engine = round(result.slot_loads_per_1k * result.num_completed / 1000)
    pairs = sum(len(set(seq)) for seq in result.admitted)  # first loads on each replica
    # the engine loads on exactly these sequences with max_loras slots: Belady is its floor
    assert pairs <= loads["belady"] <= engine
    assert all(loads["belady"] <= n for n in loads.values())
    assert 0 < result.forced_eviction_share <= 1
    roomy = SimConfig(num_replicas=3, max_loras=30, num_adapters=30, num_requests=400)
    result, loads = replica_replay(roomy)
    pairs = sum(len(set(seq)) for seq in result.admitted)
    assert set(loads.values()) == {pairs} and result.forced_eviction_share == 0
    assert simulate("affinity", cfg).admitted == [[], [], []]  # recorded only when asked


@pytest.mark.timeout(60)
def test_clairvoyant_eviction_is_belady_on_one_replica():
    """One replica, requests that take no time (never two at once): the engine's admitted
    sequence is the trace, no slot is busy at an eviction, and evicting by the trace's future
    makes exactly Belady's loads, by the true rates exactly the pool's `oracle` rule's; the
    replica's own frequency eviction makes more."""
    from cluster.sim import simulate
    from cluster.sim_pooled import rule_loads
    from cluster.sim_workload import adapter_trace

    cfg = SimConfig(
        num_replicas=1,
        max_loras=3,
        num_adapters=12,
        num_requests=600,
        zipf_s=0.9,
        utilization=1e-6,  # arrivals ~1e6 service times apart
        prefill_ms_per_token=0.0,
        decode_ms_per_token=1e-6,
        cpu_load_ms=0.0,
        disk_load_ms=0.0,
        shared_tier_ms=None,
        residency_push_ms=0.0,
    )
    seq = adapter_trace(cfg)
    loads = {
        p: round(simulate(p, cfg).slot_loads_per_1k * cfg.num_requests / 1000)
        for p in ("affinity@clairvoyant", "affinity", "affinity@vllm", "affinity@shares")
    }
    assert loads["affinity@clairvoyant"] == belady_loads(seq, cfg.max_loras)
    assert loads["affinity@shares"] == rule_loads(cfg, "oracle", seq, cfg.max_loras)
    assert loads["affinity@vllm"] == lru_loads(seq, cfg.max_loras)  # vLLM's engine: LRU
    assert loads["affinity"] > loads["affinity@clairvoyant"]


@pytest.mark.timeout(60)
def test_clairvoyant_eviction_by_hand():
    from cluster.sim_config import Request
    from cluster.sim_replica import NextRequest, Replica

    cfg = _two_slots("clairvoyant")
    with pytest.raises(ValueError, match="trace's future"):
        Replica("r", cfg, check=True)
    trace = [
        Request(0, "b", 0.0, prompt_tokens=1, output_tokens=1),
        Request(1, "c", 1.0, prompt_tokens=1, output_tokens=1),
        Request(2, "d", 1000.0, prompt_tokens=1, output_tokens=1),
        Request(3, "c", 2000.0, prompt_tokens=1, output_tokens=1),
        Request(4, "b", 3000.0, prompt_tokens=1, output_tokens=1),
    ]
    future = NextRequest(trace)
    assert (future.after("c", 1.0), future.after("b", 3000.0), future.after("x", 0.0)) == (
        2000.0,
        float("inf"),
        float("inf"),
    )
    r = Replica("r", cfg, check=True, next_request=future)
    for req in trace[:3]:
        r.enqueue(req, req.arrival)
        assert r.schedule(req.arrival) == [req]
        r.complete(req, req.finish)
    # d's load evicts b (next asked for at 3000), not c (2000), though c is the more recent
    assert set(r.slots) == {"c", "d"}


@pytest.mark.timeout(120)
def test_cli_summarises_seeds(capsys):
    """`python -m cluster.sim_pooled --seeds 0-1 --policies ...`: a line per seed with each
    policy's loads, then each policy's mean ratio to the peer over the seeds."""
    import re

    from cluster.sim_pooled import main

    main(
        [
            "--point",
            "23",
            "--seeds",
            "0-1",
            "--requests",
            "600",
            "--policies",
            "affinity@clairvoyant",
        ]
    )
    out = capsys.readouterr().out
    per_seed = re.findall(
        r"affinity ([\d.]+), ray_multiplex ([\d.]+),.*affinity@clairvoyant ([\d.]+)", out
    )
    assert len(per_seed) == 2
    ours = [float(a) / float(p) for a, p, _ in per_seed]
    mean = re.search(r"  affinity: mean ([\d.]+).*met on (\d) of 2", out)
    assert mean and abs(float(mean.group(1)) - sum(ours) / 2) < 0.002  # printed to 1 decimal
    assert int(mean.group(2)) == sum(r <= 0.9 for r in ours)
    assert re.search(r"  affinity@clairvoyant: mean [\d.]+ \(standard error", out)


def _serial(seq: Sequence[str]) -> list[tuple[float, float, str]]:
    """Holds that never overlap: each request finishes before the next is admitted."""
    return [(2.0 * i, 2.0 * i + 1, a) for i, a in enumerate(seq)]


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(ranks=st.lists(st.integers(0, 5), max_size=14), slots=st.integers(1, 3))
def test_pinned_pool_without_overlap_is_the_pool(ranks, slots):
    """With no two requests running at once no slot is ever held at a miss: the pinned pool
    makes exactly the pooled cache's loads, rule for rule."""
    from cluster.sim_pooled import pinned_pool_loads, rule_loads
    from cluster.sim_workload import adapter_name

    cfg = SimConfig(num_replicas=1, max_loras=slots, num_adapters=6)
    seq = [adapter_name(k) for k in ranks]
    for rule in ("belady", "oracle", "lfu"):
        assert pinned_pool_loads(cfg, _serial(seq), rule) == rule_loads(cfg, rule, seq, slots)


@pytest.mark.timeout(60)
def test_pinned_pool_by_hand():
    """Two slots. a runs over [0, 10], b over [1, 2]; c at 3 must evict b (a runs) whatever
    the rule; a at 4 is a hit. Then d at 5 with a and c running ([3, 20]): no idle slot, so
    the pool runs over (a load, nothing evicted); b at 21 finds all three idle and evicts
    two of them."""
    from cluster.sim_pooled import pinned_pool_loads

    cfg = SimConfig(num_replicas=1, max_loras=2, num_adapters=6)
    holds = [(0, 10, "a"), (1, 2, "b"), (3, 20, "c"), (4, 6, "a"), (5, 7, "d"), (21, 22, "b")]
    for rule in ("belady", "oracle", "lfu"):
        assert pinned_pool_loads(cfg, holds, rule) == 5  # a b c d b
    # c admitted at 2, when b's request finishes: the finish frees b's slot first, so c
    # evicts b and b's next request loads it again (had c come first, the pool would have
    # run over with b kept, and b at 4 would be a hit: 3 loads)
    timed = [(0, 2, "b"), (0, 10, "a"), (2, 3, "c"), (4, 5, "b")]
    assert pinned_pool_loads(cfg, timed, "lfu") == 4
    with pytest.raises(ValueError, match="rule must be belady"):
        pinned_pool_loads(cfg, holds, "lru")


@pytest.mark.timeout(120)
def test_run_holds_are_its_adapter_requests():
    from collections import Counter

    from cluster.sim import simulate
    from cluster.sim_pooled import pinned_pool_loads
    from cluster.sim_workload import adapter_trace

    cfg = SimConfig(num_replicas=3, max_loras=2, num_adapters=30, num_requests=400)
    run = simulate("affinity", cfg, record_admissions=True)
    assert Counter(a for _, _, a in run.holds) == Counter(adapter_trace(cfg))
    assert all(0 <= t0 < t1 for t0, t1, _ in run.holds)
    # every adapter's first request is a load, whatever the rule
    first = len(set(adapter_trace(cfg)))
    assert all(pinned_pool_loads(cfg, run.holds, r) >= first for r in ("belady", "lfu"))
    assert simulate("affinity", cfg).holds == []  # recorded only when asked
