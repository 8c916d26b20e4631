"""Load and validate a PEFT LoRA adapter for a Llama-family base model.

`load_adapter(lora_path, name, spec)` reads a PEFT folder (adapter_config.json +
adapter_model.safetensors, or adapter_model.bin) or a Hugging Face Hub repo id, checks
everything the engine relies on, and returns a `LoRAAdapter` with fp32, unscaled
A [r, in] / B [out, r] tensors per (layer, module). Any problem raises a specific
`engine.lora.errors` exception before anything is returned, so the engine can load an
adapter without evicting or touching anything else first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import hub, remote
from engine.lora.errors import LoRANotFoundError
from engine.lora.peft_config import (
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_NAME,
    SUPPORTED_MODULES,
    LoRAModelSpec,
    parse_config,
    read_config,
)
from engine.lora.peft_weights import collect_weights, read_weights


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
    # The adapter as loaded, for prefix caching: a content hash of what it computes (set by
    # LoRAManager). A name reloaded with other weights gets another; the same weights the same.
    identity: str | None = None

    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.weights.values()
        )

    @property
    def layers(self) -> list[int]:
        """The layer indices that have at least one adapted module."""
        return sorted({layer for layer, _ in self.weights})

    def __reduce__(self):
        """Pickled as one byte buffer holding every weight, plus an index of (dtype, shape,
        offset): under pickle protocol 5 (Ray's) the buffer travels out of band, one copy
        into the object store. Pickled tensor by tensor, the 2 x layers x modules tensors of
        a 20 MB adapter cost 50-95 ms of CPU under the GIL per ray.put (the shared tier's
        offers: the replica's steps waited on them), one buffer 7-16 ms."""
        flat, index = _pack_weights(self.weights)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["weights"]
        return (_unpack_adapter, (fields, index, flat))


_PACK_ALIGN = 64  # bytes: each weight starts aligned in the buffer, whatever its dtype
# per (layer, module): ((dtype name, shape, byte offset) of A, the same of B)
PackIndex = list[tuple[Any, list[tuple[str, tuple[int, ...], int]]]]


def _pack_weights(weights: dict) -> tuple[np.ndarray, PackIndex]:
    """Every weight's bytes in one uint8 array, and where each one lies in it."""
    index: PackIndex = []
    parts: list[torch.Tensor] = []
    offset = 0
    for key, pair in weights.items():
        entry = []
        for w in pair:
            w = w.detach().cpu().contiguous()
            nbytes = w.numel() * w.element_size()
            entry.append((str(w.dtype).removeprefix("torch."), tuple(w.shape), offset))
            parts.append(w.reshape(-1).view(torch.uint8))
            pad = -nbytes % _PACK_ALIGN
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
            offset += nbytes + pad
        index.append((key, entry))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat.numpy(), index


def _unpack_adapter(fields: dict, index: PackIndex, flat: np.ndarray) -> LoRAAdapter:
    """The adapter `__reduce__` packed: its weights are views of one buffer this process owns
    (an out-of-band buffer is the object store's memory: read-only, and not this adapter's
    to keep)."""
    buf = torch.from_numpy(np.array(flat, dtype=np.uint8, copy=True))
    weights = {}
    for key, entry in index:
        pair = []
        for dtype_name, shape, offset in entry:
            dtype = getattr(torch, dtype_name)
            nbytes = math.prod(shape) * dtype.itemsize
            pair.append(buf[offset : offset + nbytes].view(dtype).view(shape))
        weights[key] = tuple(pair)
    return LoRAAdapter(weights=weights, **fields)


# ----------------------------------------------------------------------------------------
# Finding the adapter


# what a PEFT adapter folder holds that the loader reads (a Hub snapshot or an object-storage
# copy fetches only these; source_stamp identifies the folder by them)
ADAPTER_FILES = (CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME)


def resolve_adapter_dir(lora_path: str, name: str) -> Path:
    """The local folder of the adapter: the folder itself, a Hub snapshot, or a local copy
    of an object-storage folder (`s3://...`, engine/remote.py)."""
    if not isinstance(lora_path, str) or not lora_path.strip():
        raise LoRANotFoundError(f"LoRA adapter {name!r}: empty lora_path", name)
    if remote.is_url(lora_path):
        try:
            what = f"LoRA adapter {name!r}"
            return remote.fetch_folder(lora_path, list(ADAPTER_FILES), CONFIG_NAME, what)
        except FileNotFoundError as e:
            raise LoRANotFoundError(str(e), name) from e
    expanded = Path(os.path.expanduser(lora_path))
    if expanded.is_dir():
        return expanded
    if expanded.exists():
        raise LoRANotFoundError(
            f"LoRA adapter {name!r}: {lora_path!r} is a file, expected a PEFT adapter folder", name
        )
    if hub.looks_like_local_path(lora_path):
        raise LoRANotFoundError(f"LoRA adapter {name!r}: folder {lora_path!r} does not exist", name)
    return _download_from_hub(lora_path, name)


def _download_from_hub(repo_id: str, name: str) -> Path:
    """A Hub adapter's snapshot (config and weights only). Any failure, the network's or an
    invalid id's too, is the adapter not found: a request naming it gets a 404, not a 500."""
    what = f"LoRA adapter {name!r}: {repo_id!r}"
    try:
        return hub.snapshot(repo_id, what, list(ADAPTER_FILES))
    except FileNotFoundError as e:
        raise LoRANotFoundError(str(e), name) from e
    except Exception as e:  # HFValidationError, the network
        where = "in the local Hugging Face cache" if hub.hub_offline() else "on the Hub"
        raise LoRANotFoundError(
            f"{what} is neither a local folder nor a repo found {where}: {type(e).__name__}: {e}",
            name,
        ) from e


# A file whose last change is newer than this may change again without its stamp changing
# (a file system's timestamps tick coarsely): such a folder gets no stamp (git's "racy" rule).
RACY_S = 2.0


def source_stamp(lora_path: str) -> tuple | None:
    """What identifies the contents of a local adapter folder's files without reading them:
    (inode, device, size, mtime ns, ctime ns) of adapter_config.json and of each weights
    file, None for one that is missing. The kernel sets a file's ctime at every write and no
    call sets it back, so an equal stamp means the same bytes, except for a file changed
    within a clock tick of the stamp: None if any file changed in the last RACY_S seconds,
    or if `lora_path` is not a local folder."""
    folder = Path(os.path.expanduser(lora_path)) if isinstance(lora_path, str) else None
    if folder is None or not folder.is_dir():
        return None
    recent = time.time_ns() - int(RACY_S * 1e9)
    stamp = []
    for file in ADAPTER_FILES:
        try:
            st = os.stat(folder / file)
        except FileNotFoundError:
            stamp.append(None)
            continue
        except OSError:
            return None
        if max(st.st_mtime_ns, st.st_ctime_ns) > recent:
            return None
        stamp.append((st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(stamp)


# ----------------------------------------------------------------------------------------


def load_adapter(
    lora_path: str, name: str, spec: LoRAModelSpec, folder: Path | None = None
) -> LoRAAdapter:
    """Load and fully validate a PEFT LoRA adapter; raise a `LoRAError` subclass on any problem.
    folder: where `lora_path` was resolved to already (resolve_adapter_dir), if it was."""
    folder = folder or resolve_adapter_dir(lora_path, name)
    cfg = parse_config(read_config(folder, name), spec, name)
    weights = collect_weights(read_weights(folder, name), cfg, spec, name)
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
    "source_stamp",
]
