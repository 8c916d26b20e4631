"""Model resolution (local folder, Hub id) and weight loading; the default model:
tests/test_default_model.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.models.loader import (  # noqa: E402
    load_model_config,
    load_state_dict,
    resolve_model,
)

try:
    from model_fixtures import make_tiny_llama
except ImportError:  # tests/ imported as a package
    from tests.model_fixtures import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------
# Local folders


def test_resolve_local_folder_round_trips_weights(tiny):
    path = resolve_model(str(tiny))
    assert path == tiny.resolve()
    cfg = load_model_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 16 and cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is False

    sd = load_state_dict(path)
    ref = _hf_state_dict(path)
    assert set(sd) == set(ref)
    assert "model.layers.0.self_attn.q_proj.weight" in sd and "lm_head.weight" in sd
    for name, tensor in ref.items():
        assert sd[name].dtype == torch.float32
        assert torch.equal(sd[name], tensor), name


def test_resolve_accepts_relative_and_home_paths(tiny, monkeypatch):
    monkeypatch.chdir(tiny.parent)
    assert resolve_model(tiny.name) == tiny.resolve()
    assert resolve_model(f"./{tiny.name}") == tiny.resolve()


def test_load_state_dict_dtype(tiny):
    sd = load_state_dict(tiny, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    ref = load_state_dict(tiny)
    assert torch.equal(sd["model.norm.weight"], ref["model.norm.weight"].to(torch.bfloat16))
    kept = load_state_dict(tiny, dtype=None)
    assert all(t.dtype == torch.float32 for t in kept.values())


def test_tied_embeddings(tmp_path):
    path = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    cfg = load_model_config(path)
    assert cfg["tie_word_embeddings"] is True
    sd = load_state_dict(path)
    assert "lm_head.weight" not in sd  # tied: stored once, as the embedding
    ref = _hf_state_dict(path)
    assert torch.equal(ref["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_sharded_safetensors(tiny, tmp_path):
    from transformers import LlamaForCausalLM

    path = tmp_path / "sharded"
    model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="50KB")
    for f in tiny.glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").is_file()
    resolve_model(str(path))
    sd = load_state_dict(path)
    ref = load_state_dict(tiny)
    assert set(sd) == set(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_pytorch_bin_fallback(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "bin")
    ref = load_state_dict(path)
    torch.save(ref, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    assert resolve_model(str(path)) == path.resolve()
    sd = load_state_dict(path)
    assert set(sd) == set(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM"])
def test_other_llama_family_architectures_accepted(tiny, tmp_path, arch):
    path = _copy(tiny, tmp_path / arch)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(path)) == path.resolve()
    assert load_model_config(path)["architectures"] == [arch]


# ------------------------------------------------------------------------------------------------
# Errors


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/raylora/model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("./no-such-model-folder")


def test_missing_config(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "noconfig")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(path))


def test_missing_weights(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        resolve_model(str(path))
    with pytest.raises(FileNotFoundError):
        load_state_dict(path)


def test_missing_tokenizer(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "notok")
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        resolve_model(str(path))


def test_missing_shard(tiny, tmp_path):
    from transformers import LlamaForCausalLM

    path = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(tiny).save_pretrained(path, max_shard_size="50KB")
    next(iter(sorted(path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_state_dict(path)


def test_unsupported_architecture(tmp_path):
    path = make_tiny_llama(tmp_path / "gpt2ish", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        resolve_model(str(path))


def test_unsupported_model_type_without_architectures(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "phi")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("architectures")
    cfg["model_type"] = "phi"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="phi"):
        resolve_model(str(path))


def test_bad_config_json(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "badjson")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(path))


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_offline_hub_id_not_in_cache(offline_hub):
    with pytest.raises(FileNotFoundError, match="not in the local.*HF_HUB_OFFLINE"):
        resolve_model("raylora-tests/no-such-model")


def test_offline_hub_id_from_cache(offline_hub, tiny):
    # A snapshot laid out as huggingface_hub caches it works with HF_HUB_OFFLINE=1.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--raylora-tests--tiny-llama"
    shutil.copytree(tiny, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    path = resolve_model("raylora-tests/tiny-llama")
    assert path == (repo / "snapshots" / commit).resolve()
    assert set(load_state_dict(path)) == set(load_state_dict(tiny))
    assert resolve_model(f"raylora-tests/tiny-llama@{commit}") == path
