"""deployments/gc_heap.py: full collections are counted as the collector itself counts them,
and a frozen start-up heap makes them walk only what came after (in a child process: a
frozen object that later turns into cyclic garbage is never collected, and this process
builds and drops engines)."""

import gc
import subprocess
import sys

import pytest

from deployments.gc_heap import full_collections
from tests.serve_fixtures import REPO

pytestmark = pytest.mark.timeout(60)


def test_full_collections_match_the_collectors_own_count():
    counter = full_collections()
    assert full_collections() is counter  # one hook per process
    before_count, before_ref = counter.count, gc.get_stats()[2]["collections"]
    gc.collect(0)  # a young collection is not a full one
    gc.collect(1)
    for _ in range(3):
        gc.collect()
    assert counter.count - before_count == gc.get_stats()[2]["collections"] - before_ref == 3
    stats = counter.stats()
    assert stats["full_collections"] == counter.count
    assert 0 <= stats["full_collection_ms_max"] <= stats["full_collection_ms_total"]


def test_a_frozen_heap_makes_full_collections_walk_only_what_came_after():
    # In a child process: freezing this one would keep its garbage for good.
    code = (
        "import gc, time\n"
        "from deployments.gc_heap import freeze_startup_heap\n"
        "heap = [[i] for i in range(300_000)]\n"
        "def full():\n"
        "    t = time.perf_counter(); gc.collect(); return time.perf_counter() - t\n"
        "before = min(full() for _ in range(3))\n"
        "n = freeze_startup_heap('test')\n"
        "after = min(full() for _ in range(3))\n"
        "assert n >= 300_000 and gc.get_freeze_count() == n, n\n"
        "assert after < before / 5, (before, after)\n"
        "print('ok', before, after)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=REPO
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
