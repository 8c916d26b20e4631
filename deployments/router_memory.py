"""What a router remembers of its own sends, beside what the replicas report: the adapters it
sent lately that a replica has not reported yet (`RecentRoutes`: being read there), and the
adapters of its requests that have not finished (`InFlight`: each holds a slot or waits for
one). Both turn into `ReplicaView` fields for `routing_policy.rank_replicas`; the Serve router
(deployments/router.py) and the simulator (cluster/sim_router.py) keep one of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from deployments.routing_policy import ReplicaView, is_adapter_key


class RecentRoutes:
    """The adapters this router sent to each replica in the last `grace_s` seconds and the
    replica has not reported: `ReplicaView.adapters_reading` (a replica reads an adapter as
    soon as its request arrives). Residency reaches routers late (Ray's multiplexed ids: a
    push every 0.1 s and a controller loop; routing stats: every period), so without this the
    new adapters of one instant all see the same "fewest" replica (`new_home`), and a second
    request for a new adapter, sent before the first one's replica reported it, is placed
    afresh and read from disk a second time elsewhere. Base requests ("") are not counted."""

    def __init__(self, grace_s: float = 2.0) -> None:
        self.grace_s = grace_s
        self.sent: dict[str, dict[str, float]] = {}  # replica -> adapter -> last sent at

    def record(self, replica_id: str, adapter_id: str, now: float) -> None:
        if adapter_id:
            self.sent.setdefault(replica_id, {})[adapter_id] = now

    def apply(self, views: Sequence[ReplicaView], now: float) -> list[ReplicaView]:
        out = []
        for v in views:
            recent = self.sent.get(v.replica_id)
            if recent:
                for a in [a for a, t in recent.items() if now - t > self.grace_s]:
                    del recent[a]
            reading = recent.keys() - v.adapters_in_cpu - v.adapters_in_slots if recent else ()
            if reading:
                v = replace(v, adapters_reading=v.adapters_reading | reading)
            out.append(v)
        return out


class InFlight:
    """The adapters of the requests this router sent to each replica that have not
    finished: `ReplicaView.adapters_running`. A replica runs at most max_loras adapters at
    once, so when this router alone has that many others in flight there, a request for
    one more waits for a slot. Routers learn residency late and not per request; this they
    know exactly for their own traffic (Ray calls `on_request_completed` once per request).
    Entries older than `max_age_s` are dropped (a completion that never came).

    A request is *chosen* for a replica (`chosen`) before it is sent: Ray ranks the requests
    of a burst concurrently and reports each as routed (`sent`) only after its replica
    accepted it, a round trip later, so without this every request of a burst sees the
    replicas as the first did: the burst's tail adapters all take the one replica with a
    slot free. A chosen request counts as running there until it is sent, finishes, or
    `chosen_s` passes (Ray sent it nowhere). Its load needs no such note: Ray adds a request
    to its replica's queue length as it sends it, before the round trip."""

    def __init__(self, max_age_s: float = 600.0, chosen_s: float = 2.0) -> None:
        self.max_age_s = max_age_s
        self.chosen_s = chosen_s
        self._requests: dict[str, tuple[str, str, float]] = {}  # id -> (replica, adapter, at)
        self._running: dict[str, dict[str, int]] = {}  # replica -> adapter -> requests
        self._chosen: dict[str, tuple[str, str, float]] = {}  # id -> (replica, adapter, at)

    def chosen(self, request_id: str, replica_id: str, adapter_id: str, now: float) -> None:
        """The router ranked `replica_id` alone first for the request: Ray sends it there
        unless that replica's queue is full. A later choice for the same request replaces it."""
        if is_adapter_key(adapter_id) and request_id not in self._requests:
            self._chosen[request_id] = (replica_id, adapter_id, now)

    def sent(self, request_id: str, replica_id: str, adapter_id: str, now: float) -> None:
        self._chosen.pop(request_id, None)
        if not is_adapter_key(adapter_id) or request_id in self._requests:
            return
        self._requests[request_id] = (replica_id, adapter_id, now)
        running = self._running.setdefault(replica_id, {})
        running[adapter_id] = running.get(adapter_id, 0) + 1
        if len(self._requests) % 1024 == 0:
            self._expire(now)

    def done(self, request_id: str) -> None:
        self._chosen.pop(request_id, None)
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica_id, adapter_id, _ = entry
        running = self._running[replica_id]
        running[adapter_id] -= 1
        if not running[adapter_id]:
            del running[adapter_id]

    def _expire(self, now: float) -> None:
        for rid in [r for r, (_, _, t) in self._requests.items() if now - t > self.max_age_s]:
            self.done(rid)

    def apply(
        self, views: Sequence[ReplicaView], now: float | None = None, request_id: str = ""
    ) -> list[ReplicaView]:
        """`views` with the adapters of this router's requests in flight (and, given `now`,
        of those chosen and not yet sent, other than `request_id`: the one being ranked again)
        as adapters running."""
        chosen: dict[str, list[str]] = {}  # replica -> adapters of its chosen requests
        if now is not None and self._chosen:
            for rid in [r for r, (_, _, t) in self._chosen.items() if now - t > self.chosen_s]:
                del self._chosen[rid]
            for rid, (replica_id, adapter_id, _) in self._chosen.items():
                if rid != request_id:
                    chosen.setdefault(replica_id, []).append(adapter_id)
        out = []
        for v in views:
            running = self._running.get(v.replica_id)
            extra = chosen.get(v.replica_id)
            if running or extra:
                v = replace(v, adapters_running=frozenset(running or ()) | frozenset(extra or ()))
            out.append(v)
        return out
