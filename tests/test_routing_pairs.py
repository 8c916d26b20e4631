"""benchmarks/routing_pairs.py: pooling routing benchmarks pair of runs by pair of runs.

The t table is checked against a quantile computed here from Student's density (numerical
integration, bisection), the interval by its coverage over simulated benchmarks whose true
ratio is known, the pairs and ratios against hand-built latencies files."""

import json
import math
import random
import statistics

import pytest

from benchmarks import routing_pairs as rp

pytestmark = pytest.mark.timeout(120)


def _t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """P(T <= x) for x >= 0: 1/2 plus Simpson's rule over Student's density on [0, x]."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def pdf(t: float) -> float:
        return c * (1 + t * t / df) ** (-(df + 1) / 2)

    h = x / steps
    total = pdf(0) + pdf(x)
    total += sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return 0.5 + total * h / 3


def _t_quantile(p: float, df: int) -> float:
    lo, hi = 0.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("df", [1, 2, 3, 5, 8, 13, 20, 30, 120])
def test_t_table_is_students_quantile(df):
    assert rp.t95(df) == pytest.approx(_t_quantile(0.95, df), abs=2e-3)


def test_t_between_and_past_the_table():
    # between tabulated df: the smaller df's (wider) quantile, which is >= the true one
    assert rp.t95(22) == rp.T95[20] >= _t_quantile(0.95, 22)
    assert rp.t95(121) == pytest.approx(statistics.NormalDist().inv_cdf(0.95), abs=1e-3)
    with pytest.raises(ValueError):
        rp.t95(0)


def test_interval_covers_the_true_ratio_nine_times_in_ten():
    """Simulated benchmarks: n pairs whose log ratios are normal around log(1.03); the 90%
    interval must hold 1.03 in ~90% of them (binomial sd over 3,000 trials: 0.55%)."""
    rng = random.Random(15)
    for n in (3, 6, 10):
        hits = 0
        for _ in range(3000):
            ratios = [math.exp(rng.gauss(math.log(1.03), 0.12)) for _ in range(n)]
            _, lo, hi = rp.geometric_interval(ratios)
            hits += lo <= 1.03 <= hi
        assert 0.875 <= hits / 3000 <= 0.925, (n, hits)


def test_interval_shape():
    geo, lo, hi = rp.geometric_interval([0.9, 0.9, 0.9])
    assert geo == pytest.approx(0.9) and lo == pytest.approx(0.9) and hi == pytest.approx(0.9)
    geo, lo, hi = rp.geometric_interval([0.5, 2.0])
    assert geo == pytest.approx(1.0) and lo * hi == pytest.approx(1.0) and lo < 1 < hi
    assert rp.geometric_interval([1.2]) == (pytest.approx(1.2), 0.0, math.inf)
    for bad in ([], [1.0, 0.0]):
        with pytest.raises(ValueError):
            rp.geometric_interval(bad)


def test_verdict():
    assert rp.verdict(0.9, 1.1, 0.1) == "no worse"
    assert rp.verdict(1.11, 1.3, 0.1) == "worse"
    assert rp.verdict(0.95, 1.14, 0.1) == "not settled"


def _run(policy: str, run: int, latencies: list[float], **extra) -> dict:
    return {
        "policy": policy,
        "run": run,
        "latency_ms": {str(i): x for i, x in enumerate(latencies)},
        **extra,
    }


def test_pairs_match_run_indices_whatever_the_order():
    runs = [
        _run("affinity", 0, [1.0]),
        _run("ray_multiplex", 0, [2.0]),
        _run("other", 0, [3.0]),
        _run("ray_multiplex", 1, [4.0]),
        _run("affinity", 1, [5.0]),
        _run("affinity", 2, [6.0]),  # no peer run 2: not a pair
    ]
    got = rp.pairs(runs, "affinity", "ray_multiplex")
    assert [(a["run"], m["run"]) for a, m in got] == [(0, 0), (1, 1)]
    assert [(a["policy"], m["policy"]) for a, m in got] == [("affinity", "ray_multiplex")] * 2


def test_main_pools_every_file(tmp_path, capsys):
    """Two files, three pairs; the peer's latencies are 1..100 ms, affinity's the same times
    0.8, 1.0 and 1.25: p99 ratios 0.8, 1.0, 1.25 (routing_timing.percentile: index 99 of
    100), slot loads 0.5x where the file has them."""
    base = [float(x) for x in range(1, 101)]
    one = [
        _run("affinity", 0, [0.8 * x for x in base], activations=5, disk=2),
        _run("ray_multiplex", 0, base, activations=10, disk=4),
        _run("ray_multiplex", 1, base, activations=10, disk=4),
        _run("affinity", 1, base, activations=5, disk=2),
    ]
    two = [_run("affinity", 0, [1.25 * x for x in base]), _run("ray_multiplex", 0, base)]
    paths = []
    for i, runs in enumerate((one, two)):
        paths.append(tmp_path / f"lat{i}.json")
        paths[-1].write_text(json.dumps({"trace": [], "runs": runs}))
    assert rp.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "run 1: p99 80 vs 100 ms (0.80x), p50 0.80x, slot loads 0.50x, disk loads 0.50x" in out
    assert "lat1.json run 1: p99 125 vs 100 ms (1.25x), p50 1.25x\n" in out
    p99 = next(line for line in out.splitlines() if line.strip().startswith("p99:"))
    geo, lo, hi = rp.geometric_interval([0.8, 1.0, 1.25])
    assert f"3 pairs, median 1.000x, geometric mean {geo:.3f}x" in p99
    assert f"(90% interval {lo:.3f}-{hi:.3f}x), under 1.0 in 1" in p99
    assert p99.endswith("against 1.1x: not settled")
    assert "slot loads: 2 pairs, median 0.500x" in out
    # each file one draw: sqrt(0.8 * 1.0) and 1.25
    by = next(line for line in out.splitlines() if "by benchmark" in line)
    geo, lo, hi = rp.geometric_interval([math.sqrt(0.8), 1.25])
    assert f"2 benchmarks, geometric mean {geo:.3f}x (90% interval {lo:.3f}-{hi:.3f}x)" in by
    assert by.endswith("under 1.0 in 1; against 1.1x: not settled")


def test_by_benchmark_weighs_each_benchmark_once():
    """A benchmark of many pairs counts as much as one of two: the line is the interval of
    the benchmarks' geometric means, whatever their sizes."""
    groups = [[0.9] * 8, [1.0, 1.0], [1.1, 1.1, 1.1]]
    geo, lo, hi = rp.geometric_interval([0.9, 1.0, 1.1])
    line = rp.by_benchmark(groups, 0.1)
    assert line.startswith(f"p99 by benchmark: 3 benchmarks, geometric mean {geo:.3f}x")
    assert f"(90% interval {lo:.3f}-{hi:.3f}x), under 1.0 in 1" in line
    pooled, _, _ = rp.geometric_interval([r for g in groups for r in g])
    assert pooled < geo  # the eight 0.9s pull the pair-by-pair mean down, not this one
    tight = rp.by_benchmark([[1.0, 1.02], [0.99], [1.01, 1.0]], 0.1)
    assert tight.endswith("against 1.1x: no worse")


def test_main_without_both_arms(tmp_path):
    path = tmp_path / "lat.json"
    path.write_text(json.dumps({"trace": [], "runs": [_run("affinity", 0, [1.0])]}))
    assert rp.main([str(path)]) == 2
