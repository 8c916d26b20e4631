"""rank_replicas for adapters against a brute-force reference of its documented tiers: holders,
the load bound, hot adapters' homes, the tail rule, idle CPU holders."""

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.routing_policy import ReplicaView, rank_replicas
from tests.routing_refs import IDS, ref_bound, ref_order, view


def ref_rank_adapter(
    adapter, replicas, c, min_bound, slack, home, max_batch=None, max_loras=None, in_tail=None
):
    """Brute force of the documented adapter tiers, as sets of ids (None: empty tier)."""
    bound = ref_bound(replicas, c, min_bound, max_batch)
    order = {rid: i for i, rid in enumerate(ref_order(adapter, [r.replica_id for r in replicas]))}
    under = [r for r in replicas if r.load + 1 <= bound]
    slot = {r.replica_id for r in replicas if adapter in r.adapters_in_slots}
    cpu = {r.replica_id for r in replicas if adapter in r.adapters_in_cpu}
    holds = slot | cpu
    under_ids = {r.replica_id for r in under}
    load = {r.replica_id: r.load for r in replicas}

    def idle_first(cands: set) -> set:
        """every slot holder among cands runs a request: the idle CPU holders among them"""
        if cands & slot and min(load[i] for i in cands & slot) >= 1:
            return {i for i in cands & cpu if load[i] == 0}
        return set()

    if home:
        growth = [h for h in home if h in under_ids and h not in holds][:1]
        tiers = [
            idle_first(under_ids & set(home)),
            under_ids & set(home) & slot,
            under_ids & set(home) & cpu,
            set(growth),
            set(home) & holds,
            set(home),
        ]
    else:
        # a tail adapter skips replicas whose slots are all kept: by other adapters in
        # flight there, or by popular adapters (not in the tail) in a slot
        tail = in_tail is not None and max_loras is not None and in_tail(adapter)

        def kept(r):
            popular = {x for x in r.adapters_in_slots if not in_tail(x)}
            return len((set(r.adapters_running) | popular) - {adapter})

        taken = set()
        if tail:
            taken = {
                r.replica_id
                for r in replicas
                if adapter not in r.adapters_running and kept(r) >= max_loras
            }
        free = [r for r in under if r.replica_id not in taken]
        free_ids = {r.replica_id for r in free}
        tiers = [idle_first(free_ids), free_ids & slot, free_ids & cpu]
        if tail and free and holds:
            # a replica that would read it from disk only if every holder's slots run others
            busy = {
                r.replica_id
                for r in replicas
                if adapter not in r.adapters_running and len(r.adapters_running) >= max_loras
            }
            waits = not (under_ids & holds) - busy
            to = [r for r in free if waits or r.reads_shared]
            tiers.append(holds - taken)
            if to:
                tiers.append(
                    {min(to, key=lambda r: (kept(r), r.load, order[r.replica_id])).replica_id}
                )
        tiers.append(holds)
        seen = set().union(*tiers)
        cands = [r for r in free if r.replica_id not in seen]
        new = set()
        if cands:
            fewest = min(len(r.adapters_in_cpu) for r in cands)
            even = [r for r in cands if len(r.adapters_in_cpu) <= fewest + int(slack * fewest)]
            # least loaded, then first in rendezvous order
            new = {min(even, key=lambda r: (r.load, order[r.replica_id])).replica_id}
        tiers.append(new)
    out, seen = [], set()
    for t in tiers:
        t = t - seen
        if t:
            out.append(t)
            seen |= t
    rest = {r.replica_id for r in replicas} - seen
    return out + ([rest] if rest else [])


@settings(max_examples=400, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    slot_mask=st.integers(0, 255),
    cpu_mask=st.integers(0, 255),
    home_mask=st.integers(0, 255),
    others=st.lists(st.integers(0, 12), min_size=8, max_size=8),
    c=st.sampled_from([1.0, 1.25, 2.0]),
    min_bound=st.sampled_from([1, 4]),
    slack=st.sampled_from([0.0, 0.05, 0.5]),
    max_batch=st.sampled_from([None, 2, 6]),
)
def test_rank_adapter_matches_reference(
    loads, slot_mask, cpu_mask, home_mask, others, c, min_bound, slack, max_batch
):
    a = "ad"
    replicas = [
        view(
            f"r{i}",
            load,
            slots=[a] if slot_mask >> i & 1 else [],
            cpu=([a] if (cpu_mask | slot_mask) >> i & 1 else [])
            + [f"other-{j}" for j in range(others[i])],
        )
        for i, load in enumerate(loads)
    ]
    home = [f"r{i}" for i in range(len(loads)) if home_mask >> i & 1] or None
    tiers = rank_replicas(
        a,
        replicas,
        load_bound_c=c,
        min_load_bound=min_bound,
        count_slack=slack,
        rng=random.Random(0),
        home=home,
        max_batch=max_batch,
    )
    expected = ref_rank_adapter(a, replicas, c, min_bound, slack, home, max_batch)
    assert [{r.replica_id for r in t} for t in tiers] == expected
    for t in tiers:  # within a tier Ray takes the least loaded: any order is fine
        assert len({r.replica_id for r in t}) == len(t)


@settings(max_examples=400, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    slot_mask=st.integers(0, 255),
    cpu_mask=st.integers(0, 255),
    running=st.lists(st.integers(0, 4), min_size=8, max_size=8),
    in_slots=st.lists(st.integers(0, 4), min_size=8, max_size=8),
    self_running=st.integers(0, 255),
    shared_mask=st.integers(0, 255),
    others=st.lists(st.integers(0, 12), min_size=8, max_size=8),
    c=st.sampled_from([1.0, 1.25, 2.0]),
    min_bound=st.sampled_from([1, 4]),
    max_loras=st.sampled_from([1, 2, 3]),
    tail=st.sampled_from([None, False, True]),
)
def test_rank_tail_adapter_matches_reference(
    loads,
    slot_mask,
    cpu_mask,
    running,
    in_slots,
    self_running,
    shared_mask,
    others,
    c,
    min_bound,
    max_loras,
    tail,
):
    # "other-j": running on replica i for j < running[i], in its slots for j < in_slots[i]
    # (running ones too); the even-numbered are popular, the odd ones in the tail
    a = "ad"
    replicas = [
        ReplicaView(
            f"r{i}",
            load,
            frozenset([a] if slot_mask >> i & 1 else [])
            | {f"other-{j}" for j in range(max(running[i], in_slots[i]))},
            frozenset([a] if (cpu_mask | slot_mask) >> i & 1 else [])
            | {f"other-{j}" for j in range(others[i])},
            adapters_running=frozenset(
                [f"other-{j}" for j in range(running[i])] + ([a] if self_running >> i & 1 else [])
            ),
            reads_shared=bool(shared_mask >> i & 1),
        )
        for i, load in enumerate(loads)
    ]

    def in_tail(x: str) -> bool:
        return bool(tail) if x == a else int(x.split("-")[1]) % 2 == 1

    fn = None if tail is None else in_tail
    tiers = rank_replicas(
        a,
        replicas,
        load_bound_c=c,
        min_load_bound=min_bound,
        rng=random.Random(0),
        max_loras=max_loras,
        in_tail=fn,
    )
    expected = ref_rank_adapter(a, replicas, c, min_bound, 0.05, None, None, max_loras, fn)
    assert [{r.replica_id for r in t} for t in tiers] == expected


def test_a_tail_adapter_goes_where_slots_are_free_not_to_a_holder_whose_slots_are_kept():
    # r0 holds "t" in its CPU cache, but 2 other adapters it sent there take both slots:
    # "t" would wait there; r2 runs one adapter (a free slot), r1 two of its own.
    reps = [
        ReplicaView(
            "r0",
            3,
            frozenset({"x", "y"}),
            frozenset({"t", "x", "y"}),
            adapters_running=frozenset({"x", "y"}),
        ),
        ReplicaView(
            "r1",
            2,
            frozenset({"u", "v"}),
            frozenset({"u", "v"}),
            adapters_running=frozenset({"u", "v"}),
        ),
        ReplicaView("r2", 2, frozenset({"w"}), frozenset({"w"}), adapters_running=frozenset({"w"})),
        ReplicaView(
            "r3",
            1,
            frozenset({"p", "q"}),
            frozenset({"p", "q"}),
            adapters_running=frozenset({"p", "q"}),
        ),
    ]
    kw = {"rng": random.Random(0), "max_loras": 2}

    def in_tail(adapter: str) -> bool:
        return adapter in {"t", "z"}  # the rest are popular

    assert rank_replicas("t", reps, in_tail=in_tail, **kw)[0] == [reps[2]]
    # not tail (a popular adapter waits for its holder: reloading it elsewhere costs more)
    assert rank_replicas("t", reps, in_tail=lambda _: False, **kw)[0] == [reps[0]]
    # the holder with its second slot idle, holding the tail adapter "z", keeps it
    free = [
        replace(
            reps[0], adapters_running=frozenset({"x"}), adapters_in_slots=frozenset({"x", "z"})
        ),
        *reps[1:],
    ]
    assert rank_replicas("t", free, in_tail=in_tail, **kw)[0] == [free[0]]
    # ... but not when the idle slot holds a popular adapter (the load would evict it): then
    # it goes where a slot is free if a read there is a fetch from the shared tier, not a
    # cold read (above, where it would wait at its holder, it went there either way)
    popular = [replace(reps[0], adapters_running=frozenset({"x"})), *reps[1:]]
    assert rank_replicas("t", popular, in_tail=in_tail, **kw)[0] == [popular[0]]
    shared = [replace(r, reads_shared=True) for r in popular]
    assert rank_replicas("t", shared, in_tail=in_tail, **kw)[0] == [shared[2]]


def test_an_adapter_stays_on_its_holder_and_new_ones_even_the_counts():
    # A holder over the bound keeps its adapter (Ray's queue cap is the only spill).
    reps = [view("r0", 12, cpu=["a"]), *(view(i, 0) for i in IDS[1:])]
    assert rank_replicas("a", reps, rng=random.Random(0))[0][0].replica_id == "r0"
    # 24 new adapters, nothing completes: each goes where the fewest adapters are, so the
    # replicas end with 3 each (Ray's fewest-ids rule keeps the same counts).
    held: dict[str, list[str]] = {i: [] for i in IDS}
    for k in range(24):
        reps = [view(i, len(held[i]), cpu=held[i]) for i in IDS]
        pick = rank_replicas(f"new-{k}", reps, count_slack=0, rng=random.Random(0))[0][0]
        held[pick.replica_id].append(f"new-{k}")
    assert sorted(len(v) for v in held.values()) == [3] * 8


def test_an_adapter_being_read_counts_under_the_bound_only():
    """An adapter a router sent a replica lately, not reported yet (ReplicaView.
    adapters_reading), keeps the next request there while the replica is under the bound
    (one disk read, not two); over it, the adapter is not yet held there and the request
    goes to a new home. It counts towards the replica's adapters either way."""
    reading = ReplicaView("r0", 0, frozenset(), frozenset(), frozenset({"a"}))
    others = [view(i, 0) for i in IDS[1:]]
    assert rank_replicas("a", [reading, *others], rng=random.Random(0))[0][0].replica_id == "r0"
    busy = ReplicaView("r0", 12, frozenset(), frozenset(), frozenset({"a"}))
    tiers = rank_replicas("a", [busy, *others], rng=random.Random(0))
    assert tiers[0][0].replica_id != "r0" and busy.count() == 1
    # placed: the home reading it comes first, then one more home
    tiers = rank_replicas("a", [reading, *others], rng=random.Random(0), home=["r2", "r0", "r1"])
    assert [[r.replica_id for r in t] for t in tiers[:3]] == [["r0"], ["r2"], ["r1"]]


def test_a_hot_adapter_grows_onto_its_homes_one_at_a_time():
    home = ["r3", "r5", "r1"]
    loads = dict.fromkeys(IDS, 4)
    resident: dict[str, set[str]] = {i: set() for i in IDS}
    used: list[str] = []
    for _ in range(60):  # nothing completes: "hot" takes all the new load
        reps = [view(i, loads[i], slots=resident[i], cpu=resident[i]) for i in IDS]
        pick = rank_replicas("hot", reps, rng=random.Random(0), home=home)[0][0].replica_id
        loads[pick] += 1
        resident[pick].add("hot")
        if pick not in used:
            used.append(pick)
    assert used == home  # in the home's order, and never off it while a home has room


def test_an_idle_cpu_holder_comes_before_a_busy_slot_holder():
    """Every slot holder of "a" runs a request: the idle replica with "a" in its CPU cache is
    first (a slot load there rather than a prefill in a running step); a busy CPU holder, or
    a slot holder that is idle itself, changes nothing."""
    kw = {"load_bound_c": 1.25, "min_load_bound": 4, "count_slack": 0.05, "rng": random.Random(0)}
    busy_slot, idle_cpu = view("r0", 1, slots=["a"], cpu=["a"]), view("r1", 0, cpu=["a"])
    idle_other = view("r2", 0, cpu=["b"])
    tiers = rank_replicas("a", [busy_slot, idle_cpu, idle_other], **kw)
    assert tiers[:2] == [[idle_cpu], [busy_slot]]
    busy_cpu = view("r1", 1, cpu=["a"])
    assert rank_replicas("a", [busy_slot, busy_cpu, idle_other], **kw)[0] == [busy_slot]
    idle_slot = view("r3", 0, slots=["a"], cpu=["a"])
    first = rank_replicas("a", [busy_slot, idle_cpu, idle_slot], **kw)[0]
    assert {r.replica_id for r in first} == {"r0", "r3"}
    # a hot adapter's homes: the same among them
    tiers = rank_replicas("a", [busy_slot, idle_cpu, idle_other], home=["r0", "r1"], **kw)
    assert tiers[:2] == [[idle_cpu], [busy_slot]]
    # idle_first=False (the benchmark's affinity_no_idle arm): the busy slot holder first
    for home in (None, ["r0", "r1"]):
        tiers = rank_replicas(
            "a", [busy_slot, idle_cpu, idle_other], home=home, idle_first=False, **kw
        )
        assert tiers[:2] == [[busy_slot], [idle_cpu]]
