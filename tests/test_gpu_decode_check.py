"""benchmarks/gpu_decode_check.py: its --dry-run end to end on the CPU (Triton interpreter, tiny
shapes, EagerGraph for the CUDA graphs), so the one GPU run does not fail on trivia; and its
checks fail when what they check is wrong (a kernel or metadata baked at capture time, a failed
check or a part over its time limit in the exit status)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_decode_check, gpu_decode_kernels
from raylora_kernels import lora_expand_ref, lora_shrink_ref
from raylora_kernels.metadata import StaticLoRAMeta
from raylora_kernels.paged_attention_ref import paged_decode_attention_ref

pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_decode_check.py", "--dry-run", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "gpu_decode_check summary" in proc.stdout
    data = json.loads(out.read_text())
    parts = data["parts"]
    assert {k: p["status"] for k, p in parts.items()} == dict.fromkeys(gpu_decode_check.PARTS, "ok")
    checks = {name: c for p in parts.values() for name, c in p.get("checks", {}).items()}
    assert checks and all(c["ok"] for c in checks.values()), checks
    # kernels: attention (both split paths) and two LoRA layers, each replayed under new inputs
    assert len(parts["kernels"]["checks"]) == 3
    attention = next(c for n, c in checks.items() if n.startswith("paged attention"))
    assert attention["num_splits"] == [1, 2] and attention["replays"] == 4
    # replay: eight batches of their own through the graphs, each against the eager step
    replay = parts["replay"]["checks"]
    assert len(replay) == 9 and replay["every replay case ran its graph"]["replays"] == 8
    smol = parts["smollm2"]
    assert smol["base"]["step_ms"] > 0 and smol["lora"]["bare_graph_forward_ms"] > 0
    # the independent reference: fp32 greedy tokens of the engine equal HF generate's
    assert smol["hf"]["identical"] >= smol["hf"]["requests"] - 1
    assert smol["peft"]["engine_tok_s"] > 0 and smol["peft"]["peft_tok_s"] > 0
    llama = parts["llama"]
    assert llama["num_graphs"] == 6 and llama["num_kv_blocks"] > 0
    grid = llama["grid"]
    assert [(r["batch"], r["context"], r["lora"]) for r in grid] == [
        (b, c, lora) for lora in (False, True) for c in (8, 24) for b in (1, 4)
    ]
    assert all(r["tok_s"] > 0 and r["gb_per_step"] > 0 for r in grid)
    # KV bytes grow with batch x context: the figure is computed, not a constant
    assert grid[3]["gb_per_step"] > grid[0]["gb_per_step"]
    assert parts["profile"]["top"] and parts["profile"]["source"] == "graph replay"
    assert len(data["targets"]) == 6
    assert all(isinstance(t["met"], bool) for t in data["targets"].values())


def _ref_attention(q, k, v, tables, lens, block_size, scale, out=None, num_splits=1):
    ref = paged_decode_attention_ref(q, k, v, tables, lens, block_size, scale)
    return out.copy_(ref.to(out.dtype))


ATTENTION = (4, 2, 16, torch.float32, ((1, 5, 33), (33, 0, 8), (2, 1, 17)), 4, CPU)


def test_attention_check_catches_contexts_baked_at_capture(monkeypatch):
    monkeypatch.setattr(gpu_decode_kernels, "paged_decode_attention", _ref_attention)
    ok, detail = gpu_decode_kernels.check_attention(*ATTENTION)
    assert ok and detail["max_rel_err"] == 0.0
    baked: dict[int, torch.Tensor] = {}

    def baked_kernel(q, k, v, tables, lens, block_size, scale, out=None, num_splits=1):
        # the lengths as seen at capture: what a graph replays if the launch took host values
        lens = baked.setdefault(num_splits, lens.clone())
        return _ref_attention(q, k, v, tables, lens, block_size, scale, out)

    monkeypatch.setattr(gpu_decode_kernels, "paged_decode_attention", baked_kernel)
    ok, detail = gpu_decode_kernels.check_attention(*ATTENTION)
    assert not ok and detail["max_rel_err"] > 0.1


def test_static_lora_check_catches_a_meta_frozen_at_capture(monkeypatch):
    def shrink(x, lora_a, meta, out, backend):
        return out.copy_(lora_shrink_ref(x, lora_a, meta.token_slots))

    def expand(buf, lora_b, meta, y, backend):
        y.copy_(lora_expand_ref(buf, lora_b, meta.token_slots, y))

    monkeypatch.setattr(gpu_decode_kernels, "lora_shrink", shrink)
    monkeypatch.setattr(gpu_decode_kernels, "lora_expand", expand)
    args = (48, (96, 32), torch.float32, 8, 3, 4, CPU)
    ok, detail = gpu_decode_kernels.check_static_lora(*args)
    assert ok and detail["base_only_untouched"]
    update, calls = StaticLoRAMeta.update_, []

    def frozen(self, token_slots):  # regroups at capture only: every replay sees that mix
        calls.append(1)
        return update(self, token_slots) if len(calls) == 1 else self

    monkeypatch.setattr(StaticLoRAMeta, "update_", frozen)
    ok, detail = gpu_decode_kernels.check_static_lora(*args)
    assert not ok and len(calls) > 2


def test_exit_status_reports_failed_checks_and_time_limits(tmp_path, monkeypatch):
    out = tmp_path / "report.json"
    argv = ["--dry-run", "--parts", "kernels", "--json", str(out)]
    monkeypatch.setattr(gpu_decode_kernels, "check_static_lora", lambda *a: (True, {}))
    monkeypatch.setattr(gpu_decode_kernels, "check_attention", lambda *a: (True, {"err": 0.0}))
    assert gpu_decode_check.main(argv) == 0
    monkeypatch.setattr(gpu_decode_kernels, "check_attention", lambda *a: (False, {"err": 1.0}))
    assert gpu_decode_check.main(argv) == 1
    kernels = json.loads(out.read_text())["parts"]["kernels"]
    assert kernels["status"] == "ok" and not all(c["ok"] for c in kernels["checks"].values())

    def forever(part, ctx):
        part["figure"] = 1.5
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(gpu_decode_kernels, "part_kernels", forever)
    t0 = time.perf_counter()
    assert gpu_decode_check.main([*argv, "--limit-scale", "0.005"]) == 1  # 60 s -> 0.3 s
    assert time.perf_counter() - t0 < 30
    kernels = json.loads(out.read_text())["parts"]["kernels"]
    assert kernels["status"] == "timeout" and kernels["figure"] == 1.5
