"""benchmarks/routing.py --smoke: the four arms (affinity on raylora's engine, Ray's
multiplexed-id routing on vLLM's adapter-cache behaviour and on raylora's, Ray's router without
ids) on a real local Serve deployment, every request completes (the bar against ray_multiplex
is judged by the full benchmark, not on 60 requests)."""

import json
import subprocess
import sys
from collections import Counter

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
            "--latencies-out",
            str(tmp_path / "lat.json"),
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
    # each request's adapter residency at arrival (benchmarks/routing_timing.py): every arm
    # starts with nothing held, so it has misses, and its repeats find a slot
    record = json.loads((tmp_path / "lat.json").read_text())
    for run in record["runs"]:
        held = Counter(t["held"] for t in run["timings"].values())
        assert set(held) <= {"slot", "cpu", "none", "base"}, held
        assert held["none"] and held["slot"], (run["policy"], held)
        # its loads, for benchmarks/routing_pairs.py (a miss needs a slot activation)
        assert run["activations"] > 0 and run["disk"] >= 0, run["policy"]
    from benchmarks import routing_pairs

    assert routing_pairs.main([str(tmp_path / "lat.json")]) == 0  # one pair: not settled


@pytest.mark.timeout(120)
def test_assets_for_another_model_and_adapter_size(tmp_path):
    """`--model` with a folder and another rank and targets: the adapters are built for that
    model, with that rank and those modules, in their own folder; built once."""
    import json
    from pathlib import Path

    from benchmarks.routing_arms import build_assets
    from tests.model_fixtures import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "other-llama")
    model, adapters = build_assets(tmp_path, 2, str(folder), 2, ("q_proj", "down_proj"))
    assert model == str(folder) and sorted(adapters) == ["ad00", "ad01"]
    for path in adapters.values():
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        assert config["r"] == 2 and set(config["target_modules"]) == {"q_proj", "down_proj"}
        assert "adapters-other-llama-r2-q_proj+down_proj" in path
    stamp = (Path(adapters["ad00"]) / "adapter_config.json").stat().st_mtime_ns
    assert build_assets(tmp_path, 2, str(folder), 2, ("q_proj", "down_proj"))[1] == adapters
    assert (Path(adapters["ad00"]) / "adapter_config.json").stat().st_mtime_ns == stamp
    # the tiny model's rank-4 q/v adapters stay where earlier runs built them
    tiny, default = build_assets(tmp_path, 1)
    assert tiny == str(tmp_path / "tiny-llama") and default["ad00"] == str(
        tmp_path / "adapters" / "ad00"
    )
