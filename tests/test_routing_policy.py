"""rank_replicas / rendezvous_order against brute-force references and hashing properties."""

import math
import os
import random
import subprocess
import sys
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.routing_policy import (
    ReplicaView,
    load_bound,
    rank_replicas,
    rendezvous_order,
)
from tests.routing_refs import IDS, ref_bound, ref_order, view


def ref_rank(
    adapter: str, replicas: list[ReplicaView], c: float, min_bound: int, max_batch=None
) -> list[str]:
    """Brute force of the documented tiers: ids of tiers 0-2 (single replicas)."""
    bound = ref_bound(replicas, c, min_bound, max_batch)
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
    # a full batch is full whatever the mean, and wins over min_bound
    assert load_bound(159, 16, 1.25, min_bound=4, max_batch=8) == 8
    assert load_bound(3, 4, 1.25, min_bound=4, max_batch=2) == 2
    assert load_bound(0, 16, 1.25, max_batch=8) == 1


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    slot_mask=st.integers(0, 255),
    cpu_mask=st.integers(0, 255),
    key=st.sampled_from(["prefix:a", "prefix:b", "prefix:hot"]),
    c=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    min_bound=st.sampled_from([1, 2, 4]),
    max_batch=st.sampled_from([None, 1, 3, 6]),
)
def test_prefix_keys_walk_their_order(loads, slot_mask, cpu_mask, key, c, min_bound, max_batch):
    replicas = [
        view(
            f"r{i}",
            load,
            slots=[key] if slot_mask >> i & 1 else [],
            cpu=[key] if (cpu_mask | slot_mask) >> i & 1 else [],
        )
        for i, load in enumerate(loads)
    ]
    tiers = rank_replicas(
        key,
        replicas,
        load_bound_c=c,
        min_load_bound=min_bound,
        rng=random.Random(0),
        max_batch=max_batch,
    )
    flat = [r.replica_id for t in tiers for r in t]
    assert sorted(flat) == sorted(r.replica_id for r in replicas)  # each replica exactly once
    singles = ref_rank(key, replicas, c, min_bound, max_batch)
    if max_batch is None:
        assert singles, "with integer loads some replica is always under the bound"
    assert [t[0].replica_id for t in tiers[: len(singles)]] == singles
    assert all(len(t) == 1 for t in tiers[: len(singles)])
    rest = tiers[len(singles) :]
    assert len(rest) <= 1 and all(
        x.load <= y.load for t in rest for x, y in zip(t, t[1:], strict=False)
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
