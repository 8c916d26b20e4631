"""engine.lora.adapter: one specific error per bad adapter, naming it."""

from __future__ import annotations

import time

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from engine.lora.adapter import LoRAModelSpec, load_adapter  # noqa: E402
from engine.lora.errors import (  # noqa: E402
    AdapterConfigError,
    CorruptLoRAWeightsError,
    InvalidLoRAError,
    LoRAError,
    LoRANotFoundError,
    LoRARankError,
    LoRAShapeError,
    UnsupportedLoRAFeatureError,
    UnsupportedTargetModuleError,
)
from tests.adapter_files import DELETE, edit_config, expect, make_adapter, tiny_spec  # noqa: E402


@pytest.fixture(scope="module")
def spec() -> LoRAModelSpec:
    return tiny_spec()


# ---------------------------------------------------------------------------------------
# Bad adapters: each case raises its own error class, naming the adapter


def test_error_hierarchy():
    assert issubclass(LoRAError, ValueError)
    assert issubclass(LoRANotFoundError, LoRAError)
    assert not issubclass(LoRANotFoundError, InvalidLoRAError)
    for cls in (
        AdapterConfigError,
        LoRARankError,
        UnsupportedTargetModuleError,
        UnsupportedLoRAFeatureError,
        LoRAShapeError,
        CorruptLoRAWeightsError,
    ):
        assert issubclass(cls, InvalidLoRAError)


def test_folder_missing(tmp_path, spec):
    expect(LoRANotFoundError, tmp_path / "does-not-exist", spec, "does not exist")


def test_empty_path(spec):
    expect(LoRANotFoundError, "", spec)


def test_repo_missing_offline(tmp_path, spec, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hfcache"))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hfcache"))
    t0 = time.perf_counter()
    expect(LoRANotFoundError, "raylora-test/no-such-adapter", spec, "no-such-adapter")
    assert time.perf_counter() - t0 < 10


def test_config_missing(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "c")
    (folder / "adapter_config.json").unlink()
    expect(AdapterConfigError, folder, spec, "adapter_config.json")


def test_config_not_json(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "c")
    (folder / "adapter_config.json").write_text("{not json")
    expect(AdapterConfigError, folder, spec, "not valid JSON")


@pytest.mark.parametrize("field", ["r", "lora_alpha", "target_modules"])
def test_config_field_missing(tmp_path, spec, field):
    folder, _ = make_adapter(tmp_path / "c")
    edit_config(folder, **{field: DELETE})
    expect(AdapterConfigError, folder, spec, field)


@pytest.mark.parametrize("field,value", [("r", 0), ("r", "8"), ("lora_alpha", "x")])
def test_config_field_bad(tmp_path, spec, field, value):
    folder, _ = make_adapter(tmp_path / "c")
    edit_config(folder, **{field: value})
    expect(AdapterConfigError, folder, spec, field)


def test_rank_above_max(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "big", r=32)
    err = expect(LoRARankError, folder, spec, "max_lora_rank")
    assert "32" in str(err) and "16" in str(err)


@pytest.mark.parametrize("target", ["foo", "lm_head", "embed_tokens"])
def test_unknown_target_module_in_config(tmp_path, spec, target):
    folder, _ = make_adapter(tmp_path / "t")
    edit_config(folder, target_modules=["q_proj", target])
    expect(UnsupportedTargetModuleError, folder, spec, target)


def test_real_adapter_on_lm_head(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "t", target_modules=["q_proj", "lm_head"])
    expect(UnsupportedTargetModuleError, folder, spec, "lm_head")


def test_regex_matching_nothing(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "t")
    edit_config(folder, target_modules=r".*\.nothing_here")
    expect(UnsupportedTargetModuleError, folder, spec)


def test_dora(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "dora", use_dora=True)
    expect(UnsupportedLoRAFeatureError, folder, spec, "DoRA")


def test_modules_to_save(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "mts", modules_to_save=["lm_head"])
    expect(UnsupportedLoRAFeatureError, folder, spec, "modules_to_save")


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_bias(tmp_path, spec, bias):
    folder, _ = make_adapter(tmp_path / "bias", bias=bias)
    expect(UnsupportedLoRAFeatureError, folder, spec, "bias")


def test_rank_pattern(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "rp", rank_pattern={"q_proj": 2})
    expect(UnsupportedLoRAFeatureError, folder, spec, "rank_pattern")


def test_shape_mismatch_other_hidden_size(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "h32", hidden=32)
    expect(LoRAShapeError, folder, spec, "lora_A")


def test_more_layers_than_the_model(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "deep", layers=3)
    expect(LoRAShapeError, folder, spec, "layer 2")


def test_corrupt_safetensors(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "trunc")
    path = folder / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect(CorruptLoRAWeightsError, folder, spec, "adapter_model.safetensors")


def test_garbage_safetensors(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "garbage")
    (folder / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    expect(CorruptLoRAWeightsError, folder, spec)


def test_corrupt_bin(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "badbin", safe=False)
    (folder / "adapter_model.bin").write_bytes(b"not a pickle")
    expect(CorruptLoRAWeightsError, folder, spec, "adapter_model.bin")


def test_weight_file_missing(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "nofile")
    (folder / "adapter_model.safetensors").unlink()
    expect(CorruptLoRAWeightsError, folder, spec, "adapter_model")


def test_weights_do_not_match_config(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "mm")
    edit_config(folder, target_modules=["q_proj", "k_proj", "v_proj"])
    expect(CorruptLoRAWeightsError, folder, spec, "k_proj")


def test_nan_weights(tmp_path, spec):
    from safetensors.torch import load_file, save_file

    folder, _ = make_adapter(tmp_path / "nan")
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    expect(CorruptLoRAWeightsError, folder, spec, "NaN")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_an_infinite_weight_is_named_and_huge_finite_ones_load(tmp_path, spec, bad):
    """The finiteness check is one sum over every weight: an inf in the last module is found
    and named; finite weights near the fp32 limit overflow that sum, yet load (the exact
    check behind it), bit for bit."""
    from safetensors.torch import load_file, save_file

    folder, _ = make_adapter(tmp_path / "inf")
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    keys = sorted(k for k in tensors if "lora_A" in k)
    tensors[keys[0]][0, :2] = torch.tensor([3e38, 3e38])  # sum: inf
    tensors[keys[1]][0, 0] = -3e38
    save_file(tensors, str(path))
    adapter = load_adapter(str(folder), "huge", spec)
    values = torch.cat([w.reshape(-1) for pair in adapter.weights.values() for w in pair])
    assert torch.isfinite(values).all() and values.max() == 3e38 and values.min() == -3e38
    last = sorted(k for k in tensors if "lora_B" in k and "layers.1." in k)[-1]
    tensors[last][-1, -1] = bad
    save_file(tensors, str(path))
    module = last.split(".")[-3]
    expect(CorruptLoRAWeightsError, folder, spec, f"layer 1 {module} weights contain NaN or inf")


def test_rank_in_weights_differs_from_config(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "r", r=4)
    edit_config(folder, r=8)
    expect(LoRAShapeError, folder, spec)
