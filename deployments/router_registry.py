"""The AdapterAffinityRouter's copy of the AdapterRegistry's snapshot (its residency: which
replica holds which adapter, as the replicas report it), refreshed in the background.

Routing never waits on the registry: a failed or slow refresh keeps the previous snapshot,
and a snapshot older than `max_age_s` is ignored (the router's other sources still count).
The refresh task starts with the first routed request and stops by itself when Ray is shut
down in this process (a driver's router loop outlives `ray.shutdown()`) or when nothing was
routed for `max_age_s`; the next request starts it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import ray

logger = logging.getLogger("ray.serve")

SnapshotFetch = Callable[[], Awaitable[dict]]


class RayShutDown(Exception):
    """Raised by a snapshot fetch when Ray is no longer initialized in this process."""


async def _fetch_registry_snapshot() -> dict:
    from deployments.registry import get_registry

    if not ray.is_initialized():
        raise RayShutDown()
    # get_actor is a blocking GCS lookup: keep it off the event loop.
    handle = await asyncio.to_thread(get_registry)
    return await handle.snapshot.remote()


class RegistrySnapshots:
    """A mixin of the router (it needs RequestRouter's `_get_curr_time_s`): the snapshot,
    its refresh task, and `_last_route_time`, which choose_replicas sets."""

    _get_curr_time_s: Callable[[], float]

    def _init_snapshots(
        self,
        refresh_s: float,
        max_age_s: float,
        use_registry: bool,
        fetch_snapshot: SnapshotFetch | None,
    ) -> None:
        self._registry_refresh_s = float(refresh_s)
        self._registry_max_age_s = float(max_age_s)
        self._use_registry = bool(use_registry)
        # Injectable so tests need no cluster; the clock is RequestRouter's get_curr_time_s.
        self._fetch_snapshot: SnapshotFetch = fetch_snapshot or _fetch_registry_snapshot
        self._snapshot: dict | None = None
        self._snapshot_time: float | None = None
        self._refresh_ok = True
        self._last_route_time: float | None = None
        if getattr(self, "_refresh_task", None) is not None:
            self._refresh_task.cancel()
        self._refresh_task: asyncio.Task | None = None

    async def refresh_registry_once(self) -> bool:
        """Fetch one snapshot; on error keep the old one. Returns whether it succeeded.

        Raises RayShutDown (from the fetch) when Ray was shut down in this process.
        """
        try:
            snapshot = await self._fetch_snapshot()
        except RayShutDown:
            raise
        except Exception as e:  # a restarting registry must not break routing
            if self._refresh_ok:  # log once per run of failures, not every period
                logger.warning(f"AdapterAffinityRouter: registry snapshot failed: {e!r}")
            self._refresh_ok = False
            return False
        self._refresh_ok = True
        self._snapshot = snapshot
        self._snapshot_time = self._get_curr_time_s()
        return True

    async def _refresh_loop(self) -> None:
        while not self._idle():
            try:
                await self.refresh_registry_once()
            except RayShutDown:  # quietly: this process's log streams may be closed by now
                return
            await asyncio.sleep(self._registry_refresh_s)

    def _idle(self) -> bool:
        """Nothing routed for registry_max_age_s: the snapshot would not be used anyway."""
        if self._last_route_time is None:
            return False
        return self._get_curr_time_s() - self._last_route_time > self._registry_max_age_s

    def _ensure_refresh_task(self) -> None:
        if not self._use_registry:
            return
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_loop())

    def _snapshot_residency(self) -> dict[str, dict]:
        if self._snapshot is None or self._snapshot_time is None:
            return {}
        if self._get_curr_time_s() - self._snapshot_time > self._registry_max_age_s:
            return {}
        return self._snapshot.get("residency", {})
