"""Adapter-affinity ranking: pure Python, no Ray, shared by the Serve router and the simulator.

`rank_replicas` turns (adapter id, replica views) into ranked tiers, the shape Ray Serve's
`RequestRouter.choose_replicas` returns: Ray takes the first tier that has a replica with
room and, within a tier, the replica with the shortest queue.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_LOAD_BOUND_C = 1.5  # cluster/sim.py's default configuration: docs/routing.md
DEFAULT_MIN_LOAD_BOUND = 4  # requests a replica batches before it can count as "full"


@dataclass(frozen=True)
class ReplicaView:
    """What the ranking knows about one replica."""

    replica_id: str
    load: float  # ongoing requests at the replica (running + waiting), as Ray counts them
    adapters_in_slots: frozenset[str]
    adapters_in_cpu: frozenset[str]

    def holds(self, adapter_id: str) -> bool:
        return adapter_id in self.adapters_in_slots or adapter_id in self.adapters_in_cpu


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


def load_bound(total_load: float, num_replicas: int, c: float, min_bound: int = 1) -> int:
    """Per-replica capacity for the next request: max(min_bound, ceil(c * (total_load + 1) / n)).

    Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): with the
    incoming request counted, no replica may hold more than c times the mean. A replica is
    under the bound when `load + 1 <= load_bound(...)`. On an idle cluster the bound is 1,
    so every idle replica qualifies and the first choice in hash order wins.

    min_bound: a replica batches many requests at once (continuous batching), so at low load
    one or two requests do not make it "full"; spilling then would only cost adapter loads.
    Below min_bound requests a replica is always under the bound.
    """
    return max(1, min_bound, math.ceil(c * (total_load + 1) / num_replicas))


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


def rank_replicas(
    adapter_id: str,
    replicas: Sequence[ReplicaView],
    *,
    load_bound_c: float = DEFAULT_LOAD_BOUND_C,
    min_load_bound: int = DEFAULT_MIN_LOAD_BOUND,
    rng: random.Random,
    home: Sequence[str] | None = None,
) -> list[list[ReplicaView]]:
    """Rank `replicas` for a request for `adapter_id` ("" = base model).

    Base requests (adapter_id == ""):
      tier 0: two random replicas, least loaded first (power of two choices);
      tier 1: every other replica, least loaded first.

    Adapter requests: bound B = load_bound(total load, n, c, min_load_bound); a replica is
    under it if load + 1 <= B.

    Without `home` (the adapter is not placed, deployments/placement.py), walk the
    adapter's rendezvous order:
      tier 0: the first replica in that order that has the adapter in a GPU slot and is
              under the bound (no load at all);
      tier 1: the first replica in that order that has it in its CPU cache and is under
              the bound (a cheap CPU -> GPU load);
      tier 2: the first replica in that order that is under the bound (a load from disk
              if it is not there: where a cold adapter lands, on its first choice while
              that has room);
      tier 3: every other replica, least loaded first (all are over the bound, or the
              tiers above rejected the request because their queues are full).
    A hot adapter therefore spreads along its own order, one replica at a time, as its
    holders pass the bound; a cold one stays on its first choice.

    With `home` (the replicas the placement gave the adapter, in its rendezvous order):
      tier 0: the home replicas under the bound with the adapter in a slot (Ray takes the
              least loaded of them: the adapter's traffic is balanced over its holders);
      tier 1: the home replicas under the bound with it in the CPU cache;
      tier 2: the other home replicas under the bound (where it is loaded next);
      tier 3: the first replica in rendezvous order outside the home that is under the
              bound and holds the adapter (slot before CPU cache): a spill that costs no
              disk load, while there is one;
      tier 4: the first replica in rendezvous order under the bound (a spill that loads);
      tier 5: every other replica, least loaded first.

    Empty tiers are left out; no replica appears twice.
    """
    if not replicas:
        return []
    if not adapter_id:
        return power_of_two(replicas, rng)

    by_id = {r.replica_id: r for r in replicas}
    order = rendezvous_order(adapter_id, list(by_id))
    bound = load_bound(sum(r.load for r in replicas), len(replicas), load_bound_c, min_load_bound)
    tiers: list[list[ReplicaView]] = []
    picked: set[str] = set()

    def add(tier: list[ReplicaView]) -> None:
        tier = [r for r in tier if r.replica_id not in picked]
        if tier:
            tiers.append(tier)
            picked.update(r.replica_id for r in tier)

    under = [by_id[i] for i in order if by_id[i].load + 1 <= bound]
    home_ids = set(home or ())
    homes = [r for r in under if r.replica_id in home_ids]
    if homes:
        add([r for r in homes if adapter_id in r.adapters_in_slots])
        add([r for r in homes if adapter_id in r.adapters_in_cpu])
        add(homes)
        outside = [r for r in under if r.replica_id not in picked]
        holders = [r for r in outside if adapter_id in r.adapters_in_slots] or [
            r for r in outside if adapter_id in r.adapters_in_cpu
        ]
        add(holders[:1])
        add([r for r in outside if r.replica_id not in picked][:1])
    else:
        first_free = under[0] if under else None
        in_cpu = next((r for r in under if adapter_id in r.adapters_in_cpu), None)
        # the walk stops at the first slot holder: CPU holders past it do not count
        in_slots = next((r for r in under if adapter_id in r.adapters_in_slots), None)
        if in_slots is not None and in_cpu is not None:
            if under.index(in_cpu) > under.index(in_slots):
                in_cpu = None
        for r in (in_slots, in_cpu, first_free):
            if r is not None:
                add([r])
    add(sorted((r for r in replicas if r.replica_id not in picked), key=lambda r: r.load))
    return tiers


# ---- base requests that share a prompt prefix -----------------------------------------------

PREFIX_KEY_CHARS = 512  # of the prompt text: a system prompt of ~128 tokens and more
MIN_PREFIX_CHARS = 256  # shorter prompts have too little to reuse: power of two as before
PREFIX_KEY_TOKENS = 128  # the same for a prompt given as token ids


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
        return "prefix:ids:" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    else:
        text = prompt or ""
    if len(text) < MIN_PREFIX_CHARS:
        return ""
    digest = hashlib.blake2b(text[:PREFIX_KEY_CHARS].encode(), digest_size=8).hexdigest()
    return f"prefix:{digest}"
