"""Adapter-affinity ranking: pure Python, no Ray, shared by the Serve router and the simulator.

`rank_replicas` turns (adapter id, replica views) into ranked tiers, the shape Ray Serve's
`RequestRouter.choose_replicas` returns: Ray takes the first tier that has a replica with
room and, within a tier, the replica with the shortest queue.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_LOAD_BOUND_C = 1.25  # one set for the whole sweep: docs/routing.md
DEFAULT_MIN_LOAD_BOUND = 4  # requests a replica batches before it can count as "full"
DEFAULT_COUNT_SLACK = 0.05  # new_home: a replica may hold this share more than the fewest
# rank_replicas' `in_tail`: an adapter outside the TAIL_SLOTS x n x max_loras most requested
TAIL_SLOTS = 1

InTail = Callable[[str], bool]  # adapter -> outside the tail_rank most requested


def tail_rank(num_replicas: int, max_loras: int) -> int:
    """How many of the most requested adapters are not "tail" (rank_replicas' `in_tail`): as
    many as the fleet has slots. Only they can all sit in a slot at once; a request for any
    other needs a slot load wherever it goes, and a slot holding one of them is worth
    keeping (sweep, docs/routing.md: 1x met 42 of 50 runs, 2x 37, 0.75x and 1.5x fewer)."""
    return TAIL_SLOTS * num_replicas * max_loras


@dataclass(frozen=True)
class ReplicaView:
    """What the ranking knows about one replica."""

    replica_id: str
    load: float  # ongoing requests at the replica (running + waiting), as Ray counts them
    adapters_in_slots: frozenset[str]
    adapters_in_cpu: frozenset[str]
    # what a router sent it lately that it has not reported yet: being read (RecentRoutes)
    adapters_reading: frozenset[str] = frozenset()
    # adapters of the requests this router has in flight there (InFlight): each holds a slot
    # or waits for one
    adapters_running: frozenset[str] = frozenset()
    # a read of an adapter it lacks is a fetch from the fleet's shared tier (a copy), not a
    # cold read (its routing_stats "reads_shared")
    reads_shared: bool = False

    def count(self) -> int:
        return len(self.adapters_in_cpu | self.adapters_reading)

    def holds(self, adapter_id: str) -> bool:
        return adapter_id in self.adapters_in_slots or adapter_id in self.adapters_in_cpu

    def in_cpu(self, adapter_id: str) -> bool:
        """In its CPU cache, or on the way there."""
        return adapter_id in self.adapters_in_cpu or adapter_id in self.adapters_reading

    def slots_kept(self, adapter_id: str, in_tail: InTail | None = None) -> int:
        """Slots a load of `adapter_id` here may not take: those of the other adapters with
        requests in flight, and (`in_tail` given) those holding a popular adapter (not in
        the tail), which the load would evict for one that needs a load anywhere."""
        kept = set(self.adapters_running)
        if in_tail is not None:
            kept.update(a for a in self.adapters_in_slots if not in_tail(a))
        kept.discard(adapter_id)
        return len(kept)

    def slots_taken(self, adapter_id: str, max_loras: int, in_tail: InTail | None = None) -> bool:
        """Every slot is kept (`slots_kept`): a request for `adapter_id` would wait there
        until one of them finishes, or evict a popular adapter its next requests need."""
        if adapter_id in self.adapters_running:
            return False  # it holds a slot there already
        return self.slots_kept(adapter_id, in_tail) >= max_loras


def _weight(adapter_id: str, replica_id: str) -> int:
    # blake2b, not hash(): the order must agree across processes (PYTHONHASHSEED differs).
    key = f"{adapter_id}\x00{replica_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


@lru_cache(maxsize=65536)
def _rendezvous_order(adapter_id: str, replica_ids: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(replica_ids, key=lambda r: (-_weight(adapter_id, r), r)))


def rendezvous_order(adapter_id: str, replica_ids: Sequence[str]) -> list[str]:
    """Highest-random-weight order of `replica_ids` for `adapter_id`.

    Stable across processes and restarts; removing a replica only removes it from the
    order (every other pair keeps its relative position), adding one inserts it.
    """
    return list(_rendezvous_order(adapter_id, tuple(sorted(replica_ids))))


def load_bound(
    total_load: float,
    num_replicas: int,
    c: float,
    min_bound: int = 1,
    max_batch: int | None = None,
) -> int:
    """Per-replica capacity for the next request: max(min_bound, ceil(c * (total_load + 1) / n)),
    at most max_batch.

    Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): with the
    incoming request counted, no replica may hold more than c times the mean. A replica is
    under the bound when `load + 1 <= load_bound(...)`. On an idle cluster the bound is 1,
    so every idle replica qualifies and the first choice in hash order wins.

    min_bound: a replica batches many requests at once (continuous batching), so at low load
    one or two requests do not make it "full"; spilling then would only cost adapter loads.
    Below min_bound requests a replica is always under the bound.

    max_batch: the most requests a replica runs at once (its engine's max_num_seqs). A replica
    with that many is full whatever the mean: a request sent there waits for a batch row while
    a holder with a free row would start it now. Without the cap, a burst raises the mean and
    so the bound past a batch, and a hot adapter's requests queue on its busiest holder (the
    sweep's point 6 seed 1: p99 TTFT 0.90x the peer's, 0.75x with the cap). It wins over
    min_bound.
    """
    bound = max(1, min_bound, math.ceil(c * (total_load + 1) / num_replicas))
    return bound if max_batch is None else max(1, min(bound, max_batch))


def power_of_two(replicas: Sequence[ReplicaView], rng: random.Random) -> list[list[ReplicaView]]:
    """Tier 0: two random replicas, least loaded first. Tier 1: the rest, by load."""
    n = len(replicas)
    if n <= 2:
        order = list(replicas)
        rng.shuffle(order)  # equal loads must not always favour the same replica
        return [sorted(order, key=lambda r: r.load)]
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    pair = sorted((replicas[i], replicas[j]), key=lambda r: r.load)
    rest = sorted((r for k, r in enumerate(replicas) if k not in (i, j)), key=lambda r: r.load)
    return [pair, rest] if rest else [pair]


def holders(views: Sequence[ReplicaView]) -> dict[str, list[str]]:
    """adapter -> the replicas holding it (slot or CPU cache): what placement keeps."""
    out: dict[str, list[str]] = {}
    for v in views:
        for adapter in v.adapters_in_slots | v.adapters_in_cpu | v.adapters_reading:
            out.setdefault(adapter, []).append(v.replica_id)
    return out


def new_home(candidates: Sequence[ReplicaView], count_slack: float) -> ReplicaView | None:
    """Where an adapter no replica holds goes: among `candidates` (in the adapter's rendezvous
    order), those holding at most `count_slack` more adapters than the fewest, and of those
    the least loaded (the first in rendezvous order among equals).

    Ray's rule for a model id nobody reports is two random replicas among those with the
    fewest ids: it keeps the *number* of adapters per replica even, so the fleet's CPU caches
    hold the catalog once over. The slack lets the load choose among nearly-even replicas,
    which evens the traffic too (the first requests of a trace are mostly for the popular
    adapters)."""
    if not candidates:
        return None
    fewest = min(r.count() for r in candidates)
    most = fewest + math.floor(count_slack * fewest)
    even = [r for r in candidates if r.count() <= most]
    return min(even, key=lambda r: r.load)  # min keeps the first of equals


def rank_replicas(
    adapter_id: str,
    replicas: Sequence[ReplicaView],
    *,
    load_bound_c: float = DEFAULT_LOAD_BOUND_C,
    min_load_bound: int = DEFAULT_MIN_LOAD_BOUND,
    count_slack: float = DEFAULT_COUNT_SLACK,
    rng: random.Random,
    home: Sequence[str] | None = None,
    max_batch: int | None = None,
    max_loras: int | None = None,
    in_tail: InTail | None = None,
    idle_first: bool = True,
) -> list[list[ReplicaView]]:
    """Rank `replicas` for a request for `adapter_id` ("" = base model).

    Base requests (adapter_id == ""):
      tier 0: two random replicas, least loaded first (power of two choices);
      tier 1: every other replica, least loaded first.

    Adapter requests: bound B = load_bound(total load, n, c, min_load_bound, max_batch); a
    replica is under it if load + 1 <= B (max_batch: the replicas' engine max_num_seqs, or
    None). A *holder* has the adapter in a slot or in its CPU cache.
    An adapter stays on its holders: moving it costs a cold read there and the eviction of
    someone else's adapter, so only Ray's queue cap (max_ongoing_requests, applied by Ray
    to every tier) or the placement moves it on. One exception, before tier 0 in both
    cases below: where every holder under the bound with it in a slot runs a request, the
    idle ones with it in the CPU cache (`_idle_first`): a slot load there, not a read,
    rather than a prefill in the step of a running request (on the real app, 19 MB
    adapters, affinity's slowest requests had arrived with 0.8-1.2 requests running on
    their replica against the peer's 0.3-0.7; docs/benchmarks.md). At the sweep's loads
    no replica is idle and it never applies. `idle_first=False` leaves it out.

    Without `home` (the adapter is not hot enough to be placed, deployments/placement.py):
      tier 0: holders under the bound with it in a slot (Ray takes the least loaded);
      tier 1: holders under the bound with it in the CPU cache, or reading it (sent it
              lately, not reported yet: ReplicaView.adapters_reading);
      tier 2: every holder, least loaded first (over the bound, it stays);
      tier 3: if it has no holder, or every holder's queue is full: `new_home` among the
              replicas under the bound;
      tier 4: every other replica, least loaded first.
    A *tail* adapter (`in_tail(adapter_id)`: outside the `tail_rank` most requested; needs
    `max_loras`) needs a slot load on any replica, so it does not go to a holder whose slots
    are all kept (`ReplicaView.slots_taken`): by other adapters with requests in flight
    (this router's `InFlight`), where it would wait for one of them to finish, or by popular
    adapters (not `in_tail`), one of which its load would evict for the next request to
    load again. Tiers 0, 1 and 3 leave such replicas out, and when it has holders, after
    tier 1 come the holders with a slot free, then the replica under the bound with the
    fewest kept slots (the least loaded of those) among those whose read of it is a fetch
    from the shared tier (`ReplicaView.reads_shared`), or among all of them when every holder
    under the bound runs max_loras other adapters (it would wait there). A popular adapter
    waits on its holder instead: its next requests find it in the slot there.

    With `home` (a hot adapter's k replicas, holders first, deployments/placement.py):
      tier 0: homes under the bound with it in a slot (least loaded: its traffic is
              balanced over them);
      tier 1: homes under the bound with it in the CPU cache or reading it;
      tier 2: the first home (in the placement's order) under the bound that neither holds
              nor reads it: the adapter grows onto one more of its k homes only when every home
              holding it is over the bound;
      tier 3: the homes holding it, least loaded first; then the other homes;
      tier 4: every other replica, least loaded first.

    Keys "prefix:..." (base requests of one tenant, `prefix_routing_key`) need no slot:
    they walk their rendezvous order (`rank_by_hash`) and spill as their holder fills.

    Empty tiers are left out; no replica appears twice.
    """
    if not replicas:
        return []
    if not adapter_id:
        return power_of_two(replicas, rng)
    if is_prefix_key(adapter_id):
        return rank_by_hash(adapter_id, replicas, load_bound_c, min_load_bound, max_batch)

    ranked, bound = _ordered(adapter_id, replicas, load_bound_c, min_load_bound, max_batch)
    tiers = _Tiers()
    under = [r for r in ranked if r.load + 1 <= bound]
    by_load = sorted(ranked, key=lambda r: r.load)  # stable: rendezvous order among equals
    if home:
        home_ids = set(home)
        under_ids = {r.replica_id for r in under}
        by_id = {r.replica_id: r for r in ranked}
        homes = [by_id[h] for h in home if h in under_ids]  # in the placement's order
        in_slot = [r for r in homes if adapter_id in r.adapters_in_slots]
        if idle_first:
            tiers.add(_idle_first(adapter_id, homes, in_slot))
        tiers.add(in_slot)
        tiers.add([r for r in homes if r.in_cpu(adapter_id)])
        tiers.add([r for r in homes if not r.holds(adapter_id) and not r.in_cpu(adapter_id)][:1])
        tiers.add([r for r in by_load if r.replica_id in home_ids and r.holds(adapter_id)])
        tiers.add([r for r in by_load if r.replica_id in home_ids])
    else:
        tail = in_tail if max_loras is not None and in_tail and in_tail(adapter_id) else None

        def kept(r: ReplicaView) -> bool:
            return tail is not None and r.slots_taken(adapter_id, max_loras, tail)

        free = [r for r in under if not kept(r)]
        in_slot = [r for r in free if adapter_id in r.adapters_in_slots]
        if idle_first:
            tiers.add(_idle_first(adapter_id, free, in_slot))
        tiers.add(in_slot)
        tiers.add([r for r in free if r.in_cpu(adapter_id)])
        holding = [r for r in ranked if r.holds(adapter_id) or r.in_cpu(adapter_id)]
        if tail and free and holding:
            # a tail adapter needs a slot load wherever it goes: rather than wait on a
            # holder whose slots are all kept, it goes where the most slots are free: to a
            # replica that would read it from disk only if it would wait at every holder
            tiers.add([r for r in by_load if r.holds(adapter_id) and not kept(r)])
            waits = all(
                r.slots_taken(adapter_id, max_loras) for r in holding if r.load + 1 <= bound
            )
            to = [r for r in free if waits or r.reads_shared]
            if to:
                tiers.add([min(to, key=lambda r: (r.slots_kept(adapter_id, tail), r.load))])
        tiers.add([r for r in by_load if r.holds(adapter_id)])
        first = new_home([r for r in free if r.replica_id not in tiers.picked], count_slack)
        tiers.add([first] if first is not None else [])
    tiers.add(by_load)
    return tiers.tiers


def rank_by_hash(
    key: str,
    replicas: Sequence[ReplicaView],
    load_bound_c: float,
    min_load_bound: int,
    max_batch: int | None = None,
) -> list[list[ReplicaView]]:
    """Walk `key`'s rendezvous order: tier 0 the first holder under the bound with it in a
    slot, tier 1 the first with it in the CPU cache (before any slot holder past it), tier 2
    the first replica under the bound; then every other replica by load. A key with more
    requests than its holder takes spreads along its own order, one replica at a time."""
    ranked, bound = _ordered(key, replicas, load_bound_c, min_load_bound, max_batch)
    under = [r for r in ranked if r.load + 1 <= bound]
    in_slots = next((r for r in under if key in r.adapters_in_slots), None)
    in_cpu = next((r for r in under if key in r.adapters_in_cpu), None)
    if in_slots is not None and in_cpu is not None and under.index(in_cpu) > under.index(in_slots):
        in_cpu = None  # the walk stops at the first slot holder
    tiers = _Tiers()
    for r in (in_slots, in_cpu, under[0] if under else None):
        tiers.add([r] if r is not None else [])
    tiers.add(sorted(ranked, key=lambda r: r.load))
    return tiers.tiers


def _ordered(
    key: str, replicas: Sequence[ReplicaView], c: float, min_bound: int, max_batch: int | None
) -> tuple[list[ReplicaView], int]:
    """(replicas in `key`'s rendezvous order, the load bound)."""
    by_id = {r.replica_id: r for r in replicas}
    ranked = [by_id[i] for i in rendezvous_order(key, list(by_id))]
    total = sum(r.load for r in replicas)
    return ranked, load_bound(total, len(replicas), c, min_bound, max_batch)


def _idle_first(
    adapter_id: str, cands: list[ReplicaView], in_slot: list[ReplicaView]
) -> list[ReplicaView]:
    """The tier before `in_slot` (those of `cands` with the adapter in a slot): where each of
    them runs a request, the idle ones of `cands` holding it in the CPU cache (a slot load
    there rather than a step shared with a running request); else none."""
    if in_slot and min(r.load for r in in_slot) >= 1:
        return [r for r in cands if r.load == 0 and adapter_id in r.adapters_in_cpu]
    return []


class _Tiers:
    """Ranked tiers under construction: empty tiers dropped, no replica twice."""

    def __init__(self) -> None:
        self.tiers: list[list[ReplicaView]] = []
        self.picked: set[str] = set()

    def add(self, tier: list[ReplicaView]) -> None:
        tier = [r for r in tier if r.replica_id not in self.picked]
        if tier:
            self.tiers.append(tier)
            self.picked.update(r.replica_id for r in tier)


# ---- base requests that share a prompt prefix -----------------------------------------------

PREFIX_KEY_CHARS = 512  # of the prompt text: a system prompt of ~128 tokens and more
MIN_PREFIX_CHARS = 256  # shorter prompts have too little to reuse: power of two as before
PREFIX_KEY_TOKENS = 128  # the same for a prompt given as token ids
PREFIX_KEY_MARK = "prefix:"  # how every prefix key begins


def is_prefix_key(key: str) -> bool:
    """A base request's prefix key (`prefix_routing_key`)."""
    return key.startswith(PREFIX_KEY_MARK)


def is_adapter_key(key: str) -> bool:
    """A routing key naming an adapter (its requests take a slot), not "" (a base request with
    no key) nor a base request's prefix key (`prefix_routing_key`)."""
    return bool(key) and not is_prefix_key(key)


def prefix_routing_key(
    prompt: str | None, prompt_token_ids: list[int] | None, messages: list[dict] | None
) -> str:
    """The routing key of a base-model request: "prefix:<hash of its first 512 characters>",
    or "" when the prompt is short (for chat messages, the messages before the last). Requests of one tenant (same system prompt) share it, so
    `rank_replicas(key, ...)` sends them to the same replica within the load bound, where the
    engine's prefix cache holds their KV. Adapter requests need no such key: an adapter's
    requests already share a replica, and the engine never reuses KV across adapters.
    """
    if messages:
        # the conversation before its last turn (system prompt, history): what a tenant's
        # requests share; a short chat would otherwise be keyed on its own user turn
        shared = messages[:-1] if len(messages) > 1 else messages
        text = "".join(f"{m.get('role', '')}\x1f{m.get('content', '')}\x1e" for m in shared)
    elif prompt_token_ids:
        if len(prompt_token_ids) < MIN_PREFIX_CHARS // 4:
            return ""
        text = ",".join(map(str, prompt_token_ids[:PREFIX_KEY_TOKENS]))
        return f"{PREFIX_KEY_MARK}ids:" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    else:
        text = prompt or ""
    if len(text) < MIN_PREFIX_CHARS:
        return ""
    digest = hashlib.blake2b(text[:PREFIX_KEY_CHARS].encode(), digest_size=8).hexdigest()
    return f"{PREFIX_KEY_MARK}{digest}"
