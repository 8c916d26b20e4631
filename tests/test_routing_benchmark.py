"""benchmarks/routing.py --smoke: both routers on a real local Serve deployment, every
request completes (the >= 3x load ratio is checked by the full benchmark, not here)."""

import subprocess
import sys

import pytest

from tests.serve_fixtures import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


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
        timeout=200,
        cwd=REPO,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "all requests completed" in out
    rows = [line.split() for line in out.splitlines()]
    rows = [r for r in rows if r and r[0] in ("affinity", "pow2") and r[1].isdigit()]
    assert [r[0] for r in rows] == ["affinity", "pow2"]
    assert all(int(r[1]) == 60 for r in rows)  # ok column: every request of the trace
    assert "pow2 / affinity adapter loads" in out
