"""Affinity against the peer over many routing benchmarks, pair of runs by pair of runs.

One benchmark's p99 ratio is a draw: on these shared 2-core machines each arm's p99 moves by
up to ~20% between runs of the same code. Each `--runs` of benchmarks/routing.py runs the
arms back to back (ABBA), so run i of affinity and run i of the peer shared a stretch of the
machine's time: a pair. This pools the pairs of every `--latencies-out` file given and
states how sure the comparison is, as a 90% interval of the geometric mean of the pairs'
p99 ratios (Student's t on their logarithms: the pairs are independent draws of one
ratio, spread log-symmetrically):

    python -m benchmarks.routing_pairs /tmp/lat1.json /tmp/lat2.json ...

The verdict against the benchmark's tolerance (1.1x: "p99 no worse"): "no worse" when the
interval's upper end is within it, "worse" when its lower end is past it, else "not
settled" (more pairs needed).

The pairs of one benchmark are not quite independent: they share its deployment order and
its hour of the machine. With two files or more, the p99 is pooled once more with each
benchmark as one draw (the geometric mean of its pairs' ratios; t with one degree of
freedom fewer than the benchmarks), the cautious figure where the two differ.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from benchmarks.routing_timing import percentile

# Student's t, 0.95 quantile (a two-sided 90% interval), by degrees of freedom; past the
# table the next smaller tabulated df's (a slightly wider interval), then the normal's
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
       9: 1.833, 10: 1.812, 11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753,
       16: 1.746, 17: 1.740, 18: 1.734, 19: 1.729, 20: 1.725, 25: 1.708, 30: 1.697,
       40: 1.684, 60: 1.671, 120: 1.658}  # fmt: skip
Z95 = 1.645
# what benchmarks/routing.py keeps of each run's loads in its latencies file: slot
# activations and reads into the CPU cache (disk), summed over the replicas
LOAD_KEYS = ("activations", "disk")
# every ratio a pair gives, and its printed name
FIGURES = {"p99": "p99", "p50": "p50", "activations": "slot loads", "disk": "disk loads"}


def t95(df: int) -> float:
    """The 0.95 quantile of Student's t with df degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df > max(T95):
        return Z95
    return T95[max(k for k in T95 if k <= df)]


def geometric_interval(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, lower, upper): the 90% interval of the geometric mean of ratios
    (the t interval of their logarithms' mean, exponentiated). One ratio: no interval
    (lower 0, upper inf)."""
    if not ratios or min(ratios) <= 0:
        raise ValueError("ratios must be positive and at least one")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(lower: float, upper: float, tolerance: float) -> str:
    """Where the interval lies against 1 + tolerance."""
    if upper <= 1 + tolerance:
        return "no worse"
    if lower > 1 + tolerance:
        return "worse"
    return "not settled"


def pairs(runs: list[dict], arm: str, peer: str) -> list[tuple[dict, dict]]:
    """(arm's run i, peer's run i) for every run index both have, in run order."""
    by = {(r["policy"], r["run"]): r for r in runs}
    index = sorted({r["run"] for r in runs})
    return [(by[arm, i], by[peer, i]) for i in index if (arm, i) in by and (peer, i) in by]


def quantiles_ms(run: dict) -> tuple[float, float]:
    """A run's p50 and p99 latency, ms (the latencies file keeps each request's, ms)."""
    latencies = sorted(run["latency_ms"].values())
    return percentile(latencies, 0.5), percentile(latencies, 0.99)


def pair_row(a: dict, m: dict) -> dict[str, float]:
    """One pair's figures: p99 of each arm, and the ratios of p50, p99 and the loads where
    the file has them (benchmarks/routing.py writes `activations` and `disk` since 2026-12-07)."""
    (a50, a99), (m50, m99) = quantiles_ms(a), quantiles_ms(m)
    row = {"p50": a50 / m50, "p99": a99 / m99, "p99_ms": a99, "peer_p99_ms": m99}
    for key in LOAD_KEYS:
        if key in a and key in m:
            row[key] = a[key] / max(1, m[key])
    return row


def summarize(rows: list[dict[str, float]], tolerance: float) -> list[str]:
    """The pooled lines: per figure the median, geometric mean and its 90% interval, and
    for p99 the verdict."""
    out = []
    for key, name in FIGURES.items():
        ratios = [r[key] for r in rows if key in r]
        if not ratios:
            continue
        geo, lo, hi = geometric_interval(ratios)
        line = (
            f"{name}: {len(ratios)} pairs, median {statistics.median(ratios):.3f}x, geometric "
            f"mean {geo:.3f}x (90% interval {lo:.3f}-{hi:.3f}x), under 1.0 in "
            f"{sum(r < 1 for r in ratios)}"
        )
        if key == "p99":
            line += f"; against {1 + tolerance:g}x: {verdict(lo, hi, tolerance)}"
        out.append(line)
    return out


def by_benchmark(groups: list[list[float]], tolerance: float) -> str:
    """The p99 line with each benchmark one draw: `groups` holds each benchmark's pairs'
    ratios; its draw is their geometric mean."""
    draws = [geometric_interval(g)[0] for g in groups]
    geo, lo, hi = geometric_interval(draws)
    return (
        f"p99 by benchmark: {len(draws)} benchmarks, geometric mean {geo:.3f}x (90% interval "
        f"{lo:.3f}-{hi:.3f}x), under 1.0 in {sum(d < 1 for d in draws)}; against "
        f"{1 + tolerance:g}x: {verdict(lo, hi, tolerance)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("latencies", nargs="+", type=Path, help="routing.py --latencies-out files")
    p.add_argument("--arm", default="affinity")
    p.add_argument("--peer", default="ray_multiplex")
    p.add_argument("--tolerance", type=float, default=0.1, help="p99 'no worse' within this")
    args = p.parse_args(argv)
    rows, groups = [], []
    for path in args.latencies:
        runs = json.loads(path.read_text())["runs"]
        found = pairs(runs, args.arm, args.peer)
        if not found:
            print(f"{path}: no run of both {args.arm} and {args.peer}", file=sys.stderr)
            return 2
        groups.append([])
        for a, m in found:
            row = pair_row(a, m)
            rows.append(row)
            groups[-1].append(row["p99"])
            loads = "".join(f", {FIGURES[key]} {row[key]:.2f}x" for key in LOAD_KEYS if key in row)
            print(
                f"{path} run {a['run'] + 1}: p99 {row['p99_ms']:.0f} vs "
                f"{row['peer_p99_ms']:.0f} ms ({row['p99']:.2f}x), p50 {row['p50']:.2f}x{loads}"
            )
    print(f"\n{args.arm} against {args.peer}, pair by pair:")
    for line in summarize(rows, args.tolerance):
        print(f"  {line}")
    if len(groups) > 1:
        print(f"  {by_benchmark(groups, args.tolerance)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
