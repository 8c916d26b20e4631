"""SingleFlight: callers at once share one call of an async refresh (a registry listing)
instead of making one each.

A flood of requests for names no one serves makes the ingress and the replicas list the
registry before each 404 (the name may have been loaded a moment ago elsewhere); the registry
is one actor and a listing carries every adapter, so each such request cost it a listing.
With SingleFlight they cost a listing or three, whatever their number.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class SingleFlight:
    """Runs `call` for many callers as one. `run()` returns once a call that began after it
    was asked has finished (what a caller that saw a stale answer needs); `run(fresh=False)`
    also takes the call under way. An exception of `call` reaches every caller it served."""

    def __init__(self, call: Callable[[], Awaitable[None]]) -> None:
        self._call = call
        self._task: asyncio.Future | None = None
        self._begun = 0  # calls begun, numbered from 1

    async def run(self, fresh: bool = True) -> None:
        asked = self._begun if fresh else self._begun - 1  # a call numbered above this will do
        while True:
            task = self._task
            if task is None or task.done():
                self._begun += 1
                task = self._task = asyncio.ensure_future(self._call())
            number = self._begun
            await asyncio.shield(task)  # a caller that goes away leaves the call to the rest
            if number > asked:
                return
