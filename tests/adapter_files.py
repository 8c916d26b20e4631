"""Real PEFT adapters on a tiny random Llama, and their configs edited, for the adapter
loader's tests (tests/test_lora_adapter.py, tests/test_lora_adapter_errors.py)."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from engine.lora.adapter import LoRAModelSpec, load_adapter

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


def tiny_spec() -> LoRAModelSpec:
    """The loader's view of tiny_config(), ranks up to MAX_RANK."""
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
        if v is DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


DELETE = object()


def expect(err_cls, folder_or_path, spec, match: str | None = None):
    """Loading raises err_cls (its message matching `match`), naming the adapter."""
    with pytest.raises(err_cls, match=match) as info:
        load_adapter(str(folder_or_path), "bad-adapter", spec)
    assert "bad-adapter" in str(info.value)
    assert info.value.lora_name == "bad-adapter"
    return info.value
