"""engine.lora.adapter: loading real PEFT adapters (their errors: test_lora_adapter_errors.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from engine.lora.adapter import SUPPORTED_MODULES, LoRAModelSpec, load_adapter  # noqa: E402
from tests.adapter_files import make_adapter, peft_weights, tiny_spec  # noqa: E402


@pytest.fixture(scope="module")
def spec() -> LoRAModelSpec:
    return tiny_spec()


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
