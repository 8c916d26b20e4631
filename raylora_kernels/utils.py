"""Shared host-side helpers: argument checks, backend choice, lazy Triton JIT."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raylora_kernels.metadata import LoRABatchMeta, StaticLoRAMeta

try:
    import triton

    HAS_TRITON = True
except ImportError:  # e.g. macOS: the torch path still works
    triton = None
    HAS_TRITON = False

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "torch", "triton")


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class LazyJit:
    """`triton.jit(fn)`, decided at launch time instead of import time.

    `@triton.jit` reads TRITON_INTERPRET when it decorates (at import), so a process
    that imported `raylora_kernels` before setting the variable would keep compiled kernels
    and fail on CPU tensors. Decorating on first launch, once per mode, makes
    `os.environ["TRITON_INTERPRET"] = "1"` work at any point before the call.
    Caveat: triton's own @jit helpers (`tl.cdiv`, `tl.zeros`, `tl.sum`, ...) were decorated when
    triton was imported, so our kernels call only builtins (`tl.load`, `tl.dot`, ...).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._by_mode: dict[bool, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        mode = interpret_mode()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            assert HAS_TRITON, "backend='triton' needs the triton package"
            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel[grid]


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast tiles to fp32 before `tl.dot`: for fp32 inputs (an
    exact "ieee" dot, not tf32), and for bf16 under the interpreter, whose numpy dot
    multiplies bf16 tiles as their raw uint16 bits (triton 3.x)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpret_mode())


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    assert backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}"
    if backend == "auto":
        return "triton" if x.is_cuda and HAS_TRITON else "torch"
    if backend == "triton":
        assert x.is_cuda or interpret_mode(), (
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1"
        )
    return backend


_TABLES: dict[tuple, torch.Tensor] = {}


def device_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows), S] tensor of per-slice values (weight data_ptrs, widths, ...).

    Cached by value: the engine's slot weights live at fixed addresses, so after the
    first step no launch pays a host-to-device copy. Keyed by the values themselves,
    so a hit is always correct."""
    key = (tuple(tuple(r) for r in rows), str(device))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 256:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(rows, dtype=torch.int64, device=device)
    return table


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_weights(
    name: str, ws: Sequence[torch.Tensor], device: torch.device, shared_dims: tuple[int, ...]
) -> None:
    """Per-slice weights: 3-D, one dtype, one device. Contiguous tensors or views of one packed
    tensor (raylora_kernels.SlotWeights) both work: the kernels take the strides of ws[0] for
    `shared_dims`, so every slice must have those strides."""
    assert isinstance(ws, (list, tuple)) and len(ws) > 0, (
        f"{name} must be a non-empty list of per-slice tensors"
    )
    for s, w in enumerate(ws):
        assert w.dim() == 3, f"{name}[{s}] must be 3-D, got shape {tuple(w.shape)}"
        assert w.dtype in DTYPES, f"{name}[{s}] dtype {w.dtype} not in {DTYPES}"
        assert w.dtype == ws[0].dtype, f"{name}[{s}] dtype {w.dtype} != {name}[0] {ws[0].dtype}"
        assert all(w.stride(d) == ws[0].stride(d) for d in shared_dims), (
            f"{name}[{s}] strides {w.stride()} != {name}[0] strides {ws[0].stride()} "
            f"in dims {shared_dims}"
        )
        assert w.device == device, f"{name}[{s}] on {w.device}, inputs on {device}"


def _check_meta(
    meta: LoRABatchMeta | StaticLoRAMeta, num_tokens: int, device: torch.device
) -> None:
    assert meta.num_tokens == num_tokens, (
        f"meta was built for {meta.num_tokens} tokens, inputs have {num_tokens}"
    )
    assert meta.sorted_token_ids.device == device, (
        f"meta on {meta.sorted_token_ids.device}, inputs on {device}"
    )


def check_shrink_args(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRABatchMeta | StaticLoRAMeta,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Asserts the shrink contract; returns `out` (zeros [S, T, R] fp32 if None)."""
    assert x.dim() == 2, f"x must be [T, H_in], got shape {tuple(x.shape)}"
    assert x.dtype in DTYPES, f"x dtype {x.dtype} not in {DTYPES}"
    assert x.stride(1) == 1, f"x rows must be contiguous, got strides {x.stride()}"
    num_tokens, hidden_in = x.shape
    _check_weights("lora_a", lora_a, x.device, shared_dims=(0, 1, 2))
    num_slots, rank, _ = lora_a[0].shape
    for s, a in enumerate(lora_a):
        assert a.shape == (num_slots, rank, hidden_in), (
            f"lora_a[{s}] must be [L={num_slots}, R={rank}, H_in={hidden_in}], got {tuple(a.shape)}"
        )
    assert lora_a[0].dtype == x.dtype, f"lora_a dtype {lora_a[0].dtype} != x dtype {x.dtype}"
    _check_meta(meta, num_tokens, x.device)
    shape = (len(lora_a), num_tokens, rank)
    if out is None:
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    assert tuple(out.shape) == shape, f"out must be [S, T, R]={shape}, got {tuple(out.shape)}"
    assert out.dtype in DTYPES, f"out dtype {out.dtype} not in {DTYPES}"
    assert out.is_contiguous(), "out must be contiguous"
    assert out.device == x.device, f"out on {out.device}, x on {x.device}"
    return out


def check_expand_args(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRABatchMeta | StaticLoRAMeta,
    y: torch.Tensor,
    offsets: Sequence[int] | None,
) -> list[int]:
    """Asserts the expand contract; returns the column offset of each slice in y."""
    assert buf.dim() == 3, f"buf must be [S, T, R], got shape {tuple(buf.shape)}"
    assert buf.dtype in DTYPES, f"buf dtype {buf.dtype} not in {DTYPES}"
    assert buf.is_contiguous(), "buf must be contiguous"
    assert y.dim() == 2, f"y must be [T, H_out], got shape {tuple(y.shape)}"
    assert y.dtype in DTYPES, f"y dtype {y.dtype} not in {DTYPES}"
    assert y.stride(1) == 1, f"y rows must be contiguous, got strides {y.stride()}"
    num_slices, num_tokens, rank = buf.shape
    assert y.shape[0] == num_tokens, f"y has {y.shape[0]} rows, buf has {num_tokens} tokens"
    _check_weights("lora_b", lora_b, y.device, shared_dims=(1, 2))  # stride(0): a table
    assert buf.device == y.device, f"buf on {buf.device}, y on {y.device}"
    assert len(lora_b) == num_slices, f"buf has {num_slices} slices, lora_b has {len(lora_b)}"
    num_slots = lora_b[0].shape[0]
    for s, b in enumerate(lora_b):
        assert b.shape[0] == num_slots and b.shape[2] == rank, (
            f"lora_b[{s}] must be [L={num_slots}, H_out_s, R={rank}], got {tuple(b.shape)}"
        )
    widths = [b.shape[1] for b in lora_b]
    if offsets is None:
        assert sum(widths) == y.shape[1], (
            f"y has {y.shape[1]} columns, slices sum to {sum(widths)} (pass offsets?)"
        )
        offsets = [sum(widths[:s]) for s in range(num_slices)]
    offsets = [int(o) for o in offsets]
    assert len(offsets) == num_slices, f"{len(offsets)} offsets for {num_slices} slices"
    for s, (o, w) in enumerate(zip(offsets, widths, strict=True)):
        assert 0 <= o and o + w <= y.shape[1], (
            f"slice {s} columns [{o}, {o + w}) out of y's {y.shape[1]} columns"
        )
    _check_meta(meta, num_tokens, y.device)
    return offsets
