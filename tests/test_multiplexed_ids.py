"""MultiplexedIdReporter without Ray: what it pushes, when, and after a failed push.
(tests/test_serve_multiplex.py checks that Ray's router really receives the ids.)"""

from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.multiplexed_ids import MultiplexedIdReporter

pytestmark = pytest.mark.timeout(30)
INTERVAL_S = 0.02


async def settle() -> None:
    await asyncio.sleep(5 * INTERVAL_S)


def test_pushes_cpu_cache_and_loading_on_change_only():
    pushed: list[list[str]] = []

    async def run():
        reporter = MultiplexedIdReporter(pushed.append, interval_s=INTERVAL_S)
        reporter.start()
        await settle()
        assert pushed == []  # nothing held: the controller already has no ids
        with reporter.loading("b"):  # reported while it is read, as Ray's wrapper does
            await settle()
            assert pushed[-1] == ["b"]
            # the engine thread reports a cache change (slots are not ids)
            t = threading.Thread(target=reporter.on_residency, args=(["a"], ["a"]))
            t.start()
            t.join()
            await settle()
            assert pushed[-1] == ["a", "b"]
        await settle()
        assert pushed[-1] == ["a"]  # the read failed or was not inserted: b is gone
        n = len(pushed)
        reporter.on_residency(["x"], ["a"])  # a slot change alone: same ids, no push
        await settle()
        assert len(pushed) == n
        reporter.on_residency([], [])  # evicted
        await settle()
        assert pushed[-1] == []
        reporter.stop()

    asyncio.run(run())


def test_a_failed_push_is_retried():
    calls: list[list[str]] = []

    def flaky(ids: list[str]) -> None:
        calls.append(ids)
        if len(calls) == 1:
            raise RuntimeError("controller unreachable")

    async def run():
        reporter = MultiplexedIdReporter(flaky, interval_s=INTERVAL_S)
        reporter.start()
        reporter.on_residency([], ["a"])
        await settle()
        assert calls[:2] == [["a"], ["a"]]
        reporter.stop()

    asyncio.run(run())
