"""AdapterRegistry: the cluster's adapter catalog and who holds which adapter.

`RegistryState` is the pure-Python core (tested without Ray); `AdapterRegistry` is the named,
detached, restartable actor around it. Routers read `snapshot()` in the background and never
block on it.

Durability. The catalog (name -> spec) and the tombstones of unloaded adapters live in a
durable record (deployments/catalog_store.py: Ray's GCS KV by default, or a JSON file).
Every catalog change is written there before the method that made it returns, so the HTTP
load/unload API answers only once the change is durable; a failed write raises and leaves
the catalog as it was. A new registry (after a restart) loads the record first: the catalog
is complete from its first call, and no restart opens a 404 window or empties /v1/models.
Residency is not recorded (it changes every few seconds and goes stale anyway): it is
rebuilt from the replicas' reports, and `recovering()` is True until the first one arrives.

Reports never resurrect an unload. A replica's `report_residency(..., catalog)` lists the
adapters it knows, and its copy of the catalog may be up to one report interval old. A
reported name that is in the catalog is left as the catalog has it; one that is tombstoned
is ignored; any other name is learned (a replica's built-in adapters, from the app config)
and written to the record. Only an explicit `register_adapter` (the load API) clears a
tombstone. The consequence: an adapter unloaded through the API stays unloaded for the life
of the record, even if an app config lists it, until it is loaded again through the API.

The actor lives on the head node, with the GCS (and with a FileStore's file), so losing an
ordinary worker node does not restart it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from deployments.catalog_store import CatalogStore, FileStore, GcsKVStore, empty_record
from deployments.shared_adapters import DEFAULT_SHARED_TIER_BYTES, Key, SharedAdapterStore

logger = logging.getLogger(__name__)

REGISTRY_NAME = "raylora_adapter_registry"
REGISTRY_NAMESPACE = "raylora"
DEFAULT_STALE_AFTER_S = 20.0  # 4 missed reports at LLMServer's default report_interval_s (5 s)
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


def make_spec(source: str, rank: int, target_modules: list[str], base_model: str) -> dict:
    """The catalog's spec of one adapter; raises ValueError on a rank below 1."""
    if int(rank) < 1:
        raise ValueError(f"adapter rank must be >= 1, got {rank}")
    return {
        "source": source,
        "rank": int(rank),
        "target_modules": list(target_modules),
        "base_model": base_model,
    }


class RegistryState:
    """Catalog (name -> spec), tombstones and residency (replica id -> slots / CPU cache).

    `store` holds the durable record (None: in memory only, for tests of the residency
    logic). `version` goes up on every change of content, catalog or residency (not on a
    report that changes nothing), so a reader can tell whether its copy is current; it
    counts within this process only. The record's own version is `catalog_version`.
    """

    def __init__(
        self,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
        store: CatalogStore | None = None,
    ) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._store = store
        record = (store.load() if store is not None else None) or empty_record()
        self.catalog_version: int = record["version"]
        self.adapters: dict[str, dict[str, Any]] = record["adapters"]  # name -> spec
        # name -> {"source", "unloaded_at"}: unloaded through the API; reports cannot revive
        self.tombstones: dict[str, dict[str, Any]] = record["tombstones"]
        self.version = 0
        self.residency: dict[str, dict[str, Any]] = {}  # replica id -> {slots, cpu, last_report}
        self._started = clock()
        self._heard_a_replica = False

    # -- catalog (every change goes through _commit) ------------------------------------

    def _commit(self, adapters: dict[str, dict], tombstones: dict[str, dict]) -> None:
        """Make `adapters`/`tombstones` the catalog: durable first, then in memory, so a
        failed write raises and changes nothing."""
        record = {
            **empty_record(),
            "version": self.catalog_version + 1,
            "adapters": adapters,
            "tombstones": tombstones,
        }
        if self._store is not None:
            self._store.save(record)
        self.catalog_version = record["version"]
        self.adapters, self.tombstones = adapters, tombstones
        self.version += 1

    def register_adapter(
        self, name: str, source: str, rank: int, target_modules: list[str], base_model: str
    ) -> None:
        """Add or replace `name` (the load API); clears its tombstone."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        spec = make_spec(source, rank, target_modules, base_model)
        if self.adapters.get(name) == spec and name not in self.tombstones:
            return
        tombstones = {n: t for n, t in self.tombstones.items() if n != name}
        self._commit({**self.adapters, name: spec}, tombstones)

    def unregister_adapter(self, name: str) -> bool:
        """Remove `name` and tombstone it (the unload API); False if it is not registered."""
        spec = self.adapters.get(name)
        if spec is None:
            return False
        adapters = {n: s for n, s in self.adapters.items() if n != name}
        tomb = {"source": spec["source"], "unloaded_at": self._clock()}
        self._commit(adapters, {**self.tombstones, name: tomb})
        return True

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        return {name: dict(spec) for name, spec in self.adapters.items()}

    def _learn(self, catalog: dict[str, dict]) -> None:
        """Add the reported names that are neither registered nor tombstoned (one write)."""
        learned = {}
        for name, spec in catalog.items():
            if not name or name in self.adapters or name in self.tombstones:
                continue
            try:
                learned[name] = make_spec(
                    spec.get("source", ""),
                    spec.get("rank", 1),
                    spec.get("target_modules", []),
                    spec.get("base_model", ""),
                )
            except (TypeError, ValueError) as e:  # one bad entry must not block the rest
                logger.warning("registry: ignoring reported adapter %r: %s", name, e)
        if learned:
            self._commit({**self.adapters, **learned}, self.tombstones)

    # -- residency (in memory only) ------------------------------------------------------

    def report_residency(
        self,
        replica_id: str,
        adapters_in_slots: list[str],
        adapters_in_cpu: list[str],
        catalog: dict[str, dict] | None = None,
    ) -> None:
        """Replace `replica_id`'s residency with a full report; learn unknown catalog entries
        (never tombstoned ones). Residency is taken even if writing learned entries fails."""
        self._heard_a_replica = True
        slots, cpu = sorted(set(adapters_in_slots)), sorted(set(adapters_in_cpu))
        old = self.residency.get(replica_id)
        if old is None or old["slots"] != slots or old["cpu"] != cpu:
            self.version += 1
        self.residency[replica_id] = {"slots": slots, "cpu": cpu, "last_report": self._clock()}
        self._learn(catalog or {})

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
        """True while this registry is new and has heard from no replica. Its catalog is the
        durable record's, complete for everything loaded through the API, but residency is
        empty until the reports arrive, and on a first start (no record yet) the replicas'
        built-in adapters are unknown until their first report. Ends at the first report, or
        stale_after_s after the start (an app with no replicas)."""
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


def make_store(state_file: str | None) -> CatalogStore:
    """The registry's durable store: the GCS KV by default, a JSON file if `state_file`."""
    return GcsKVStore(REGISTRY_NAME) if state_file is None else FileStore(state_file)


@ray.remote(num_cpus=0)
class AdapterRegistry:
    """Actor wrapper of `RegistryState`; create it with `get_or_create_registry()`.

    Ray restarts it with the same arguments, so a restart reopens the same store and loads
    the record before serving its first call. A record that cannot be read fails __init__
    with CatalogStoreError naming it (catalog_store.py says why it does not start empty)."""

    def __init__(
        self,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        state_file: str | None = None,
        shared_tier_bytes: int = DEFAULT_SHARED_TIER_BYTES,
    ) -> None:
        self._state = RegistryState(stale_after_s=stale_after_s, store=make_store(state_file))
        self._incarnation = uuid.uuid4().hex  # new at every (re)start
        # the shared adapter tier's refs (deployments/shared_adapters.py); not durable: after
        # a restart the store is empty and the replicas read from disk and share again
        self._shared = SharedAdapterStore(shared_tier_bytes)

    def incarnation(self) -> str:
        """An id of this process of the actor: it changes when Ray restarts it."""
        return self._incarnation

    def register_adapter(
        self, name: str, source: str, rank: int, target_modules: list[str], base_model: str
    ) -> None:
        self._state.register_adapter(name, source, rank, target_modules, base_model)
        self._shared.drop_name(name)  # a (re)load: no replica may fetch an older copy

    def unregister_adapter(self, name: str) -> bool:
        self._shared.drop_name(name)
        return self._state.unregister_adapter(name)

    def shared_claim(self, key: Key, owner: str) -> tuple[str, list | None]:
        return self._shared.claim(key, owner)

    def shared_has(self, key: Key) -> bool:
        return self._shared.has(key)

    def shared_abandon(self, key: Key, owner: str) -> None:
        self._shared.abandon(key, owner)

    def shared_put(self, key: Key, refs: list, num_bytes: int, owner: str = "") -> bool:
        return self._shared.put(key, refs, num_bytes, owner)

    def shared_forget(self, key: Key) -> None:
        self._shared.forget(key)

    def shared_stats(self) -> dict:
        return self._shared.stats()

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
        self._shared.drop_owners({replica_id})  # its copies go with it

    def prune(self, live_replica_ids: list[str]) -> None:
        self._state.prune(live_replica_ids)
        self._shared.drop_owners(self._shared.owners() - set(live_replica_ids))

    def snapshot(self) -> dict:
        self._shared.drop_owners(set(self._state.expire_stale()))
        return self._state.snapshot()


def get_or_create_registry(
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    state_file: str | None = None,
    shared_tier_bytes: int | None = None,
) -> ray.actor.ActorHandle:
    """The cluster's registry actor, created on first use (detached, restarted forever).

    state_file None keeps the durable record in the GCS KV; a path keeps it in that JSON file
    on the head node (deployments/catalog_store.py). shared_tier_bytes: the object-store
    budget of the shared adapter tier (None: DEFAULT_SHARED_TIER_BYTES). The first caller's
    arguments win: an existing actor is returned as it is.
    max_task_retries=-1: a call made while the actor restarts is retried, not failed.
    """
    if state_file is not None and not os.path.isabs(state_file):
        # The actor opens it on the head node, in its own working directory.
        raise ValueError(f"state_file must be an absolute path, got {state_file!r}")
    budget = DEFAULT_SHARED_TIER_BYTES if shared_tier_bytes is None else shared_tier_bytes
    return AdapterRegistry.options(
        name=REGISTRY_NAME,
        namespace=REGISTRY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        **_on_head_node(),
    ).remote(stale_after_s=stale_after_s, state_file=state_file, shared_tier_bytes=budget)


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
