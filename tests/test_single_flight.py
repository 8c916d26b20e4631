"""deployments/single_flight.py: callers at once share one call, and `run()` answers only
after a call begun after it was asked (against a counting fake call that records what the
"registry" held when each call began)."""

import asyncio

import pytest

from deployments.single_flight import SingleFlight

pytestmark = pytest.mark.timeout(30)


class Listing:
    """A registry listing: snapshots `source` when it begins, answers 20 ms later."""

    def __init__(self) -> None:
        self.source: set[str] = set()
        self.seen: set[str] = set()
        self.calls = 0
        self.fail = False

    async def __call__(self) -> None:
        self.calls += 1
        snapshot = set(self.source)
        await asyncio.sleep(0.02)
        if self.fail:
            raise RuntimeError("registry down")
        self.seen = snapshot


def test_callers_at_once_share_calls_and_each_sees_a_call_begun_after_it_asked():
    async def run():
        listing = Listing()
        flight = SingleFlight(listing)
        await asyncio.gather(*(flight.run() for _ in range(100)))
        # the first caller began a call; the other 99 asked after it began: one more for all
        assert listing.calls == 2
        # one call under way; a name added after it began; a caller asking now must not get
        # that call's answer
        under_way = asyncio.ensure_future(flight.run())
        await asyncio.sleep(0.005)
        listing.source.add("new")
        await asyncio.gather(*(flight.run() for _ in range(50)))
        assert "new" in listing.seen and listing.calls == 4
        await under_way
        # fresh=False takes the call under way
        first = asyncio.ensure_future(flight.run())
        await asyncio.sleep(0.005)
        await asyncio.gather(first, flight.run(fresh=False))
        assert listing.calls == 5

    asyncio.run(run())


def test_a_failure_reaches_its_callers_and_a_cancelled_caller_leaves_the_call_to_the_rest():
    async def run():
        listing = Listing()
        flight = SingleFlight(listing)
        listing.fail = True
        got = await asyncio.gather(flight.run(), flight.run(), return_exceptions=True)
        # the second asked after the call began, but a failure answers whoever waits on it
        assert [type(e) for e in got] == [RuntimeError, RuntimeError] and listing.calls == 1
        listing.fail = False
        listing.source.add("a")
        leaving = asyncio.ensure_future(flight.run())
        staying = asyncio.ensure_future(flight.run())
        await asyncio.sleep(0.005)
        leaving.cancel()
        await staying  # asked after the leaving caller's call began: waits for one more
        assert listing.seen == {"a"} and listing.calls == 3
        await flight.run()
        assert listing.calls == 4

    asyncio.run(run())
