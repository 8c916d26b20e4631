"""The soak benchmark's short version (benchmarks/soak.py): the tiny model on 2 replicas,
200 requests over 8 adapters, half streaming, while adapters are swapped, clients hang up,
a replica and the registry are killed. It must pass its own verdict: no non-streaming
request lost, no 5xx outside the kill windows, every stream ended with [DONE] or an error
event, replica recovery < 30 s, registry recovery < 5 s, no adapter resurrected or lost."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_soak_short(tiny_model_dir, tmp_path):
    from benchmarks import soak

    rep = soak.main(
        [
            "--model",
            tiny_model_dir,
            "--requests",
            "200",
            "--adapters",
            "8",
            "--churn",
            "2",
            "--concurrency",
            "16",
            "--disconnect-share",
            "0.2",
            "--adapter-dir",
            str(tmp_path / "adapters"),
            "--json",
            str(tmp_path / "soak.json"),
        ]
    )
    assert not rep["failures"], rep
    assert rep["requests"] == 200
    assert rep["completed"] >= 150, rep
    assert rep["streams"]["disconnected"] > 0  # the hang-ups happened
    kinds = [f["kind"] for f in rep["faults"]]
    assert kinds.count("churn") == 2 and "replica" in kinds and "registry" in kinds
