"""rank_replicas / rendezvous_order against brute-force references and hashing properties."""

import hashlib
import math
import os
import random
import subprocess
import sys
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.routing_policy import ReplicaView, load_bound, rank_replicas, rendezvous_order

IDS = [f"r{i}" for i in range(8)]


def view(rid: str, load: float = 0, slots=(), cpu=()) -> ReplicaView:
    return ReplicaView(rid, load, frozenset(slots), frozenset(cpu))


def ref_order(adapter: str, ids: list[str]) -> list[str]:
    """Brute force: score every pair with blake2b, highest first."""

    def score(rid: str) -> int:
        d = hashlib.blake2b(f"{adapter}\x00{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "big")

    return sorted(ids, key=lambda r: (-score(r), r))


def ref_rank(adapter: str, replicas: list[ReplicaView], c: float, min_bound: int) -> list[str]:
    """Brute force of the documented tiers: ids of tiers 0-2 (single replicas)."""
    n, total = len(replicas), sum(r.load for r in replicas)
    bound = max(1, min_bound, math.ceil(c * (total + 1) / n))
    by_id = {r.replica_id: r for r in replicas}
    under = [by_id[i] for i in ref_order(adapter, list(by_id)) if by_id[i].load + 1 <= bound]
    picks = [
        next((r for r in under if adapter in r.adapters_in_slots), None),
        next((r for r in under if adapter in r.adapters_in_cpu), None),
        under[0] if under else None,
    ]
    out: list[str] = []
    for r in picks:
        if r is not None and r.replica_id not in out:
            out.append(r.replica_id)
    return out


def test_order_is_input_order_independent_and_matches_reference():
    for a in ("a", "adapter-7", "x" * 40):
        assert rendezvous_order(a, IDS) == ref_order(a, IDS)
        assert rendezvous_order(a, list(reversed(IDS))) == ref_order(a, IDS)


def test_order_is_stable_across_processes():
    code = "from deployments.routing_policy import rendezvous_order as o; print(o('ad-1', [f'r{i}' for i in range(8)]))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and outs.pop().strip() == str(rendezvous_order("ad-1", IDS))


def test_removing_a_replica_keeps_the_others_in_order():
    for k in range(200):
        a = f"ad-{k}"
        full = rendezvous_order(a, IDS)
        gone = full[k % len(full)]
        assert rendezvous_order(a, [i for i in IDS if i != gone]) == [i for i in full if i != gone]


def test_first_choices_are_spread_evenly():
    firsts = Counter(rendezvous_order(f"ad-{k}", IDS)[0] for k in range(4000))
    expected = 4000 / len(IDS)
    chi2 = sum((firsts[i] - expected) ** 2 / expected for i in IDS)
    assert chi2 < 24.3  # p = 0.001 for 7 degrees of freedom


def test_load_bound_idle_and_busy():
    assert load_bound(0, 16, 1.25) == 1  # idle: every replica is under the bound
    assert load_bound(159, 16, 1.25) == math.ceil(1.25 * 160 / 16)
    assert load_bound(3, 4, 1.25, min_bound=4) == 4  # light load: nobody is "full" yet
    assert load_bound(159, 16, 1.25, min_bound=4) == math.ceil(1.25 * 160 / 16)


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    slot_mask=st.integers(0, 255),
    cpu_mask=st.integers(0, 255),
    adapter=st.sampled_from(["a", "b", "hot", "cold-7"]),
    c=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    min_bound=st.sampled_from([1, 2, 4]),
)
def test_rank_matches_reference(loads, slot_mask, cpu_mask, adapter, c, min_bound):
    replicas = [
        view(
            f"r{i}",
            load,
            slots=[adapter] if slot_mask >> i & 1 else [],
            cpu=[adapter] if (cpu_mask | slot_mask) >> i & 1 else [],
        )
        for i, load in enumerate(loads)
    ]
    tiers = rank_replicas(
        adapter, replicas, load_bound_c=c, min_load_bound=min_bound, rng=random.Random(0)
    )
    flat = [r.replica_id for t in tiers for r in t]
    assert sorted(flat) == sorted(r.replica_id for r in replicas)  # each replica exactly once
    singles = ref_rank(adapter, replicas, c, min_bound)
    assert singles, "with integer loads some replica is always under the bound"
    assert [t[0].replica_id for t in tiers[: len(singles)]] == singles
    assert all(len(t) == 1 for t in tiers[: len(singles)])
    rest = tiers[len(singles) :]
    assert len(rest) <= 1 and all(
        x.load <= y.load for t in rest for x, y in zip(t, t[1:], strict=False)
    )


def test_cold_adapter_stays_on_first_choice_hot_adapter_spreads_along_its_order():
    order = rendezvous_order("hot", IDS)
    loads = dict.fromkeys(IDS, 0)
    resident: dict[str, set[str]] = {i: set() for i in IDS}
    used: list[str] = []
    for _ in range(40):  # nothing completes: "hot" takes all the load
        reps = [view(i, loads[i], slots=resident[i]) for i in IDS]
        pick = rank_replicas("hot", reps, rng=random.Random(0))[0][0].replica_id
        loads[pick] += 1
        resident[pick].add("hot")
        if pick not in used:
            used.append(pick)
    assert used == order[: len(used)]  # spreads in its own order, one replica at a time

    # With other traffic balanced around it, one request stays on its first choice.
    reps = [view(i, 10) for i in IDS]
    assert (
        rank_replicas("cold", reps, rng=random.Random(0))[0][0].replica_id
        == (rendezvous_order("cold", IDS)[0])
    )


def test_base_requests_power_of_two():
    rng = random.Random(1)
    reps = [view(i, load) for i, load in zip(IDS, [5, 0, 3, 3, 9, 1, 2, 4], strict=True)]
    firsts: Counter = Counter()
    for _ in range(2000):
        tiers = rank_replicas("", reps, rng=rng)
        assert len(tiers[0]) == 2 and tiers[0][0].load <= tiers[0][1].load
        assert sorted(r.replica_id for t in tiers for r in t) == sorted(IDS)
        firsts[tiers[0][0].replica_id] += 1
    # The busiest replica never wins a pair; the idlest wins every pair it is in (~1/4).
    assert firsts["r4"] == 0
    assert abs(firsts["r1"] / 2000 - 2 / 8) < 0.05


def test_empty_and_single():
    assert rank_replicas("a", [], rng=random.Random(0)) == []
    one = [view("r0", 100)]
    assert [[r.replica_id for r in t] for t in rank_replicas("a", one, rng=random.Random(0))] == [
        ["r0"]
    ]


def test_prefix_key_of_a_chat_is_its_conversation_before_the_last_turn():
    """A chat tenant's requests (one system prompt, other user turns) share a key, even when
    the system prompt is shorter than the key's 512 characters; another system prompt gets
    another key; a short conversation, or a short prompt, gets none."""
    from deployments.routing_policy import prefix_routing_key

    def chat(system: str, user: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    system_a = "You are the billing assistant of ACME Corp. " * 7  # ~300 characters
    system_b = "You are a pirate who answers every question in rhymes. " * 6
    keys_a = {prefix_routing_key(None, None, chat(system_a, f"question {i}")) for i in range(5)}
    key_b = prefix_routing_key(None, None, chat(system_b, "question 0"))
    assert len(keys_a) == 1 and key_b.startswith("prefix:")
    key_a = keys_a.pop()
    assert key_a.startswith("prefix:") and key_a != key_b
    assert prefix_routing_key(None, None, chat("Be brief.", "x" * 1000)) == ""
    assert prefix_routing_key(None, None, [{"role": "user", "content": "y" * 600}]) != ""
    assert prefix_routing_key("short prompt", None, None) == ""
    assert prefix_routing_key(None, list(range(40)), None) == ""


# ---- placement (deployments/placement.py) and the home tiers ---------------------------------


def ref_rank_home(adapter, replicas, c, min_bound, home):
    """Brute force of the documented tiers with a home: ids per tier, in order."""
    n, total = len(replicas), sum(r.load for r in replicas)
    bound = max(1, min_bound, math.ceil(c * (total + 1) / n))
    by_id = {r.replica_id: r for r in replicas}
    under = [by_id[i] for i in ref_order(adapter, list(by_id)) if by_id[i].load + 1 <= bound]
    homes = [r for r in under if r.replica_id in home]
    if not homes:
        return None  # the plain rule applies
    tiers = [
        [r for r in homes if adapter in r.adapters_in_slots],
        [r for r in homes if adapter in r.adapters_in_cpu and adapter not in r.adapters_in_slots],
        [r for r in homes if adapter not in r.adapters_in_cpu],
    ]
    outside = [r for r in under if r.replica_id not in home]
    holder = [r for r in outside if adapter in r.adapters_in_slots][:1] or [
        r for r in outside if adapter in r.adapters_in_cpu
    ][:1]
    tiers.append(holder)
    tiers.append([r for r in outside if r not in holder][:1])
    return [sorted(r.replica_id for r in t) for t in tiers if t]


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=2, max_size=8),
    slot_mask=st.integers(0, 255),
    cpu_mask=st.integers(0, 255),
    home_mask=st.integers(1, 255),
    c=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    min_bound=st.sampled_from([1, 4]),
)
def test_rank_with_home_matches_reference(loads, slot_mask, cpu_mask, home_mask, c, min_bound):
    a = "hot"
    replicas = [
        view(
            f"r{i}",
            load,
            slots=[a] if slot_mask >> i & 1 else [],
            cpu=[a] if (cpu_mask | slot_mask) >> i & 1 else [],
        )
        for i, load in enumerate(loads)
    ]
    home = {f"r{i}" for i in range(len(loads)) if home_mask >> i & 1}
    tiers = rank_replicas(
        a, replicas, load_bound_c=c, min_load_bound=min_bound, rng=random.Random(0), home=home
    )
    flat = [r.replica_id for t in tiers for r in t]
    assert sorted(flat) == sorted(r.replica_id for r in replicas)
    expected = ref_rank_home(a, replicas, c, min_bound, home)
    if expected is None:  # no home under the bound: the plain rule, as without a home
        plain = rank_replicas(
            a, replicas, load_bound_c=c, min_load_bound=min_bound, rng=random.Random(0)
        )
        assert [[r.replica_id for r in t] for t in tiers] == [
            [r.replica_id for r in t] for t in plain
        ]
        return
    got = [sorted(r.replica_id for r in t) for t in tiers[: len(expected)]]
    assert got == expected
    rest = tiers[len(expected) :]
    assert len(rest) <= 1


def test_popularity_decays_by_half_each_half_life():
    from deployments.placement import AdapterPopularity

    pop = AdapterPopularity(half_life=4)
    for a in ("x", "x", "", "y"):  # the 4th record halves everything
        pop.record(a)
    assert pop.count("x") == 1.0 and pop.count("y") == 0.5 and pop.total == 2.0
    assert pop.shares() == {"x": 0.5, "y": 0.25}
    for a in ("x", "x", "x", "x"):
        pop.record(a)
    assert pop.count("x") == (1 + 4) / 2 and pop.count("y") == 0.25
    for _ in range(8):  # two more half-lives: 0.25 -> 0.125, then under 0.25 it is dropped
        pop.record("x")
    assert "y" not in pop.counts and pop.total == ((3 + 4) / 2 + 4) / 2


def test_replication_factor_by_hand():
    from deployments.placement import replication_factor

    assert replication_factor(0.16, 16, 1.25) == 4  # 0.16 x 16 x 1.25 = 3.2
    assert replication_factor(0.05, 16, 1.25) == 1  # exactly 1.0
    assert replication_factor(0.001, 16, 1.25) == 1
    assert replication_factor(0.9, 4, 2.0) == 4  # never more than the fleet


def test_placement_by_hand():
    """4 replicas x 4 slots, 1 reserved: 3 placed adapters per replica, 12 in all. 'a' (40%
    of traffic) gets ceil(0.4 x 4 x 1.25) = 2 replicas, the first two of its own order."""
    from deployments.placement import PlacementConfig, plan_placement

    ids = ["r0", "r1", "r2", "r3"]
    shares = {"a": 0.4, "b": 0.1, "c": 0.05, "d": 0.0001}
    plc = plan_placement(shares, ids, PlacementConfig(max_loras=4))
    assert plc["a"] == tuple(rendezvous_order("a", ids)[:2])
    assert len(plc["b"]) == 1 and len(plc["c"]) == 1
    assert "d" not in plc  # under min_share: the plain rule


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=60),
    n=st.integers(1, 12),
    max_loras=st.integers(1, 8),
)
def test_placement_respects_slots_order_and_popularity(weights, n, max_loras):
    from deployments.placement import PlacementConfig, plan_placement, replication_factor

    total = sum(weights) / 0.9  # 10% base
    shares = {f"ad-{i}": w / total for i, w in enumerate(weights)}
    ids = [f"r{i}" for i in range(n)]
    cfg = PlacementConfig(max_loras=max_loras)
    plc = plan_placement(shares, ids, cfg)
    per_replica = Counter(r for homes in plc.values() for r in homes)
    assert all(v <= cfg.placed_per_replica() for v in per_replica.values())
    for a, homes in plc.items():
        assert len(homes) == replication_factor(shares[a], n, cfg.headroom)
        order = rendezvous_order(a, ids)
        assert list(homes) == [r for r in order if r in homes]  # in the adapter's own order
    # placed adapters are the most popular ones (a prefix of the popularity order)
    ranked = sorted(shares, key=lambda a: (-shares[a], a))
    assert ranked[: len(plc)] == sorted(plc, key=lambda a: (-shares[a], a))
