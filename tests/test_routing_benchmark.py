"""benchmarks/routing.py --smoke: the four arms (affinity on raylora's engine, Ray's
multiplexed-id routing on vLLM's adapter-cache behaviour and on raylora's, Ray's router without
ids) on a real local Serve deployment, every request completes (the bar against ray_multiplex
is judged by the full benchmark, not on 60 requests)."""

import subprocess
import sys

import pytest

from tests.serve_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ARMS = ["affinity", "ray_multiplex", "ray_multiplex_raylora_engine", "pow2_no_multiplex"]


def test_routing_benchmark_smoke(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "routing.py"),
            "--smoke",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=260,
        cwd=REPO,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "all requests completed" in out
    rows = [line.split() for line in out.splitlines()]
    rows = [r for r in rows if r and r[0] in ARMS and r[1].isdigit()]
    assert [r[0] for r in rows] == ARMS
    assert all(int(r[1]) == 60 for r in rows)  # ok column: every request of the trace
    assert "affinity against ray_multiplex" in out
    verdicts = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    verdicts = [v for v in verdicts if v in ("met", "NOT")]
    assert len(verdicts) == 3, out[-2000:]  # one per criterion: slot loads, disk loads, p99
