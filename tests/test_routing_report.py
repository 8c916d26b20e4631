"""benchmarks/routing_report.py: the routing benchmark's medians, its bar for affinity against
Ray's multiplexed routing, and the report it prints, on hand-made run records."""

import pytest

from benchmarks.routing_report import PEER, ROUTER_ONLY, judge, medians, pooled_p99_ms, report

pytestmark = pytest.mark.timeout(60)


def _run(policy: str, run: int, slots: int, disk: int, p99: float, **extra) -> dict:
    lat = extra.pop("latency_ms", {0: p99})
    return {
        "policy": policy,
        "run": run,
        "ok": extra.pop("ok", 10),
        "errors": extra.pop("errors", []),
        "activations": slots,
        "disk": disk,
        "shared": 0,
        "loads": slots + disk,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "latency_ms": lat,
        **extra,
    }


def test_medians_are_per_policy_over_runs_in_first_run_order():
    runs = [
        _run(PEER, 0, 10, 4, 80.0),
        _run("affinity", 0, 7, 3, 60.0, ok=9),
        _run("affinity", 1, 9, 5, 70.0),
        _run(PEER, 1, 12, 6, 100.0),
    ]
    rows = medians(runs)
    assert [r["policy"] for r in rows] == [PEER, "affinity"]
    peer, ours = rows
    assert (peer["activations"], peer["disk"], peer["p99_ms"]) == (11, 5, 90.0)  # even: mean of two
    assert (ours["activations"], ours["loads"], ours["ok"]) == (8, 12, 9)  # ok: the worst run


def _rows(ours: dict, peer: dict) -> dict[str, dict]:
    return {r["policy"]: r for r in medians([ours, peer])}


def test_judge_needs_strictly_fewer_loads_and_p99_within_the_tolerance():
    met = judge(_rows(_run("affinity", 0, 7, 3, 110.0), _run(PEER, 0, 8, 4, 100.0)), 2, 0.1)
    assert [ok for _, ok in met] == [True, True, True]  # p99 1.10x: on the line, met
    assert "0.88x" in met[0][0] and "0.75x" in met[1][0] and "1.10x" in met[2][0]
    missed = judge(_rows(_run("affinity", 0, 8, 5, 111.0), _run(PEER, 0, 8, 4, 100.0)), 2, 0.1)
    assert [ok for _, ok in missed] == [False, False, False]  # equal slot loads are not fewer


def test_judge_disk_loads_at_the_minimum_on_both_sides_are_met():
    # 3 adapters in the trace: each must be read once, so 3 against 3 is the best there is
    rows = _rows(_run("affinity", 0, 7, 3, 50.0), _run(PEER, 0, 9, 3, 60.0))
    what, ok = judge(rows, 3, 0.1)[1]
    assert ok and "both at the minimum, 3" in what
    what, ok = judge(_rows(_run("affinity", 0, 7, 4, 50.0), _run(PEER, 0, 9, 3, 60.0)), 3, 0.1)[1]
    assert not ok and "minimum" not in what


def test_pooled_p99_takes_every_request_of_every_run():
    # 200 latencies 1..200 over two runs: index int(0.99 * 200) = 198 of them sorted
    runs = [
        _run(PEER, 0, 1, 1, 0.0, latency_ms={i: float(i + 1) for i in range(100)}),
        _run(PEER, 1, 1, 1, 0.0, latency_ms={i: float(i + 101) for i in range(100)}),
    ]
    assert pooled_p99_ms(runs) == 199.0


def test_report_prints_each_run_the_medians_and_the_bar(capsys):
    results = [
        _run("affinity", 0, 7, 3, 50.0),
        _run(PEER, 0, 9, 5, 60.0),
        _run(ROUTER_ONLY, 0, 8, 4, 55.0),
        _run(ROUTER_ONLY, 1, 8, 4, 55.0),
        _run(PEER, 1, 9, 5, 60.0, errors=["ad01: RuntimeError('boom')"]),
        _run("affinity", 1, 11, 3, 80.0),
    ]
    missed = report(results, num_requests=10, min_disk=2, p99_tolerance=0.1)
    out = capsys.readouterr().out
    assert "run 1:" in out and "run 2:" in out and "median of 2 runs:" in out
    assert f"{PEER} error: ad01: RuntimeError('boom')" in out
    # medians: affinity 9 slot loads, 3 disk, p99 65 ms against 9, 5, 60: slot loads not fewer
    assert missed
    assert "NOT MET slot loads 9 vs 9 (1.00x), fewer" in out
    assert "met     disk loads 3 vs 5 (0.60x), fewer" in out
    assert "met     p99 65 ms vs 60 ms (1.08x), <= 1.1x" in out
    assert "p99 per run, affinity/ray_multiplex: 50/60, 80/60" in out
    assert f"affinity against {ROUTER_ONLY} (router only, same engine; not judged)" in out


def test_report_of_one_run_without_the_peer_judges_nothing(capsys):
    missed = report([_run("affinity", 0, 7, 3, 50.0)], num_requests=10, min_disk=2, p99_tolerance=0)
    out = capsys.readouterr().out
    assert not missed
    assert "run 1:" in out and "median of" not in out and "the issue's bar" not in out
