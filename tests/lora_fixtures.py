"""Real PEFT adapters for tests (random, non-zero B: PEFT initialises B to zero)."""

import importlib
from pathlib import Path

import torch

from raylora_kernels import cpu_kernel

# The three shapes the multi-LoRA acceptance asks for.
ADAPTER_SPECS = {
    "qv4": {"r": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": False},
    "all16": {
        "r": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "use_rslora": True,
    },
    "mlp8": {"r": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"], "use_rslora": False},
}


def make_peft_adapter(
    model_dir: str,
    out: Path,
    r: int,
    target_modules: list[str],
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=target_modules,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    pm = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in pm.named_parameters():
            if "lora_" in name:
                w.copy_(torch.randn(w.shape, generator=gen) * std)
    pm.save_pretrained(out)
    return out


def make_adapter_set(model_dir: str, root: Path, std: float = 0.2) -> dict[str, Path]:
    return {
        name: make_peft_adapter(model_dir, root / name, seed=i, std=std, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


def cpu_kernel_mode(monkeypatch, mode: str) -> list | None:
    """The torch path with the C++ CPU kernel on ("cpu_kernel": it must build here, g++ is on
    every machine this runs on) or off ("torch_ops": RAYLORA_CPU_KERNEL=0). Returns the list
    its ops' calls (`lora_add`, `linear_lora`, `linear_lora_packed`) append their names to, or
    None when off."""
    if mode == "torch_ops":
        monkeypatch.setenv("RAYLORA_CPU_KERNEL", "0")
        assert cpu_kernel.cpu_lora_op() is None and cpu_kernel.cpu_linear_lora_packed_op() is None
        return None
    assert mode == "cpu_kernel"
    monkeypatch.delenv("RAYLORA_CPU_KERNEL", raising=False)
    calls = []
    # the torch LoRA backend looks its C++ ops up through these names when it is built
    module = importlib.import_module("raylora_kernels.backends.cpu")
    for getter in ("cpu_lora_op", "cpu_linear_lora_op", "cpu_linear_lora_packed_op"):
        op = getattr(cpu_kernel, getter)()
        assert op is not None, "the C++ CPU kernel did not build (see the logged warning)"

        def counted(*args, op=op, name=getter):
            calls.append(name)
            return op(*args)

        monkeypatch.setattr(module, getter, lambda counted=counted: counted)
    return calls
