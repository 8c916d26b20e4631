"""benchmarks/routing.py's report: each run's table, the medians over runs, the issue's bar
for affinity against the peer (`judge`) and the comparisons printed but not judged.

Pure functions of the run records `run_policy` returns (dicts: "policy", "ok",
"activations" = slot loads, "disk", "shared", "loads", "p50_ms", "p99_ms", "latency_ms",
...), so they are tested without a Serve deployment (tests/test_routing_report.py).
"""

from __future__ import annotations

import statistics

PEER = "ray_multiplex"  # the arm affinity is judged against: what a Ray Serve LLM user runs
ROUTER_ONLY = "ray_multiplex_raylora_engine"  # the peer's router on raylora's engine


def print_table(results: list[dict], num_requests: int) -> None:
    header = (
        f"{'policy':<30}{'ok':>6}{'slot loads':>12}{'disk loads':>12}{'shared':>8}{'all loads':>11}"
        f"{'loads/req':>11}{'p50':>9}{'p99':>9}  adapters in CPU per replica"
    )
    print(header)
    for r in results:
        print(
            f"{r['policy']:<30}{r['ok']:>6}{r['activations']:>12}{r['disk']:>12}"
            f"{r.get('shared', 0):>8}{r['loads']:>11}{r['loads'] / num_requests:>11.2f}{r['p50_ms']:>7.0f}ms"
            f"{r['p99_ms']:>7.0f}ms  {r.get('cpu_cached_per_replica', '')}"
        )


def gc_text(counts: list[tuple[int, float]]) -> str:
    return ", ".join(f"{n} ({ms:.0f} ms)" for n, ms in counts)


def medians(results: list[dict]) -> list[dict]:
    """One row per policy (in first-run order): the median of each figure over the runs."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in results):
        runs = [r for r in results if r["policy"] == policy]
        row: dict = {"policy": policy, "ok": min(r["ok"] for r in runs)}
        for key in ("activations", "disk", "shared", "loads", "p50_ms", "p99_ms"):
            row[key] = statistics.median(r[key] for r in runs)
        out.append(row)
    return out


def pooled_p99_ms(runs: list[dict]) -> float:
    """p99 of every request of every run (a run's p99 rests on its slowest 1%: 24 requests of
    2,400; pooled, the slowest 1% of all of them)."""
    from benchmarks.routing_timing import percentile  # imports Ray: not before main sets its env

    return percentile([x for r in runs for x in r["latency_ms"].values()], 0.99)


def print_p99_spread(results: list[dict], peer: str) -> None:
    """Not judged: how far a p99 moves between runs, and the runs pooled."""
    by = {p: [r for r in results if r["policy"] == p] for p in ("affinity", peer)}
    a, m = pooled_p99_ms(by["affinity"]), pooled_p99_ms(by[peer])
    runs = ", ".join(
        f"{x['p99_ms']:.0f}/{y['p99_ms']:.0f}"
        for x, y in zip(by["affinity"], by[peer], strict=True)
    )
    print(
        f"  (not judged) p99 per run, affinity/{peer}: {runs}; all runs pooled: "
        f"{a:.0f} vs {m:.0f} ms ({a / m:.2f}x)"
    )


def judge(rows: dict[str, dict], min_disk: int, p99_tolerance: float) -> list[tuple[str, bool]]:
    """The issue's bar for affinity against ray_multiplex: [(what, met)]."""
    a, m = rows["affinity"], rows[PEER]
    disk_floor = a["disk"] <= min_disk and m["disk"] <= min_disk
    return [
        (
            f"slot loads {a['activations']:g} vs {m['activations']:g} "
            f"({a['activations'] / max(1, m['activations']):.2f}x), fewer",
            a["activations"] < m["activations"],
        ),
        (
            f"disk loads {a['disk']:g} vs {m['disk']:g} "
            f"({a['disk'] / max(1, m['disk']):.2f}x), fewer"
            + (f" (both at the minimum, {min_disk})" if disk_floor else ""),
            a["disk"] < m["disk"] or disk_floor,
        ),
        (
            f"p99 {a['p99_ms']:.0f} ms vs {m['p99_ms']:.0f} ms "
            f"({a['p99_ms'] / m['p99_ms']:.2f}x), <= {1 + p99_tolerance:g}x",
            a["p99_ms"] <= (1 + p99_tolerance) * m["p99_ms"],
        ),
    ]


def report(results: list[dict], num_requests: int, min_disk: int, p99_tolerance: float) -> bool:
    """Print every run's table, the medians (several runs), the first errors, the bar for affinity against
    the peer and the comparisons not judged; True if affinity missed the bar."""
    num_runs = 1 + max(r["run"] for r in results)
    for run in range(num_runs):
        print(f"\nrun {run + 1}:")
        print_table([r for r in results if r["run"] == run], num_requests)
    rows = {r["policy"]: r for r in medians(results)}
    if num_runs > 1:
        print(f"\nmedian of {num_runs} runs:")
        print_table(list(rows.values()), num_requests)
    for r in results:
        for e in r["errors"][:3]:
            print(f"  {r['policy']} error: {e}")
    missed = False
    if "affinity" in rows and PEER in rows:
        print(f"\naffinity against {PEER} (the issue's bar):")
        for what, met in judge(rows, min_disk, p99_tolerance):
            print(f"  {'met    ' if met else 'NOT MET'} {what}")
            missed |= not met
        if num_runs > 1:
            print_p99_spread(results, PEER)
    print_not_judged(rows)
    return missed


def print_not_judged(rows: dict[str, dict]) -> None:
    """affinity against the peer's router on its own engine, the moves' effect, and Ray's
    router with no ids (each where both arms ran)."""
    same = ROUTER_ONLY
    if "affinity" in rows and same in rows:
        a, m = rows["affinity"], rows[same]
        print(
            f"affinity against {same} (router only, same engine; not judged): slot loads "
            f"{a['activations'] / max(1, m['activations']):.2f}x, disk loads "
            f"{a['disk'] / max(1, m['disk']):.2f}x, p99 {a['p99_ms'] / m['p99_ms']:.2f}x"
        )
    if "affinity" in rows and "affinity_moves" in rows:
        a, m = rows["affinity_moves"], rows["affinity"]
        print(
            f"affinity_moves against affinity (what the moves change; not judged): slot "
            f"loads {a['activations'] / max(1, m['activations']):.2f}x, disk loads "
            f"{a['disk'] / max(1, m['disk']):.2f}x, p50 {a['p50_ms'] / m['p50_ms']:.2f}x, "
            f"p99 {a['p99_ms'] / m['p99_ms']:.2f}x"
        )
    if "affinity" in rows and "pow2_no_multiplex" in rows:
        ratio = rows["pow2_no_multiplex"]["loads"] / max(1, rows["affinity"]["loads"])
        print(f"pow2_no_multiplex / affinity adapter loads: {ratio:.1f}x (not the peer)")
