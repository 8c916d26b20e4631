"""What the routing-policy tests share: replica views and the brute-force hash order and load
bound that deployments/routing_policy.py is checked against."""

import hashlib
import math

from deployments.routing_policy import ReplicaView

IDS = [f"r{i}" for i in range(8)]


def view(rid: str, load: float = 0, slots=(), cpu=()) -> ReplicaView:
    return ReplicaView(rid, load, frozenset(slots), frozenset(cpu))


def ref_order(adapter: str, ids: list[str]) -> list[str]:
    """Brute force: score every pair with blake2b, highest first."""

    def score(rid: str) -> int:
        d = hashlib.blake2b(f"{adapter}\x00{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "big")

    return sorted(ids, key=lambda r: (-score(r), r))


def ref_bound(replicas: list[ReplicaView], c: float, min_bound: int, max_batch=None) -> int:
    n, total = len(replicas), sum(r.load for r in replicas)
    bound = max(1, min_bound, math.ceil(c * (total + 1) / n))
    return bound if max_batch is None else max(1, min(bound, max_batch))
