"""Running a batched request's per-prompt calls together: all or nothing, cancelled together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def gather_cancelling(calls: list[Awaitable[T]]) -> list[T]:
    """The results in order; on the first failure the other calls are cancelled (a batch
    whose one prompt failed is a failed request: no replica keeps generating for it)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """(stream index, item) from all streams as items arrive. The first error is raised and
    ends every stream; closing the merged stream closes them all (the replicas' requests are
    cancelled)."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await _close(stream)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, _END, None))
        except Exception as e:
            await queue.put((i, None, e))
        finally:
            await _close(stream)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(stream: AsyncIterator) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
