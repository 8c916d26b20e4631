"""PEFT adapter_config.json for a Llama-family model: the supported modules, the model spec,
and the validated settings (rank, alpha, rslora, which (layer, module) pairs are adapted)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.lora.errors import (
    AdapterConfigError,
    LoRARankError,
    LoRAShapeError,
    UnsupportedLoRAFeatureError,
    UnsupportedTargetModuleError,
)

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

# The modules the engine can adapt, in canonical order, with their parent block.
SUPPORTED_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Other modules a Llama has that PEFT could target; the engine does not adapt them.
_UNSUPPORTED_MODULE_NAMES = ("model.embed_tokens", "lm_head")
_ALL_LINEAR = "all-linear"


@dataclass
class LoRAModelSpec:
    """What the base model looks like, as far as adapters are concerned."""

    num_layers: int
    # HF module name -> (out_features, in_features) for the seven projection modules.
    module_shapes: dict[str, tuple[int, int]]
    max_lora_rank: int

    @classmethod
    def from_hf_config(cls, config: Any, max_lora_rank: int) -> LoRAModelSpec:
        """Build the spec from a transformers LlamaConfig-like object (attribute access only)."""
        hidden = int(config.hidden_size)
        inter = int(config.intermediate_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        shapes = {
            "q_proj": (heads * head_dim, hidden),
            "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
        }
        return cls(int(config.num_hidden_layers), shapes, int(max_lora_rank))


# ----------------------------------------------------------------------------------------
# The config


@dataclass
class AdapterSettings:
    """What load_adapter needs from a validated adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool
    expected: set[tuple[int, str]]  # (layer, module) pairs PEFT would have adapted


def read_config(folder: Path, name: str) -> dict[str, Any]:
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        raise AdapterConfigError(f"LoRA adapter {name!r}: no {CONFIG_NAME} in {folder}", name)
    try:
        text = cfg_path.read_text(encoding="utf-8")
        cfg = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterConfigError(
            f"LoRA adapter {name!r}: {CONFIG_NAME} is not valid JSON: {e}", name
        ) from e
    if not isinstance(cfg, dict):
        raise AdapterConfigError(
            f"LoRA adapter {name!r}: {CONFIG_NAME} must hold a JSON object, got "
            f"{type(cfg).__name__}",
            name,
        )
    return cfg


def _candidate_module_keys(num_layers: int) -> dict[str, tuple[int, str] | None]:
    """Module keys of a Llama (as PEFT names them) -> (layer, module), None if unsupported."""
    keys: dict[str, tuple[int, str] | None] = {}
    for layer in range(num_layers):
        for module in SUPPORTED_MODULES:
            keys[f"model.layers.{layer}.{_PARENT[module]}.{module}"] = (layer, module)
    for other in _UNSUPPORTED_MODULE_NAMES:
        keys[other] = None
    return keys


def _as_name_list(value: Any, field_name: str, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, set)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise AdapterConfigError(
        f"LoRA adapter {name!r}: {field_name} must be a string or a list of strings, got {value!r}",
        name,
    )


def _is_nonempty(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


def parse_config(cfg: dict[str, Any], spec: LoRAModelSpec, name: str) -> AdapterSettings:
    peft_type = cfg.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (only LORA)", name
        )

    # r, lora_alpha, target_modules: present and well-formed.
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in cfg or cfg[key] is None:
            raise AdapterConfigError(f"LoRA adapter {name!r}: {CONFIG_NAME} has no {key!r}", name)
    r = cfg["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterConfigError(
            f"LoRA adapter {name!r}: 'r' must be a positive integer, got {r!r}", name
        )
    alpha = cfg["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterConfigError(
            f"LoRA adapter {name!r}: 'lora_alpha' must be a finite number, got {alpha!r}", name
        )
    if r > spec.max_lora_rank:
        raise LoRARankError(
            f"LoRA adapter {name!r}: rank {r} is above max_lora_rank {spec.max_lora_rank}; "
            "start the engine with a larger max_lora_rank",
            name,
        )

    # Features the engine does not implement.
    if cfg.get("use_dora"):
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: DoRA (use_dora=true) is not supported", name
        )
    if _is_nonempty(cfg.get("modules_to_save")):
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: modules_to_save={cfg['modules_to_save']!r} is not supported "
            "(only LoRA A/B weights can be served)",
            name,
        )
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: bias={bias!r} is not supported (only bias='none')", name
        )
    if cfg.get("lora_bias"):
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: lora_bias=true is not supported", name
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if _is_nonempty(cfg.get(key)):
            raise UnsupportedLoRAFeatureError(
                f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported (one rank and one "
                "lora_alpha for every module)",
                name,
            )
    for key in ("target_parameters", "trainable_token_indices", "layer_replication"):
        if _is_nonempty(cfg.get(key)):
            raise UnsupportedLoRAFeatureError(
                f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported", name
            )
    if cfg.get("use_qalora"):
        raise UnsupportedLoRAFeatureError(f"LoRA adapter {name!r}: QALoRA is not supported", name)

    expected = _expected_modules(cfg, spec, name)
    return AdapterSettings(
        rank=r, alpha=float(alpha), use_rslora=bool(cfg.get("use_rslora")), expected=expected
    )


def _expected_modules(cfg: dict[str, Any], spec: LoRAModelSpec, name: str) -> set[tuple[int, str]]:
    """Simulate PEFT's module matching on a Llama with spec.num_layers layers."""
    targets = cfg["target_modules"]
    candidates = _candidate_module_keys(spec.num_layers)
    if isinstance(targets, list) and len(targets) == 1 and isinstance(targets[0], str):
        if targets[0].lower() == _ALL_LINEAR:
            targets = _ALL_LINEAR
    if isinstance(targets, str) and targets.lower() == _ALL_LINEAR:
        targets = list(SUPPORTED_MODULES)

    # exclude_modules (list: exact or suffix; string: regex fullmatch).
    excl = cfg.get("exclude_modules")
    excl_list = _as_name_list(excl, "exclude_modules", name) if _is_nonempty(excl) else []

    def excluded(key: str) -> bool:
        if not excl_list:
            return False
        if isinstance(excl, str):
            return re.fullmatch(excl, key) is not None
        return key in excl_list or any(key.endswith(f".{e}") for e in excl_list)

    matched: set[str] = set()
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise AdapterConfigError(
                f"LoRA adapter {name!r}: target_modules regex {targets!r} is invalid: {e}", name
            ) from e
        matched = {k for k in candidates if not excluded(k) and pattern.fullmatch(k)}
        if not matched:
            raise UnsupportedTargetModuleError(
                f"LoRA adapter {name!r}: target_modules regex {targets!r} matches no module of the "
                f"model (supported: {', '.join(SUPPORTED_MODULES)})",
                name,
            )
    else:
        entries = _as_name_list(targets, "target_modules", name)
        if not entries:
            raise AdapterConfigError(f"LoRA adapter {name!r}: target_modules is empty", name)
        layers_to_transform = cfg.get("layers_to_transform")
        if _is_nonempty(cfg.get("layers_pattern")):
            # With a layers_pattern PEFT looks for "<pattern>.<idx>."; for Llama that is "layers".
            patterns = _as_name_list(cfg["layers_pattern"], "layers_pattern", name)
            if "layers" not in patterns:
                raise UnsupportedLoRAFeatureError(
                    f"LoRA adapter {name!r}: layers_pattern={cfg['layers_pattern']!r} does not "
                    "name this model's 'layers'",
                    name,
                )
        if layers_to_transform is not None and not (
            (isinstance(layers_to_transform, int) and not isinstance(layers_to_transform, bool))
            or (
                isinstance(layers_to_transform, list)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in layers_to_transform)
            )
        ):
            raise AdapterConfigError(
                f"LoRA adapter {name!r}: layers_to_transform must be an int or a list of ints, "
                f"got {layers_to_transform!r}",
                name,
            )
        if isinstance(layers_to_transform, int):
            layer_set: set[int] | None = {layers_to_transform}
        elif isinstance(layers_to_transform, list) and layers_to_transform:
            layer_set = set(layers_to_transform)
        else:
            layer_set = None
        if layer_set is not None:
            too_deep = sorted(i for i in layer_set if i < 0 or i >= spec.num_layers)
            if too_deep:
                raise LoRAShapeError(
                    f"LoRA adapter {name!r}: layers_to_transform names layers {too_deep} but the "
                    f"model has {spec.num_layers} layers",
                    name,
                )
        for entry in entries:
            hits = {k for k in candidates if k == entry or k.endswith(f".{entry}")}
            if not hits:
                raise UnsupportedTargetModuleError(
                    f"LoRA adapter {name!r}: target module {entry!r} is not a module of the model "
                    f"(supported: {', '.join(SUPPORTED_MODULES)})",
                    name,
                )
            for k in hits:
                if excluded(k):
                    continue
                target = candidates[k]
                if layer_set is not None and target is not None and target[0] not in layer_set:
                    continue
                matched.add(k)

    unsupported = sorted(k for k in matched if candidates[k] is None)
    if unsupported:
        raise UnsupportedTargetModuleError(
            f"LoRA adapter {name!r}: target modules {unsupported} are not supported (the engine "
            f"adapts only {', '.join(SUPPORTED_MODULES)})",
            name,
        )
    expected = {candidates[k] for k in matched}
    if not expected:
        raise UnsupportedTargetModuleError(
            f"LoRA adapter {name!r}: target_modules {cfg['target_modules']!r} select no module of "
            "the model",
            name,
        )
    return expected  # type: ignore[return-value]
