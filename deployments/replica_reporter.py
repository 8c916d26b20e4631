"""ReplicaReporter: an LLMServer replica's side of the AdapterRegistry.

It keeps the replica's copy of the adapter catalog (name -> registry spec: the adapters the
app was built with until the registry answers, then the registry's listing), pushes the
replica's residency (adapters in slots / in the CPU cache) to the registry on every change
and, with a catalog sync, every `report_interval_s`, and drops from the engine any adapter
the registry no longer lists (an unload through the API) once no request of it is left.
A registry that is down or slow never stops serving: every call is bounded by
REGISTRY_CALL_TIMEOUT_S and a failure is logged and retried at the next report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from deployments import metrics
from deployments.single_flight import SingleFlight

logger = logging.getLogger("ray.serve")

REGISTRY_CALL_TIMEOUT_S = 5.0


def get_registry_or_none(state_file: str | None = None, shared_tier_bytes: int | None = None):
    try:
        from deployments.registry import get_or_create_registry

        return get_or_create_registry(state_file=state_file, shared_tier_bytes=shared_tier_bytes)
    except Exception as e:  # serving works without a registry; routing is just less sticky
        logger.warning("raylora: no adapter registry (%s); continuing without it", e)
        return None


class ReplicaReporter:
    def __init__(
        self,
        engine,  # engine.AsyncLLMEngine
        replica_id: str,
        catalog: dict[str, dict],
        report_interval_s: float,
        get_registry: Callable[[], Any] = get_registry_or_none,
    ) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.catalog = catalog
        self._listing = SingleFlight(self._list_catalog)
        self._interval_s = report_interval_s
        self._get_registry = get_registry
        self.registry = get_registry()
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._last_counts: dict[Any, int] = {}  # exported counter -> the total it last saw
        self._task: asyncio.Task | None = None
        engine.add_residency_listener(self._on_residency)

    async def start(self) -> None:
        """Register the initial adapters (a registry that is down must not stop serving),
        then report in the background."""
        try:
            await self.report(sync_catalog=True)
        except Exception as e:
            logger.warning("raylora: first residency report failed: %s", e)
        self._task = asyncio.create_task(self._report_loop())

    def ensure_running(self) -> None:
        """Restart the background reports if they stopped (called from check_health)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            logger.warning("raylora: reporter stopped (%s); restarting", self._task.exception())
            self._task = asyncio.create_task(self._report_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.registry is not None:
            self.registry.remove_replica.remote(self.replica_id)

    def _on_residency(self, adapters_in_slots: list[str], adapters_in_cpu: list[str]) -> None:
        # Called from the engine thread: hand over to our loop, and never raise into it.
        try:
            self._loop.call_soon_threadsafe(self._changed.set)
        except RuntimeError:  # our loop is closed (replica shutting down)
            pass

    async def _report_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), self._interval_s)
                periodic = False
            except asyncio.TimeoutError:
                periodic = True
            self._changed.clear()
            try:
                await self.report(sync_catalog=periodic)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("raylora: residency report failed: %s", e)

    async def report(self, sync_catalog: bool) -> None:
        """Push residency to the registry (+ the catalog this replica knows); on a periodic
        report also refresh the catalog and drop adapters that were unregistered."""
        stats = self.engine.latest_stats()  # on the event loop: never wait for a step
        self._update_metrics(stats)
        if self.registry is None:
            self.registry = self._get_registry()
            if self.registry is None:
                return
        await asyncio.wait_for(
            self.registry.report_residency.remote(
                self.replica_id,
                list(stats["adapters_in_slots"]),
                list(stats["adapters_in_cpu"]),
                self.catalog,
            ),
            REGISTRY_CALL_TIMEOUT_S,
        )
        if sync_catalog:
            await self.refresh_catalog()
            await asyncio.to_thread(self.drop_unregistered)  # takes the engine lock

    def drop_unregistered(self) -> None:
        """Free the memory of adapters the catalog no longer lists; one that still has
        requests in the engine stays until a later sync finds it idle."""
        from engine.errors import InvalidRequestError

        for name in self.engine.list_loras():
            if name in self.catalog:
                continue
            try:
                self.engine.remove_lora(name)
            except InvalidRequestError:  # it has unfinished requests: let them finish
                pass

    async def refresh_catalog(self) -> None:
        """The registry's listing as the catalog, from a listing begun after this call (a
        request for a name not in the catalog asks first: requests at once share one)."""
        if self.registry is not None:
            await self._listing.run()

    async def _list_catalog(self) -> None:
        try:
            listed = await asyncio.wait_for(
                self.registry.list_adapters.remote(), REGISTRY_CALL_TIMEOUT_S
            )
        except Exception as e:
            logger.warning("raylora: registry list_adapters failed: %s", e)
            return
        self.catalog = listed

    def _update_metrics(self, stats: dict[str, Any]) -> None:
        tags = {"replica": self.replica_id}
        metrics.NUM_RUNNING.set(stats.get("num_running", 0), tags=tags)
        metrics.NUM_WAITING.set(stats.get("num_waiting", 0), tags=tags)
        metrics.ADAPTERS_IN_SLOTS.set(len(stats.get("adapters_in_slots", [])), tags=tags)
        metrics.ADAPTERS_IN_CPU.set(len(stats.get("adapters_in_cpu", [])), tags=tags)
        lora = stats.get("lora", {})
        self._advance(metrics.LORA_COUNTERS, lora, tags)
        self._advance(metrics.PREFIX_CACHE_COUNTERS, stats, tags)
        self._advance(metrics.BATCH_COUNTERS, stats.get("steps", {}), tags)
        hits, misses = lora.get("hits", 0), lora.get("misses", 0)
        if hits + misses:
            metrics.SLOT_HIT_RATIO.set(hits / (hits + misses), tags=tags)

    def _advance(self, counters: dict[str, Any], values: dict[str, Any], tags: dict) -> None:
        """Export the growth of the engine's running totals since the last report (remembered
        per counter: two stats dicts may use the same key)."""
        for key, counter in counters.items():
            value = int(values.get(key, 0))
            delta = value - self._last_counts.get(counter, 0)
            if delta > 0:
                counter.inc(delta, tags=tags)
            self._last_counts[counter] = value
