"""engine.lora.adapter: loading real PEFT adapters, and one specific error per bad case."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from engine.lora.adapter import SUPPORTED_MODULES, LoRAModelSpec, load_adapter  # noqa: E402
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

MAX_RANK = 16


def tiny_config(hidden: int = 64, layers: int = 2):
    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
    )


@pytest.fixture(scope="module")
def spec() -> LoRAModelSpec:
    return LoRAModelSpec.from_hf_config(tiny_config(), max_lora_rank=MAX_RANK)


def make_adapter(
    folder: Path, hidden: int = 64, layers: int = 2, safe: bool = True, seed: int = 0, **lora
):
    """A real PEFT adapter on a tiny random Llama, lora_B randomised, saved into `folder`."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_config(hidden, layers))
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    lora.setdefault("target_modules", ["q_proj", "v_proj"])
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_()  # PEFT initialises B to zero
    pm.save_pretrained(str(folder), safe_serialization=safe)
    return folder, pm


def peft_weights(pm) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            out[(layer, parts[-1])] = (
                mod.lora_A["default"].weight.detach(),
                mod.lora_B["default"].weight.detach(),
            )
    return out


def edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


_DELETE = object()


# ---------------------------------------------------------------------------------------
# Good adapters


def test_loads_peft_tensors_and_scaling(tmp_path, spec):
    folder, pm = make_adapter(tmp_path / "a", r=4, lora_alpha=8)
    ad = load_adapter(str(folder), "a", spec)
    assert ad.name == "a" and ad.rank == 4 and ad.lora_alpha == 8
    assert ad.scaling == pytest.approx(2.0)
    assert ad.target_modules == ["q_proj", "v_proj"]
    assert ad.source == str(folder)
    expected = peft_weights(pm)
    assert (
        set(ad.weights) == set(expected) == {(i, m) for i in range(2) for m in ("q_proj", "v_proj")}
    )
    for key, (a, b) in ad.weights.items():
        ea, eb = expected[key]
        assert a.dtype == torch.float32 and b.dtype == torch.float32
        assert a.shape == (4, spec.module_shapes[key[1]][1])
        assert b.shape == (spec.module_shapes[key[1]][0], 4)
        torch.testing.assert_close(a, ea, rtol=0, atol=0)
        torch.testing.assert_close(b, eb, rtol=0, atol=0)
    assert ad.num_bytes() == sum(a.numel() * 4 + b.numel() * 4 for a, b in ad.weights.values())


def test_rslora_all_linear(tmp_path, spec):
    folder, pm = make_adapter(
        tmp_path / "rs", r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True
    )
    ad = load_adapter(str(folder), "rs", spec)
    assert ad.scaling == pytest.approx(8 / 4.0)  # alpha / sqrt(r)
    assert ad.target_modules == list(SUPPORTED_MODULES)
    assert len(ad.weights) == 2 * 7
    for key, (ea, eb) in peft_weights(pm).items():
        torch.testing.assert_close(ad.weights[key][0], ea, rtol=0, atol=0)
        torch.testing.assert_close(ad.weights[key][1], eb, rtol=0, atol=0)


def test_matches_peft_forward(tmp_path, spec):
    """x @ A.T @ B.T * scaling is exactly the delta PEFT adds to the module output."""
    folder, pm = make_adapter(tmp_path / "f", r=8, lora_alpha=24, target_modules=["o_proj"])
    ad = load_adapter(str(folder), "f", spec)
    mod = pm.base_model.model.model.layers[1].self_attn.o_proj
    x = torch.randn(3, spec.module_shapes["o_proj"][1])
    with torch.no_grad():
        delta = mod(x) - mod.base_layer(x)
    a, b = ad.weights[(1, "o_proj")]
    torch.testing.assert_close(x @ a.T @ b.T * ad.scaling, delta, rtol=1e-5, atol=1e-5)


def test_layers_to_transform(tmp_path, spec):
    folder, _ = make_adapter(
        tmp_path / "l", target_modules=["gate_proj", "down_proj"], layers_to_transform=[1]
    )
    ad = load_adapter(str(folder), "l", spec)
    assert set(ad.weights) == {(1, "gate_proj"), (1, "down_proj")}
    assert ad.target_modules == ["gate_proj", "down_proj"]
    assert ad.layers == [1]


def test_regex_target_modules(tmp_path, spec):
    folder, _ = make_adapter(tmp_path / "re", target_modules=r".*\.(k_proj|up_proj)")
    ad = load_adapter(str(folder), "re", spec)
    assert ad.target_modules == ["k_proj", "up_proj"]
    assert len(ad.weights) == 4


def test_bin_fallback(tmp_path, spec):
    folder, pm = make_adapter(tmp_path / "bin", safe=False)
    assert (folder / "adapter_model.bin").is_file()
    assert not (folder / "adapter_model.safetensors").exists()
    ad = load_adapter(str(folder), "bin", spec)
    for key, (ea, eb) in peft_weights(pm).items():
        torch.testing.assert_close(ad.weights[key][0], ea, rtol=0, atol=0)
        torch.testing.assert_close(ad.weights[key][1], eb, rtol=0, atol=0)


def test_named_adapter_key_variant(tmp_path, spec):
    """Keys like `...lora_A.default.weight` (saved with the adapter name) load too."""
    from safetensors.torch import load_file, save_file

    folder, _ = make_adapter(tmp_path / "v")
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(path))
    ad = load_adapter(str(folder), "v", spec)
    assert len(ad.weights) == 4


def test_hub_repo_id_uses_snapshot_download(tmp_path, spec, monkeypatch):
    import huggingface_hub

    folder, _ = make_adapter(tmp_path / "snap")
    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append(repo_id)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    ad = load_adapter("someone/some-adapter", "hub", spec)
    assert calls == ["someone/some-adapter"] and ad.source == "someone/some-adapter"


def test_loading_is_fast_for_a_135m_sized_adapter(tmp_path):
    """r=16 on all seven modules of SmolLM2-135M's 30 layers loads well under a second."""
    from safetensors.torch import save_file

    spec = LoRAModelSpec.from_hf_config(
        transformers.LlamaConfig(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
        ),
        max_lora_rank=16,
    )
    tensors = {}
    for i in range(30):
        for m in SUPPORTED_MODULES:
            parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out_f, in_f = spec.module_shapes[m]
            base = f"base_model.model.model.layers.{i}.{parent}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(16, in_f)
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_f, 16)
    folder = tmp_path / "big"
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 16,
                "lora_alpha": 32,
                "target_modules": list(SUPPORTED_MODULES),
                "bias": "none",
            }
        )
    )
    t0 = time.perf_counter()
    ad = load_adapter(str(folder), "big", spec)
    elapsed = time.perf_counter() - t0
    assert len(ad.weights) == 210 and ad.scaling == 2.0
    assert elapsed < 1.0, f"loading took {elapsed:.2f}s"


# ---------------------------------------------------------------------------------------
# Bad adapters: each case raises its own error class, naming the adapter


def expect(err_cls, folder_or_path, spec, match: str | None = None):
    with pytest.raises(err_cls, match=match) as info:
        load_adapter(str(folder_or_path), "bad-adapter", spec)
    assert "bad-adapter" in str(info.value)
    assert info.value.lora_name == "bad-adapter"
    return info.value


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
    edit_config(folder, **{field: _DELETE})
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
