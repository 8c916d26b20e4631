"""An adapter's identity (the sha256 of its weights, which keys its prefix-cache blocks) is
remembered per folder while the folder's files keep their stamp (engine/lora/adapter.py
source_stamp): a reread after a CPU-cache eviction skips the hash; a file written since, even
in place and at the same size, gets the hash of its new weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import engine.lora.adapter as adapter_module
import engine.lora.manager as manager_module
from engine import EngineConfig, LLMEngine, LoRARequest
from engine.lora.manager import adapter_identity
from tests.lora_fixtures import make_peft_adapter

pytestmark = pytest.mark.timeout(300)

RACY_S = 0.05  # the tests' "recent": files older than this get a stamp
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def quick_stamps(monkeypatch):
    monkeypatch.setattr(adapter_module, "RACY_S", RACY_S)


@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """Every identity LoRAManager hashes, in order."""
    made: list[str] = []

    def counted(adapter):
        made.append(adapter_identity(adapter))
        return made[-1]

    monkeypatch.setattr(manager_module, "adapter_identity", counted)
    return made


def _age() -> None:
    time.sleep(2 * RACY_S)


def _rewrite_in_place(folder, scale: float) -> None:
    """New weights, same file, same size (the inode kept: opened for writing, not replaced):
    every fp32 weight after the safetensors header multiplied by `scale`."""
    path = folder / "adapter_model.safetensors"
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")  # u64 header length, then the header
    assert all(v["dtype"] == "F32" for k, v in safe_header(raw).items() if k != "__metadata__")
    weights = np.frombuffer(raw[start:], dtype=np.float32) * np.float32(scale)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(weights.tobytes())


def safe_header(raw: bytes) -> dict:
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def test_stamp_only_for_settled_local_folders(tiny_model_dir, tmp_path, quick_stamps):
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "a", r=4, target_modules=["q_proj"])
    assert adapter_module.source_stamp(str(folder)) is None  # just written: racy
    _age()
    stamp = adapter_module.source_stamp(str(folder))
    assert stamp is not None and stamp[2] is None  # no adapter_model.bin
    assert adapter_module.source_stamp(str(folder)) == stamp
    assert adapter_module.source_stamp(str(tmp_path / "missing")) is None
    assert adapter_module.source_stamp("org/some-hub-repo") is None
    _rewrite_in_place(folder, 2.0)
    assert adapter_module.source_stamp(str(folder)) is None
    _age()
    again = adapter_module.source_stamp(str(folder))
    assert again is not None and again != stamp
    assert again[1][0] == stamp[1][0]  # the same inode: only the times tell


def test_reread_of_unchanged_files_skips_the_hash(tiny_model_dir, tmp_path, quick_stamps, hashes):
    folders = {
        name: make_peft_adapter(
            tiny_model_dir, tmp_path / name, r=4, target_modules=["q_proj", "v_proj"], seed=seed
        )
        for name, seed in (("x", 1), ("y", 2))
    }
    _age()
    cfg = EngineConfig(model=tiny_model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1)
    manager = LLMEngine(cfg).model_runner.lora_manager
    x, y = (LoRARequest(n, i + 1, str(folders[n])) for i, n in enumerate(folders))
    first = manager.add_lora(x).identity
    manager.add_lora(y)  # evicts x: a CPU cache of one
    assert manager.add_lora(x).identity == first  # read again, not hashed again
    assert len(hashes) == 2 and hashes[0] == first

    _rewrite_in_place(folders["x"], 3.0)
    manager.add_lora(y)  # evicts x
    racy = manager.add_lora(x)  # files just written: hashed, and not remembered
    assert len(hashes) == 3 and racy.identity != first
    assert racy.identity == adapter_identity(racy)
    _age()
    manager.add_lora(y)
    assert manager.add_lora(x).identity == racy.identity
    assert len(hashes) == 4  # the settled files got their stamp on this read, with a hash
    manager.add_lora(y)
    assert manager.add_lora(x).identity == racy.identity
    assert len(hashes) == 4
    # the same folder under another name: the same identity, no hash
    alias = LoRARequest("x-alias", 3, str(folders["x"]))
    assert manager.add_lora(alias).identity == racy.identity
    assert len(hashes) == 4


def test_remembered_identities_are_bounded(tiny_model_dir, tmp_path, quick_stamps, monkeypatch):
    monkeypatch.setattr(manager_module, "MAX_REMEMBERED_IDENTITIES", 2)
    folders = [
        make_peft_adapter(tiny_model_dir, tmp_path / f"a{i}", r=4, target_modules=["q_proj"])
        for i in range(3)
    ]
    _age()
    cfg = EngineConfig(model=tiny_model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1)
    manager = LLMEngine(cfg).model_runner.lora_manager
    for i, folder in enumerate(folders):
        manager.add_lora(LoRARequest(f"a{i}", i + 1, str(folder)))
    assert list(manager._identities) == [str(folders[1]), str(folders[2])]


def test_a_read_adapter_owns_its_weights(tiny_model_dir, tmp_path):
    """What a read holds is the process's memory, not a map of the file: rewriting the file in
    place (PEFT's save_pretrained truncates and writes) leaves it as validated. Mapped, a
    shorter rewrite made the next touch of the weights a SIGBUS: run in a child process."""
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "o", r=4, target_modules=["q_proj"])
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO)!r})
from engine.lora.adapter import LoRAModelSpec, load_adapter
import transformers
spec = LoRAModelSpec.from_hf_config(
    transformers.AutoConfig.from_pretrained({str(tiny_model_dir)!r}), max_lora_rank=16)
adapter = load_adapter({str(folder)!r}, "o", spec)
before = {{k: (a.clone(), b.clone()) for k, (a, b) in adapter.weights.items()}}
path = {str(folder / "adapter_model.safetensors")!r}
raw = open(path, "rb").read()
open(path, "wb").close()  # truncated: a map's pages are past the end of the file now
total = sum(float(a.sum() + b.sum()) for a, b in adapter.weights.values())
open(path, "wb").write(raw[:-8] + bytes(8))  # the same size, other bytes at the end
assert all(torch.equal(a, before[k][0]) and torch.equal(b, before[k][1])
           for k, (a, b) in adapter.weights.items())
print("ok", total)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, (done.returncode, done.stderr[-2000:])
