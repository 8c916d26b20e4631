"""Load and validate a PEFT LoRA adapter for a Llama-family base model.

`load_adapter(lora_path, name, spec)` reads a PEFT folder (adapter_config.json +
adapter_model.safetensors, or adapter_model.bin) or a Hugging Face Hub repo id, checks
everything the engine relies on, and returns a `LoRAAdapter` with fp32, unscaled
A [r, in] / B [out, r] tensors per (layer, module). Any problem raises a specific
`engine.lora.errors` exception before anything is returned, so the engine can load an
adapter without evicting or touching anything else first.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.lora.errors import (
    AdapterConfigError,
    CorruptLoRAWeightsError,
    LoRANotFoundError,
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


@dataclass
class LoRAAdapter:
    """A validated adapter, ready for the engine's CPU cache."""

    name: str
    rank: int
    lora_alpha: float
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: list[str]  # normalised HF module names present, canonical order
    # (layer_idx, module) -> (A [r, in], B [out, r]), fp32, contiguous, NOT scaled.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    source: str  # the folder or Hub repo id it came from
    use_rslora: bool = False

    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.weights.values()
        )

    @property
    def layers(self) -> list[int]:
        """The layer indices that have at least one adapted module."""
        return sorted({layer for layer, _ in self.weights})


# ----------------------------------------------------------------------------------------
# Finding the adapter


def _looks_like_local_path(path: str) -> bool:
    if path.startswith(("/", "./", "../", "~", "\\")) or path in (".", ".."):
        return True
    if os.sep == "\\" and re.match(r"^[A-Za-z]:[\\/]", path):
        return True
    # A Hub repo id is "name" or "owner/name": anything with more slashes is a path.
    return path.count("/") > 1 or "\\" in path


def resolve_adapter_dir(lora_path: str, name: str) -> Path:
    """The local folder of the adapter: the folder itself, or a Hub snapshot."""
    if not isinstance(lora_path, str) or not lora_path.strip():
        raise LoRANotFoundError(f"LoRA adapter {name!r}: empty lora_path", name)
    expanded = Path(os.path.expanduser(lora_path))
    if expanded.is_dir():
        return expanded
    if expanded.exists():
        raise LoRANotFoundError(
            f"LoRA adapter {name!r}: {lora_path!r} is a file, expected a PEFT adapter folder", name
        )
    if _looks_like_local_path(lora_path):
        raise LoRANotFoundError(f"LoRA adapter {name!r}: folder {lora_path!r} does not exist", name)
    return _download_from_hub(lora_path, name)


def _download_from_hub(repo_id: str, name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise LoRANotFoundError(
            f"LoRA adapter {name!r}: {repo_id!r} is not a local folder and huggingface_hub "
            "is not installed",
            name,
        ) from e
    try:
        from huggingface_hub import constants

        offline = bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        offline = False
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )
    try:
        local = snapshot_download(
            repo_id=repo_id,
            allow_patterns=[CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME],
        )
    except Exception as e:  # RepositoryNotFound, LocalEntryNotFound, HFValidationError, network
        where = (
            "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the Hub"
        )
        raise LoRANotFoundError(
            f"LoRA adapter {name!r}: {repo_id!r} is neither a local folder nor a repo found "
            f"{where}: {type(e).__name__}: {e}",
            name,
        ) from e
    return Path(local)


# ----------------------------------------------------------------------------------------
# The config


@dataclass
class _Config:
    rank: int
    alpha: float
    use_rslora: bool
    expected: set[tuple[int, str]]  # (layer, module) pairs PEFT would have adapted


def _read_config(folder: Path, name: str) -> dict[str, Any]:
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


def _parse_config(cfg: dict[str, Any], spec: LoRAModelSpec, name: str) -> _Config:
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
    return _Config(
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


# ----------------------------------------------------------------------------------------
# The weights


def _read_weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    st = folder / SAFETENSORS_NAME
    binf = folder / BIN_NAME
    if st.is_file():
        try:
            from safetensors.torch import load_file

            tensors = load_file(str(st), device="cpu")
        except Exception as e:  # SafetensorError, OSError, truncated header, bad dtype...
            raise CorruptLoRAWeightsError(
                f"LoRA adapter {name!r}: cannot read {st}: {type(e).__name__}: {e}", name
            ) from e
    elif binf.is_file():
        try:
            tensors = torch.load(str(binf), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptLoRAWeightsError(
                f"LoRA adapter {name!r}: cannot read {binf}: {type(e).__name__}: {e}", name
            ) from e
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            raise CorruptLoRAWeightsError(
                f"LoRA adapter {name!r}: {binf} does not hold a dict of tensors", name
            )
    else:
        raise CorruptLoRAWeightsError(
            f"LoRA adapter {name!r}: no {SAFETENSORS_NAME} or {BIN_NAME} in {folder}", name
        )
    if not tensors:
        raise CorruptLoRAWeightsError(f"LoRA adapter {name!r}: the weight file is empty", name)
    return tensors


_LORA_KEY = re.compile(
    r"^(?P<prefix>.*)\.lora_(?P<ab>A|B)\.(?:(?P<adapter>[^.]+)\.)?(?P<param>weight|bias)$"
)


def _classify(key: str, name: str) -> tuple[int, str, str] | None:
    """PEFT tensor key -> (layer, module, 'A'|'B'); raises for tensors the engine cannot serve."""
    if "lora_magnitude_vector" in key:
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: tensor {key!r} is a DoRA magnitude vector; DoRA is not "
            "supported",
            name,
        )
    if "lora_embedding_" in key:
        raise UnsupportedTargetModuleError(
            f"LoRA adapter {name!r}: tensor {key!r} adapts an embedding, which is not supported",
            name,
        )
    m = _LORA_KEY.match(key)
    if m is None:
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight (modules_to_save or "
            "trainable tokens are not supported)",
            name,
        )
    if m.group("param") == "bias":
        raise UnsupportedLoRAFeatureError(
            f"LoRA adapter {name!r}: tensor {key!r} is a LoRA bias; lora_bias is not supported",
            name,
        )
    parts = m.group("prefix").split(".")
    module = parts[-1]
    if module not in SUPPORTED_MODULES:
        raise UnsupportedTargetModuleError(
            f"LoRA adapter {name!r}: tensor {key!r} adapts {module!r}; the engine adapts only "
            f"{', '.join(SUPPORTED_MODULES)}",
            name,
        )
    layer = None
    for i in range(len(parts) - 2, 0, -1):
        if parts[i].isdigit() and parts[i - 1] in ("layers", "h", "blocks"):
            layer = int(parts[i])
            break
    if layer is None:
        raise CorruptLoRAWeightsError(
            f"LoRA adapter {name!r}: cannot find a layer index in tensor name {key!r}", name
        )
    return layer, module, m.group("ab")


def _collect(
    tensors: dict[str, torch.Tensor], cfg: _Config, spec: LoRAModelSpec, name: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        layer, module, ab = _classify(key, name)  # type: ignore[misc]
        if layer >= spec.num_layers:
            raise LoRAShapeError(
                f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer} but the model has "
                f"{spec.num_layers} layers",
                name,
            )
        slot = halves.setdefault((layer, module), {})
        if ab in slot:
            raise CorruptLoRAWeightsError(
                f"LoRA adapter {name!r}: two lora_{ab} tensors for layer {layer} {module}", name
            )
        slot[ab] = t

    found = set(halves)
    missing = sorted(cfg.expected - found)
    if missing:
        raise CorruptLoRAWeightsError(
            f"LoRA adapter {name!r}: the weight file lacks {len(missing)} module(s) that "
            f"target_modules selects, e.g. layer {missing[0][0]} {missing[0][1]}",
            name,
        )
    extra = sorted(found - cfg.expected)
    if extra:
        raise CorruptLoRAWeightsError(
            f"LoRA adapter {name!r}: the weight file has weights for {len(extra)} module(s) that "
            f"target_modules does not select, e.g. layer {extra[0][0]} {extra[0][1]}",
            name,
        )

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    r = cfg.rank
    for (layer, module), slot in sorted(halves.items(), key=_order):
        for ab in ("A", "B"):
            if ab not in slot:
                raise CorruptLoRAWeightsError(
                    f"LoRA adapter {name!r}: layer {layer} {module} has no lora_{ab} weight", name
                )
        a, b = slot["A"], slot["B"]
        out_f, in_f = spec.module_shapes[module]
        if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
            raise LoRAShapeError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}; this model with r={r} needs lora_A {(r, in_f)} and "
                f"lora_B {(out_f, r)}",
                name,
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise CorruptLoRAWeightsError(
                f"LoRA adapter {name!r}: layer {layer} {module} weights are not floating point "
                f"({a.dtype}, {b.dtype})",
                name,
            )
        a = a.to(torch.float32).contiguous()
        b = b.to(torch.float32).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise CorruptLoRAWeightsError(
                f"LoRA adapter {name!r}: layer {layer} {module} weights contain NaN or inf", name
            )
        weights[(layer, module)] = (a, b)
    return weights


def _order(item: tuple[tuple[int, str], Any]) -> tuple[int, int]:
    (layer, module), _ = item
    return layer, SUPPORTED_MODULES.index(module)


# ----------------------------------------------------------------------------------------


def load_adapter(lora_path: str, name: str, spec: LoRAModelSpec) -> LoRAAdapter:
    """Load and fully validate a PEFT LoRA adapter; raise a `LoRAError` subclass on any problem."""
    folder = resolve_adapter_dir(lora_path, name)
    cfg = _parse_config(_read_config(folder, name), spec, name)
    weights = _collect(_read_weights(folder, name), cfg, spec, name)
    scaling = cfg.alpha / math.sqrt(cfg.rank) if cfg.use_rslora else cfg.alpha / cfg.rank
    present = {module for _, module in weights}
    return LoRAAdapter(
        name=name,
        rank=cfg.rank,
        lora_alpha=cfg.alpha,
        scaling=scaling,
        target_modules=[m for m in SUPPORTED_MODULES if m in present],
        weights=weights,
        source=lora_path,
        use_rslora=cfg.use_rslora,
    )


__all__ = [
    "LoRAAdapter",
    "LoRAModelSpec",
    "SUPPORTED_MODULES",
    "load_adapter",
    "resolve_adapter_dir",
]
