"""Python's full garbage collections in a serving process: freeze the start-up heap of a
process that routes, and count the full collections.

A full (generation 2) collection walks every object the collector tracks, holding the GIL.
Measured on the 2-core VM: a process that has imported what a replica imports (Ray Serve,
torch, transformers, the engine's modules) holds ~340,000 such objects, and one full
collection took 74 ms idle; in benchmarks/routing.py's driver (~200,000) one took 96 ms
mid-run, and every request in flight there waited for it (its three slowest requests,
100-150 ms, where the rest took under 65). After `gc.freeze()` a full collection walks
only what came after it.

Ray Serve already freezes its replicas' heaps (both deployments here) at the end of their
initialisation (`RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by default; its proxy likewise), as
vLLM does after its warm-up. A driver or any other process that calls raylora through a
DeploymentHandle is not a replica, and it hosts the router (deployments/router.py): call
`freeze_startup_heap()` there, once set up. Not in a process that builds and drops engines
(tests, notebooks): a frozen object that later turns into cyclic garbage is never
collected.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from typing import Any

logger = logging.getLogger("raylora")


def freeze_startup_heap(context: str) -> int:
    """Collect, then move every object alive now into the collector's permanent generation;
    returns how many objects are frozen in this process."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: froze the start-up heap (%d objects) in %.0f ms",
        context,
        frozen,
        1000 * (time.perf_counter() - t0),
    )
    return frozen


class FullCollections:
    """Counts this process's full collections and their pauses (a `gc.callbacks` hook)."""

    def __init__(self) -> None:
        self.count = 0
        self.total_ms = 0.0
        self.max_ms = 0.0
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            ms = 1000 * (time.perf_counter() - self._started)
            self._started = None
            self.count += 1
            self.total_ms += ms
            self.max_ms = max(self.max_ms, ms)

    def stats(self) -> dict[str, float]:
        return {
            "full_collections": self.count,
            "full_collection_ms_total": round(self.total_ms, 1),
            "full_collection_ms_max": round(self.max_ms, 1),
            "frozen_objects": gc.get_freeze_count(),
        }


@functools.cache
def full_collections() -> FullCollections:
    """This process's counter, installed on first use."""
    counter = FullCollections()
    gc.callbacks.append(counter)
    return counter
