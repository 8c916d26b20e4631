"""Smoke run of benchmarks/engine_throughput.py, lora_overhead.py and cpu_lora_step.py on the tiny
model with tiny sizes: the scripts run end to end and print sane figures (not the targets;
those need the default model, see docs/benchmarks.md)."""

import pytest

from benchmarks import cpu_lora_step, engine_throughput, lora_overhead

pytest.importorskip("peft")

TINY = ["--prompt-len", "4", "24", "--output-len", "2", "8", "--seed", "0", "--threads", "1"]


def test_engine_throughput_smoke(tiny_model_dir, capsys):
    r = engine_throughput.main(
        [
            "--model",
            tiny_model_dir,
            "--num-requests",
            "6",
            "--hf-batch",
            "3",
            "--overhead-steps",
            "3",
            *TINY,
        ]
    )
    assert r["engine_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["throughput_ratio"] > 0
    assert r["step_ms"] > 0 and r["forward_ms"] > 0
    # Independent check of the workload: greedy fp32 on a tiny model agrees with HF.
    assert r["identical"] >= 5
    out = capsys.readouterr().out
    assert "ratio raylora / HF" in out and "overhead step / forward" in out


def test_lora_overhead_smoke(tiny_model_dir, tmp_path, capsys):
    r = lora_overhead.main(
        [
            "--model",
            tiny_model_dir,
            "--num-adapters",
            "3",
            "--rank",
            "4",
            "--batch",
            "6",
            "--steps",
            "3",
            "--rounds",
            "2",
            "--num-requests",
            "6",
            "--hf-batch",
            "3",
            "--adapter-dir",
            str(tmp_path),
            *TINY,
        ]
    )
    assert r["base_step_ms"] > 0 and r["lora_step_ms"] > 0 and r["mixed_ratio"] > 0
    # raylora's mixed-adapter batch against PEFT's: the same greedy tokens (fp32, tiny model).
    assert r["identical"] >= 5
    assert len(list(tmp_path.glob("bench-lora-*/adapter_model.safetensors"))) == 3
    out = capsys.readouterr().out
    assert "ratio raylora / HF PEFT" in out
    # on the CPU, (a) also times an engine with bf16 slots (lora_dtype), beside the same base
    assert "ratio LoRA, lora_dtype auto / base (engine step)" in out
    assert "ratio LoRA, lora_dtype bfloat16 / base (engine step)" in out
    assert r["step_ratio"] > 0 and r["step_ratio_bfloat16"] > 0


def test_cpu_lora_step_smoke(tiny_model_dir, capsys):
    r = cpu_lora_step.main(
        ["--model", tiny_model_dir, "--num-adapters", "3", "--rank", "4", "--repeats", "2"]
    )
    assert r["sum"] > 0 and r["kernel"] > 0 and r["torch"] > 0
    assert "kernel / sum" in capsys.readouterr().out
