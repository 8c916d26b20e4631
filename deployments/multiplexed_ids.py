"""MultiplexedIdReporter: a replica tells Ray Serve which adapters it holds, as
`@serve.multiplexed` would.

A Ray Serve LLM replica loads LoRA adapters through `@serve.multiplexed(
max_num_models_per_replica=N)`: an LRU of N adapters per replica whose ids (loaded, and being
loaded) `_ModelMultiplexWrapper` pushes to the controller whenever the set changes (checked
every PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S = 0.1 s), through
`client.record_request_routing_info(RequestRoutingInfo(replica_id, multiplexed_model_ids))`.
The controller broadcasts them to every router as `RunningReplica.multiplexed_model_ids`, and
Ray's `PowerOfTwoChoicesRequestRouter` then picks among the replicas reporting the request's
model id (`apply_multiplex_routing`).

raylora's engine already is that LRU: its CPU cache (`max_cpu_loras`) is read on first use and
evicts least recently used. So instead of a second LRU that could disagree with the engine,
this pushes the engine's own CPU-cache set (plus the adapters being read into it) through the
same call, on the same 0.1 s cadence: Ray's router sees exactly what a `@serve.multiplexed`
replica with `max_num_models_per_replica = max_cpu_loras` would report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("ray.serve")

PushIds = Callable[[list[str]], None]


def _ray_push(replica_id: Any) -> PushIds:
    """Ray's own path for multiplexed ids (ray/serve/multiplex.py, _push_model_ids_info)."""
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve.context import _get_global_client

    def push(ids: list[str]) -> None:
        info = RequestRoutingInfo(replica_id=replica_id, multiplexed_model_ids=ids)
        _get_global_client().record_request_routing_info(info)  # fire and forget

    return push


def push_for_this_replica() -> PushIds | None:
    """The push function inside a Serve replica; None outside Serve (tests, a plain actor)."""
    from ray.serve.context import _get_internal_replica_context

    context = _get_internal_replica_context()
    return None if context is None else _ray_push(context.replica_id)


def _interval_s() -> float:
    from ray.serve._private.constants import PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S

    return float(PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S)


class MultiplexedIdReporter:
    """Pushes (CPU-cache adapters | adapters being loaded) on change, at most every
    interval_s. Feed it `on_residency` (the engine's residency listener, any thread) and
    wrap adapter reads in `loading(name)` (on the replica's event loop)."""

    def __init__(self, push: PushIds, interval_s: float | None = None) -> None:
        self._push = push
        self._interval_s = _interval_s() if interval_s is None else interval_s
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._in_cpu: frozenset[str] = frozenset()
        self._loading: dict[str, int] = {}  # adapter -> reads in progress
        self._pushed: list[str] = []  # what the controller has; it starts with no ids
        self._push_ok = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._push_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def on_residency(self, adapters_in_slots: list[str], adapters_in_cpu: list[str]) -> None:
        # From the engine thread: a frozenset assignment is atomic; wake our loop.
        self._in_cpu = frozenset(adapters_in_cpu)
        try:
            self._loop.call_soon_threadsafe(self._changed.set)
        except RuntimeError:  # our loop is closed (replica shutting down)
            pass

    @contextlib.contextmanager
    def loading(self, adapter: str) -> Iterator[None]:
        """Report `adapter` while it is read, as Ray's wrapper reports a model being loaded
        (requests that arrive meanwhile then queue for this replica, not for a second read)."""
        self._loading[adapter] = self._loading.get(adapter, 0) + 1
        self._changed.set()
        try:
            yield
        finally:
            left = self._loading.pop(adapter) - 1
            if left:
                self._loading[adapter] = left
            self._changed.set()

    def ids(self) -> list[str]:
        return sorted(self._in_cpu | self._loading.keys())

    async def _push_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            ids = self.ids()
            if ids != self._pushed:
                try:
                    self._push(ids)
                    self._pushed, self._push_ok = ids, True
                except Exception as e:  # routing only gets less sticky meanwhile: retry
                    if self._push_ok:  # log once per run of failures
                        logger.warning("raylora: pushing multiplexed model ids failed: %s", e)
                    self._push_ok = False
                    self._changed.set()
            await asyncio.sleep(self._interval_s)
