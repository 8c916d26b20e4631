"""ReplicaReporter._update_metrics: what a replica exports of its engine's stats() (the growth
of the engine's running totals as counters, the rest as gauges), with recording metrics."""

import pytest

from deployments import metrics
from deployments.replica_reporter import ReplicaReporter

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def inc(self, value: float = 1.0, tags=None) -> None:
        self.calls.append(("inc", value))

    def set(self, value: float, tags=None) -> None:
        self.calls.append(("set", value))


def _stats(steps: int, seqs: int, loads: int, queries: int) -> dict:
    return {
        "num_running": 2,
        "num_waiting": 1,
        "adapters_in_slots": ["a"],
        "adapters_in_cpu": ["a", "b"],
        "lora": {"loads": loads, "activations": 3, "hits": 1, "misses": 3},
        "prefix_cache_queries": queries,
        "prefix_cache_hits": 0,
        "steps": {"steps": steps, "seqs": seqs, "adapters": steps, "tokens": 2 * seqs},
    }


def test_counters_export_the_growth_of_each_total_once(monkeypatch):
    recorders: dict[str, Recorder] = {}
    for group in ("LORA_COUNTERS", "PREFIX_CACHE_COUNTERS", "BATCH_COUNTERS"):
        fakes = {
            k: recorders.setdefault(f"{group}.{k}", Recorder()) for k in getattr(metrics, group)
        }
        monkeypatch.setattr(metrics, group, fakes)
    for gauge in ("NUM_RUNNING", "NUM_WAITING", "ADAPTERS_IN_SLOTS", "ADAPTERS_IN_CPU"):
        monkeypatch.setattr(metrics, gauge, recorders.setdefault(gauge, Recorder()))
    monkeypatch.setattr(metrics, "SLOT_HIT_RATIO", recorders.setdefault("ratio", Recorder()))
    reporter = object.__new__(ReplicaReporter)  # the metrics part alone: no engine, no loop
    reporter.replica_id, reporter._last_counts = "r0", {}

    reporter._update_metrics(_stats(steps=10, seqs=15, loads=2, queries=7))
    reporter._update_metrics(_stats(steps=10, seqs=15, loads=2, queries=7))  # no growth
    reporter._update_metrics(_stats(steps=14, seqs=21, loads=5, queries=7))

    def incs(name: str) -> list[float]:
        return [v for op, v in recorders[name].calls if op == "inc"]

    assert incs("BATCH_COUNTERS.steps") == [10, 4]
    assert incs("BATCH_COUNTERS.seqs") == [15, 6]
    assert incs("BATCH_COUNTERS.adapters") == [10, 4]
    assert incs("BATCH_COUNTERS.tokens") == [30, 12]
    assert incs("LORA_COUNTERS.loads") == [2, 3]
    assert incs("LORA_COUNTERS.activations") == [3]
    assert incs("PREFIX_CACHE_COUNTERS.prefix_cache_queries") == [7]
    assert recorders["NUM_RUNNING"].calls == [("set", 2)] * 3
    assert recorders["ratio"].calls == [("set", 0.25)] * 3
