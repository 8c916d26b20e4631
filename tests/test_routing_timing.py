"""benchmarks/routing_timing.py: reading a routing benchmark's --latencies-out file."""

import json

import pytest

pytestmark = pytest.mark.timeout(120)


def _timing(first: float, total: float, rest: float = 10.0) -> dict:
    return {
        "total": total,
        "replica": "r",
        "inflight": 0,
        "phases": {"first_token": first, "rest": rest},
    }


def _record() -> dict:
    # "b" is asked 3 times, "a" and "c" once each: groups of 1 then the rest are {b}, {a, c}
    trace = [[0.0, "a"], [0.1, "b"], [0.2, "b"], [0.3, "c"], [0.4, "b"]]
    fast = {str(i): _timing(1.0 + i, 10.0 + i) for i in range(5)}
    slow = {str(i): _timing(2.0 * (1 + i), 20.0 + i, rest=14.0) for i in range(5)}
    return {
        "trace": trace,
        "runs": [
            {"policy": "x", "run": 0, "latency_ms": {}, "timings": fast},
            {"policy": "y", "run": 0, "latency_ms": {}, "timings": slow},
            {"policy": "y", "run": 1, "latency_ms": {}, "timings": fast},
        ],
    }


def test_groups_by_the_traces_own_counts():
    from benchmarks.routing_timing import popularity_groups

    record = _record()
    assert popularity_groups(record["trace"], (1,)) == [{"b"}, {"a", "c"}]
    assert popularity_groups(record["trace"], (1, 5)) == [{"b"}, {"a", "c"}]  # no empty rest
    assert popularity_groups(record["trace"], (2,)) == [{"b", "a"}, {"c"}]  # name among equals


def test_percentiles_pool_every_run_of_an_arm(tmp_path, capsys):
    from benchmarks.routing_timing import by_popularity, decode_alone, decode_by_run, main

    record = _record()
    rows = by_popularity(record, (1,))
    # x, group {b}: requests 1, 2, 4 -> first tokens 2, 3, 5; p50 is the middle one, p99 the last
    assert rows["x"] == [(1, 3, 3.0, 5.0, 14.0), (2, 2, 4.0, 4.0, 13.0)]
    # y pools its two runs: {b} first tokens 4, 6, 10 (slow run) and 2, 3, 5 (fast run);
    # sorted 2 3 4 5 6 10, p50 at index int(0.5 * 6) = 3
    n, ft50, ft99 = rows["y"][0][1:4]
    assert (n, ft50, ft99) == (6, 5.0, 10.0)
    assert decode_by_run(record) == [(0, "x", 10.0), (0, "y", 14.0), (1, "y", 10.0)]
    # arrivals 100 ms apart: the fast run's requests (10-14 ms) never overlap, the slow
    # run's neither (20-24 ms)
    assert decode_alone(record) == [(0, "x", 10.0, 5), (0, "y", 14.0, 5), (1, "y", 10.0, 5)]
    record["runs"][1]["cpu_s"] = {"replicas": 12.34, "driver": 2.0}  # one run has CPU figures
    record["runs"][1]["thread_cpu_s"] = {f"t{i}": float(i) for i in range(10)}  # 8 busiest
    record["runs"][1]["batches"] = {"steps": 4, "seqs": 10, "adapters": 6, "tokens": 50}
    path = tmp_path / "lat.json"
    path.write_text(json.dumps(record))
    main([str(path)])
    out = capsys.readouterr().out
    assert "x: mean ms, all runs: first_token 3.00 rest 10.00" in out
    assert "y: mean ms, all runs: first_token 4.50 rest 12.00" in out  # (6 + 3) / 2, (14 + 10) / 2
    assert "0:y 14.0, 1:y 10.0" in out
    assert "nothing else in flight (the machine's speed): 0:x 10.0 (5)" in out
    threads = "the replicas' threads: t2 2.0, t3 3.0, t4 4.0, t5 5.0, t6 6.0, t7 7.0, t8 8.0, t9"
    batches = "4 steps: 2.50 sequences, 1.50 adapters, 12.5 tokens, 0.0 ms a step"
    assert (
        f"run 0:y: CPU s during the replay: driver 2.0, replicas 12.3; {threads} 9.0; {batches}\n"
        in out
    )
    assert "run 0:x:" not in out and "run 1:y:" not in out


def test_decode_alone_leaves_out_overlapping_requests():
    from benchmarks.routing_timing import decode_alone

    # 0 runs 0-50 ms and overlaps 1 (20-30 ms); 2 (100-105) and 3 (200-230) are alone
    trace = [[0.0, "a"], [0.02, "a"], [0.1, "b"], [0.2, "c"]]
    timings = {
        "0": {"total": 50.0, "phases": {"rest": 40.0}},
        "1": {"total": 10.0, "phases": {"rest": 8.0}},
        "2": {"total": 5.0, "phases": {"rest": 4.0}},
        "3": {"total": 30.0, "phases": {"rest": 20.0}},
    }
    record = {"trace": trace, "runs": [{"policy": "x", "run": 0, "timings": timings}]}
    assert decode_alone(record) == [(0, "x", 12.0, 2)]


def test_cpu_by_role_counts_a_titled_process_and_this_one():
    """A process whose command line holds a role's text is counted under that role; this
    process is the driver; the difference of two calls is the CPU used in between."""
    import os
    import subprocess
    import sys
    import time

    from benchmarks.routing_cpu import CPU_ROLES, cpu_by_role, cpu_used

    # a marker no other process has (a real Ray actor elsewhere on the machine would blur
    # the real roles); the default roles are Ray's titles
    roles = ((f"cpu-role-test-{os.getpid()}", "marked"), *CPU_ROLES)
    assert ("ServeReplica", "replicas") in CPU_ROLES
    spin = "import time\ntime.sleep(0.5)\nt = time.process_time()\n"
    spin += "while time.process_time() - t < 0.6: pass\ntime.sleep(30)\n"
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "x"])
    busy = subprocess.Popen([sys.executable, "-c", spin, roles[0][0]])
    try:
        before = cpu_by_role(roles)  # the marked child spins from 0.5 s after its start
        t = time.process_time()
        while time.process_time() - t < 0.3:  # the driver's share
            pass
        time.sleep(2.5)  # the marked child's 0.6 s of CPU is done by then
        used = cpu_used(before, cpu_by_role(roles))
    finally:
        idle.kill()
        busy.kill()
    assert used["driver"] >= 0.25
    assert 0.55 <= used["marked"] <= 0.8  # its spin, and no more than its start-up besides
    assert set(used) >= {"driver", "marked", "other"}
    assert all(v >= 0 for v in used.values())


def test_thread_cpu_names_a_python_thread_and_sums_replicas():
    """A Python thread's CPU is counted under its name less the trailing number, as its own
    clock (time.thread_time) counts it; growth sums the differences
    over replicas (a replica not read before counts from 0)."""
    import threading
    import time

    from benchmarks.routing_cpu import growth, thread_cpu

    spun, go, stop = {}, threading.Event(), threading.Event()

    def spin() -> None:
        go.wait()
        t = time.thread_time()
        while time.thread_time() - t < 0.4:
            pass
        spun["s"] = time.thread_time()
        stop.wait()

    thread = threading.Thread(target=spin, name="spinner_12")
    thread.start()
    try:
        before = thread_cpu()
        go.set()
        while "s" not in spun:
            time.sleep(0.01)
        after = thread_cpu()
    finally:
        stop.set()
        thread.join()
    assert "spinner" in after and "spinner_12" not in after
    assert abs(after["spinner"] - spun["s"]) <= 0.05  # clock ticks: 10 ms each
    assert after["spinner"] - before.get("spinner", 0.0) >= 0.35
    assert "MainThread" in after
    stats = {"r1": {"thread_cpu": {"a": 1.0, "b": 2.0}}, "r2": {"thread_cpu": {"a": 0.5}}}
    later = {"r1": {"thread_cpu": {"a": 1.5, "b": 2.0}}, "r2": {"thread_cpu": {"a": 1.0}}}
    assert growth(stats, later, "thread_cpu") == {"a": 1.0, "b": 0.0}
    steps = {"steps": {"steps": 5, "seqs": 9}}
    later = {"r1": {"steps": {"steps": 8, "seqs": 20}}, "r2": {"steps": {"steps": 2, "seqs": 3}}}
    assert growth({"r1": steps}, later, "steps") == {"steps": 5, "seqs": 14}  # r2: from 0


def test_residency_rows_pool_runs_and_skip_files_without_it(tmp_path, capsys):
    from benchmarks.routing_timing import by_residency, main

    record = _record()
    assert by_residency(record) == {"x": [], "y": []}  # a file from before `held`
    places = ["none", "slot", "slot", "none", "cpu"]
    for run in record["runs"]:
        for i, t in run["timings"].items():
            t["held"] = places[int(i)]
    rows = by_residency(record)
    # x: slot = requests 1, 2 (first tokens 2, 3; totals 11, 12), cpu = 4, none = 0, 3
    assert rows["x"] == [("slot", 2, 3.0, 3.0, 12.0), ("cpu", 1, 5.0, 5.0, 14.0),
                         ("none", 2, 4.0, 4.0, 13.0)]  # fmt: skip
    # y pools both runs: none = first tokens 2, 8 (slow run) and 1, 4 (fast run)
    assert rows["y"][2] == ("none", 4, 4.0, 8.0, 23.0)
    path = tmp_path / "lat.json"
    path.write_text(json.dumps(record))
    main([str(path)])
    out = capsys.readouterr().out
    assert "  cpu       1 requests: first token p50   5.0 p99   5.0 ms; latency p99  14.0" in out
