"""AdapterRegistry: the cluster's adapter catalog and who holds which adapter.

`RegistryState` is the pure-Python core (tested without Ray); `AdapterRegistry` is the named,
detached, restartable actor around it. The registry keeps no durable state: after a restart it
is rebuilt from the replicas' periodic `report_residency` calls, whose `catalog` argument
re-registers the adapters each replica knows. Routers read `snapshot()` in the background and
never block on it. The actor lives on the head node, with the GCS: a restart
empties the catalog until the replicas' next reports, so losing an ordinary worker node must
not restart it. When it does restart, `recovering()` is True until the first report, and the
ingress holds a request for an adapter it cannot find instead of answering 404.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

REGISTRY_NAME = "raylora_adapter_registry"
REGISTRY_NAMESPACE = "raylora"
DEFAULT_STALE_AFTER_S = 20.0  # 4 missed reports at LLMServer's default report_interval_s (5 s)
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class RegistryState:
    """Catalog (name -> spec) and residency (replica id -> adapters in slots / CPU cache).

    `version` goes up on every change of content (not on a report that changes nothing),
    so a reader can tell whether its copy is current.
    """

    def __init__(
        self,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self.version = 0
        self.adapters: dict[str, dict[str, Any]] = {}  # name -> spec
        self.residency: dict[str, dict[str, Any]] = {}  # replica id -> {slots, cpu, last_report}
        self._started = clock()
        self._heard_a_replica = False
        # Names unregistered since this process started: a replica's catalog report
        # must not bring them back (a report may race with the unload).
        self._unregistered: set[str] = set()

    def register_adapter(
        self, name: str, source: str, rank: int, target_modules: list[str], base_model: str
    ) -> None:
        if not name:
            raise ValueError("adapter name must be non-empty")
        if rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {rank}")
        spec = {
            "source": source,
            "rank": int(rank),
            "target_modules": list(target_modules),
            "base_model": base_model,
        }
        self._unregistered.discard(name)
        if self.adapters.get(name) != spec:
            self.adapters[name] = spec
            self.version += 1

    def unregister_adapter(self, name: str) -> bool:
        if name not in self.adapters:
            return False
        del self.adapters[name]
        self._unregistered.add(name)
        self.version += 1
        return True

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        return {name: dict(spec) for name, spec in self.adapters.items()}

    def report_residency(
        self,
        replica_id: str,
        adapters_in_slots: list[str],
        adapters_in_cpu: list[str],
        catalog: dict[str, dict] | None = None,
    ) -> None:
        """Replace `replica_id`'s residency with a full report; learn unknown catalog entries."""
        for name, spec in (catalog or {}).items():
            if name in self.adapters or name in self._unregistered:
                continue
            self.register_adapter(
                name,
                spec.get("source", ""),
                spec.get("rank", 1),
                spec.get("target_modules", []),
                spec.get("base_model", ""),
            )
        self._heard_a_replica = True
        slots, cpu = sorted(set(adapters_in_slots)), sorted(set(adapters_in_cpu))
        old = self.residency.get(replica_id)
        if old is None or old["slots"] != slots or old["cpu"] != cpu:
            self.version += 1
        self.residency[replica_id] = {"slots": slots, "cpu": cpu, "last_report": self._clock()}

    def remove_replica(self, replica_id: str) -> None:
        if self.residency.pop(replica_id, None) is not None:
            self.version += 1

    def prune(self, live_replica_ids: list[str]) -> None:
        """Forget every replica not in `live_replica_ids`."""
        live = set(live_replica_ids)
        for replica_id in [r for r in self.residency if r not in live]:
            self.remove_replica(replica_id)

    def expire_stale(self) -> list[str]:
        """Forget replicas that have not reported for `stale_after_s`; return their ids."""
        cutoff = self._clock() - self.stale_after_s
        gone = [r for r, e in self.residency.items() if e["last_report"] < cutoff]
        for replica_id in gone:
            self.remove_replica(replica_id)
        return gone

    def recovering(self) -> bool:
        """True while this registry is new and has heard from no replica: its catalog may be
        missing adapters the replicas know (a restart loses it; the next reports restore it).
        Ends at the first report, or stale_after_s after the start (an app with no replicas)."""
        return not self._heard_a_replica and self._clock() - self._started < self.stale_after_s

    def replicas_holding(self, name: str) -> list[str]:
        return sorted(
            r for r, e in self.residency.items() if name in e["slots"] or name in e["cpu"]
        )

    def snapshot(self) -> dict[str, Any]:
        self.expire_stale()
        return {
            "version": self.version,
            "adapters": self.list_adapters(),
            "residency": {
                r: {
                    "slots": list(e["slots"]),
                    "cpu": list(e["cpu"]),
                    "last_report": e["last_report"],
                }
                for r, e in self.residency.items()
            },
        }


@ray.remote(num_cpus=0)
class AdapterRegistry:
    """Actor wrapper of `RegistryState`; create it with `get_or_create_registry()`."""

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> None:
        self._state = RegistryState(stale_after_s=stale_after_s)

    def register_adapter(
        self, name: str, source: str, rank: int, target_modules: list[str], base_model: str
    ) -> None:
        self._state.register_adapter(name, source, rank, target_modules, base_model)

    def unregister_adapter(self, name: str) -> bool:
        return self._state.unregister_adapter(name)

    def list_adapters(self) -> dict[str, dict]:
        return self._state.list_adapters()

    def recovering(self) -> bool:
        return self._state.recovering()

    def report_residency(
        self,
        replica_id: str,
        adapters_in_slots: list[str],
        adapters_in_cpu: list[str],
        catalog: dict[str, dict] | None = None,
    ) -> None:
        self._state.report_residency(replica_id, adapters_in_slots, adapters_in_cpu, catalog)

    def remove_replica(self, replica_id: str) -> None:
        self._state.remove_replica(replica_id)

    def prune(self, live_replica_ids: list[str]) -> None:
        self._state.prune(live_replica_ids)

    def snapshot(self) -> dict:
        return self._state.snapshot()


def get_or_create_registry(stale_after_s: float = DEFAULT_STALE_AFTER_S) -> ray.actor.ActorHandle:
    """The cluster's registry actor, created on first use (detached, restarted forever).

    max_task_retries=-1: a call made while the actor restarts is retried, not failed.
    """
    return AdapterRegistry.options(
        name=REGISTRY_NAME,
        namespace=REGISTRY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        **_on_head_node(),
    ).remote(stale_after_s=stale_after_s)


def _on_head_node() -> dict[str, Any]:
    """Actor options that put the registry on the head node: a sliver of the head's marker
    resource (a soft node affinity was seen to land it on a worker); none if no live node
    carries the marker, so that the registry is never left unschedulable."""
    for node in ray.nodes():
        if node.get("Alive") and HEAD_NODE_RESOURCE in node.get("Resources", {}):
            return {"resources": {HEAD_NODE_RESOURCE: 0.001}}
    return {}


def get_registry() -> ray.actor.ActorHandle:
    """The existing registry actor; raises ValueError if none was created."""
    return ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)
