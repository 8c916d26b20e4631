"""The vLLM peer of the engine benchmarks (benchmarks/peers/): the launcher's workload and
result files, its errors and timeout, raylora's runner in its own process against HF's greedy
decoding, and (only where `make peer-vllm` built .venv-vllm; skipped elsewhere, CI included)
vLLM CPU's greedy ids on the same tiny model against raylora's and HF's."""

import json
import time
from pathlib import Path

import pytest

from benchmarks.peers import vllm_peer
from benchmarks.peers.vllm_peer import (
    PeerError,
    PeerResult,
    PeerWorkload,
    read_result,
    read_workload,
    run_peer,
    vllm_cpu_env,
    vllm_python,
    write_result,
    write_workload,
)

# vLLM's CPU attention takes head sizes 32, 64, 80, ... (the usual tiny model's is 16)
TINY_VLLM = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4)
PROMPTS = [[5, 17, 40, 3, 99, 12, 7, 250], [8] * 3 + [60, 61, 62], [300, 4, 4, 9, 11], [42] * 12]
OUTPUT_LENS = [7, 5, 9, 6]


def _result(**overrides) -> PeerResult:
    base = dict(
        engine="raylora",
        version="x",
        startup_s=1.0,
        memory_mb={"rss_mb": 10.0, "rss_tree_mb": 10.0, "pss_tree_mb": 9.0, "num_processes": 1},
        warmup_s=0.1,
        generate_s=0.5,
        num_tokens=5,
        token_ids=[[1, 2], [3, 4, 5]],
        settings={},
    )
    return PeerResult(**{**base, **overrides})


@pytest.fixture(scope="module")
def vllm_tiny_model(tmp_path_factory) -> str:
    from tests.model_fixtures import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-vllm"), **TINY_VLLM))


@pytest.fixture(scope="module")
def workload(vllm_tiny_model, tmp_path_factory) -> Path:
    work = PeerWorkload(
        model=vllm_tiny_model,
        prompts=PROMPTS,
        output_lens=OUTPUT_LENS,
        warmup_prompts=[[5, 6, 7, 8]],
        warmup_output_lens=[2],
        max_num_seqs=8,
        enforce_eager=True,
    )
    return write_workload(work, tmp_path_factory.mktemp("peer") / "workload.json")


@pytest.fixture(scope="module")
def raylora_result(workload, tmp_path_factory) -> PeerResult:
    out = tmp_path_factory.mktemp("peer-raylora") / "raylora.json"
    return run_peer("raylora", workload, out, timeout_s=240)


@pytest.mark.timeout(30)
def test_workload_file_round_trip(tmp_path):
    lora = {"name": "a", "path": "/x/a"}
    work = PeerWorkload(
        model="/m",
        prompts=[[1, 2], [3]],
        output_lens=[4, 5],
        loras=[lora, None],
        warmup_prompts=[[9]],
        warmup_output_lens=[1],
        warmup_loras=[{"name": "b", "path": "/x/b"}],
        max_loras=2,
    )
    path = write_workload(work, tmp_path / "w.json")
    assert json.loads(path.read_text())["loras"] == [lora, None]
    assert read_workload(path) == work
    assert work.adapters == {"b": "/x/b", "a": "/x/a"}  # warm-up first, each once
    with pytest.raises(ValueError, match="output_lens"):
        PeerWorkload(model="/m", prompts=[[1]], output_lens=[1, 2])
    with pytest.raises(ValueError, match="loras"):
        PeerWorkload(model="/m", prompts=[[1]], output_lens=[1], loras=[None, None])


@pytest.mark.timeout(30)
def test_result_parsing(tmp_path):
    good = tmp_path / "good.json"
    write_result(_result(), good)
    r = read_result(good)
    assert r == _result() and r.tok_per_s == pytest.approx(10.0)
    bad = tmp_path / "bad.json"
    raw = json.loads(good.read_text())
    del raw["startup_s"]
    bad.write_text(json.dumps(raw))
    with pytest.raises(PeerError, match="lacks startup_s"):
        read_result(bad)
    write_result(_result(num_tokens=4), bad)  # not the sum of the ids' lengths
    with pytest.raises(PeerError, match="inconsistent"):
        read_result(bad)
    write_result(_result(token_ids=[[1, "2"]], num_tokens=2), bad)
    with pytest.raises(PeerError, match="lists of ints"):
        read_result(bad)
    bad.write_text("{not json")
    with pytest.raises(PeerError, match="unreadable"):
        read_result(bad)
    with pytest.raises(PeerError, match="unreadable"):
        read_result(tmp_path / "absent.json")


@pytest.mark.timeout(30)
def test_missing_vllm_venv_names_make_target(tmp_path):
    with pytest.raises(PeerError, match="make peer-vllm"):
        vllm_python(tmp_path / "no-venv")
    with pytest.raises(PeerError, match="make peer-vllm"):
        run_peer("vllm", tmp_path / "w.json", tmp_path / "o.json", 10, venv=tmp_path / "no")
    with pytest.raises(ValueError, match="unknown peer"):
        run_peer("sglang", tmp_path / "w.json", tmp_path / "o.json", 10)


@pytest.mark.timeout(30)
def test_vllm_cpu_env(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tmp_path / "libtcmalloc_minimal.so.4")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = vllm_cpu_env(venv, kvcache_gib=2, threads_bind="0-1")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")  # tcmalloc absent: left out
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    preload = vllm_cpu_env(venv)["LD_PRELOAD"].split(":")
    assert preload == [
        str(tmp_path / "libtcmalloc_minimal.so.4"),
        str(venv / "lib" / "libiomp5.so"),
        "/other.so",
    ]
    # "all" (the default): every core this process may use, as vLLM's cpu-list syntax
    monkeypatch.setattr(vllm_peer.os, "sched_getaffinity", lambda pid: {8, 0, 1, 2, 5, 7})
    assert vllm_peer.all_cpus() == "0-2,5,7-8"
    assert vllm_cpu_env(venv)["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5,7-8"
    assert vllm_cpu_env(venv)["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.timeout(60)
def test_run_peer_timeout_kills_the_process_group(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('hanging', flush=True)\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setitem(vllm_peer.SCRIPTS, "raylora", str(script))  # absolute: used as is
    with pytest.raises(PeerError, match="timed out after 3 s") as err:
        run_peer("raylora", tmp_path / "w.json", tmp_path / "o.json", timeout_s=3)
    assert "hanging" in str(err.value)  # the log's tail
    grandchild = int(pid_file.read_text())
    stat = Path(f"/proc/{grandchild}/stat")

    def gone() -> bool:  # exited, or a zombie waiting for init
        try:
            return stat.read_text().split(") ")[1].startswith("Z")
        except (FileNotFoundError, ProcessLookupError):
            return True

    # SIGKILL to the group is sent when run_peer returns; the grandchild's exit follows it
    # (on a loaded machine, not always before the next line): wait for it, a few seconds
    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


@pytest.mark.timeout(60)
def test_run_peer_failure_shows_the_log(tmp_path, monkeypatch):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('bad workload', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setitem(vllm_peer.SCRIPTS, "raylora", str(script))
    with pytest.raises(PeerError, match=r"exited with 3(.|\n)*bad workload"):
        run_peer("raylora", tmp_path / "w.json", tmp_path / "o.json", timeout_s=30)


def _hf_reference(model_dir: str) -> list[list[int]]:
    from benchmarks.common import load_hf_model
    from tests.reference import hf_greedy_no_eos

    hf = load_hf_model(model_dir)
    return [hf_greedy_no_eos(hf, p, n) for p, n in zip(PROMPTS, OUTPUT_LENS, strict=True)]


@pytest.mark.timeout(300)
def test_raylora_peer_process_matches_hf(raylora_result, vllm_tiny_model):
    r = raylora_result
    assert r.engine == "raylora" and r.num_tokens == sum(OUTPUT_LENS)
    assert [len(t) for t in r.token_ids] == OUTPUT_LENS
    assert r.startup_s > 0 and r.generate_s > 0 and r.warmup_s > 0
    assert r.memory_mb["rss_mb"] > 50 and r.memory_mb["num_processes"] >= 1
    assert r.token_ids == _hf_reference(vllm_tiny_model)  # wide logits: no near-ties


@pytest.mark.skipif(
    not (vllm_peer.VENV_VLLM / "bin" / "python").exists(),
    reason=f"{vllm_peer.VENV_VLLM} is missing (`make peer-vllm` builds it)",
)
@pytest.mark.timeout(900)
def test_vllm_peer_matches_raylora(workload, raylora_result, vllm_tiny_model, tmp_path):
    env = vllm_cpu_env(kvcache_gib=1)
    r = run_peer("vllm", workload, tmp_path / "vllm.json", timeout_s=840, env=env)
    assert r.engine == "vllm" and r.version.startswith("0.32")
    assert [len(t) for t in r.token_ids] == OUTPUT_LENS
    assert r.startup_s > 0 and r.memory_mb["num_processes"] >= 2  # engine core, worker
    assert r.token_ids == raylora_result.token_ids
    assert r.token_ids == _hf_reference(vllm_tiny_model)
    assert "libiomp5" in r.settings["LD_PRELOAD"]  # vLLM's settings reached the process
