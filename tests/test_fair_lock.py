"""engine/fair_lock.py: the engine lock is handed over in the order it was asked for, so the
loop, which releases it after a step and asks again at once, queues behind the requests
waiting to be added instead of taking it back first."""

from __future__ import annotations

import threading
import time

import pytest

from engine.fair_lock import FairLock

pytestmark = pytest.mark.timeout(60)


def _wait_for_tickets(lock: FairLock, n: int) -> None:
    """Until n acquires have taken their ticket (the threads are queued in that order)."""
    deadline = time.monotonic() + 10
    while lock._next_ticket < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_the_holder_asking_again_queues_behind_the_waiters():
    lock = FairLock()
    order: list[str] = []
    lock.acquire()
    threads = []
    for i in range(3):
        t = threading.Thread(
            target=lambda i=i: (lock.acquire(), order.append(f"w{i}"), lock.release())
        )
        t.start()
        threads.append(t)
        _wait_for_tickets(lock, i + 2)  # w0, w1, w2 queue in this order
    for _ in range(3):  # as the engine loop between steps: release, and at once again
        lock.release()
        lock.acquire()
        order.append("loop")
    lock.release()
    for t in threads:
        t.join(timeout=10)
    assert order == ["w0", "w1", "w2", "loop", "loop", "loop"]


def test_mutual_exclusion_and_state():
    lock = FairLock()
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
    inside, worst = [0], [0]

    def work():
        for _ in range(200):
            with lock:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert worst[0] == 1 and not lock.locked()
    with lock:
        assert lock.locked()
