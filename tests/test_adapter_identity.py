"""An adapter's identity keys its prefix-cache blocks. Read from a settled local folder it is
the folder's files as read (engine/lora/adapter.py source_stamp, unchanged from before the
read to after it; manager.folder_identity): no pass over the weights, the same for a reread
and for another name or path of the same folder, another after any write (in place and at
the same size too). Files just written, or written during the read, get the sha256 of the
weights (adapter_identity)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

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
    """Every weights hash LoRAManager takes, in order."""
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


def _manager(tiny_model_dir):
    cfg = EngineConfig(model=tiny_model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1)
    return LLMEngine(cfg).model_runner.lora_manager


def test_a_settled_folder_is_identified_by_its_files_without_a_hash(
    tiny_model_dir, tmp_path, hashes, monkeypatch
):
    monkeypatch.setattr(adapter_module, "RACY_S", 1.0)  # x is read well within it
    manager = _manager(tiny_model_dir)
    folders = {}
    for name, seed in (("x", 1), ("y", 2)):
        folders[name] = make_peft_adapter(
            tiny_model_dir, tmp_path / name, r=4, target_modules=["q_proj", "v_proj"], seed=seed
        )
        if name == "x":
            x = LoRARequest("x", 1, str(folders["x"]))
            racy = manager.add_lora(x).identity  # files just written: the weights' hash
    y = LoRARequest("y", 2, str(folders["y"]))
    assert hashes == [racy]
    time.sleep(2.0)
    manager.add_lora(y)  # evicts x: a CPU cache of one
    read = manager.add_lora(x)  # settled now: its files, no hash
    first = read.identity
    assert hashes == [racy] and first != racy
    manager.add_lora(y)
    assert manager.add_lora(x).identity == first  # a reread
    # the same folder under another name, and by another path: the same identity
    alias = LoRARequest("x-alias", 3, str(folders["x"]))
    assert manager.add_lora(alias).identity == first
    other_path = LoRARequest("x-path", 4, f"{tmp_path}/./x/")
    assert manager.add_lora(other_path).identity == first
    monkeypatch.setenv("HOME", str(tmp_path))  # a local folder written with ~ is one too
    assert manager.add_lora(LoRARequest("x-home", 6, "~/x")).identity == first
    assert hashes == [racy]

    # a copy elsewhere is another adapter; in-place new weights another identity
    copy = shutil.copytree(folders["x"], tmp_path / "x-copy", copy_function=shutil.copy2)
    time.sleep(2.0)
    assert manager.add_lora(LoRARequest("x-copy", 5, str(copy))).identity != first
    _rewrite_in_place(folders["x"], 3.0)
    time.sleep(2.0)
    manager.add_lora(y)
    changed = manager.add_lora(x)
    assert changed.identity != first and hashes == [racy]
    key = (0, "q_proj")
    assert torch.allclose(changed.weights[key][0], 3 * read.weights[key][0])


def test_files_written_during_the_read_get_the_weights_hash(
    tiny_model_dir, tmp_path, quick_stamps, hashes, monkeypatch
):
    """The stamp is taken before the read and checked after it: a write in between means the
    stamp may not name what was read, so the weights are hashed."""
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "w", r=4, target_modules=["q_proj"])
    _age()
    read = manager_module.load_adapter

    def read_then_write(path, name, spec, folder=None):
        adapter = read(path, name, spec, folder)
        _rewrite_in_place(folder, 2.0)  # lands after the read, before the check
        return adapter

    monkeypatch.setattr(manager_module, "load_adapter", read_then_write)
    adapter = _manager(tiny_model_dir).add_lora(LoRARequest("w", 1, str(folder)))
    assert hashes == [adapter.identity] and adapter.identity == adapter_identity(adapter)


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


def test_a_hub_adapters_snapshot_is_identified_by_its_files(
    tiny_model_dir, tmp_path, quick_stamps, hashes, monkeypatch
):
    """A Hub repo id reads the repo's snapshot in the local cache (offline here): its files'
    stamp is the identity as for a local folder, and a reread after an eviction makes no
    hash."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--raylora-tests--adapter"
    snapshot = make_peft_adapter(
        tiny_model_dir, repo / "snapshots" / commit, r=4, target_modules=["q_proj"]
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    other = make_peft_adapter(tiny_model_dir, tmp_path / "other", r=4, target_modules=["q_proj"])
    _age()
    manager = _manager(tiny_model_dir)
    hub_lora = LoRARequest("hub", 1, "raylora-tests/adapter")
    first = manager.add_lora(hub_lora)
    stamp = adapter_module.source_stamp(str(snapshot))
    assert first.identity == manager_module.folder_identity(str(snapshot), stamp)
    assert first.source == "raylora-tests/adapter"
    manager.add_lora(LoRARequest("other", 2, str(other)))  # evicts it: a CPU cache of one
    assert manager.add_lora(hub_lora).identity == first.identity
    assert hashes == []
