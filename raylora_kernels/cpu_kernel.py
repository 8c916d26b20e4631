"""raylora's C++ CPU kernels (raylora_kernels/csrc/: lora_cpu.cpp, linear_cpu.cpp, packed_cpu.cpp,
attention_cpu.cpp, prefill_attention_cpu.cpp, elementwise_cpu.cpp, layers_cpu.cpp,
sample_cpu.cpp, head_cpu.cpp),
built on first use with torch's cpp_extension (g++ and ninja) and cached on disk; None where
they cannot be built.

    op = cpu_lora_op()          # torch.ops.raylora_cpu.lora_add, or None
    op(x, a, b_t, segments, widths, ranks, y)           # y += the LoRA of x
    y = cpu_linear_lora_op()(x, weight, bias, a, b_t, segments, widths, ranks)  # linear too
    y = cpu_linear_op()(x, weight, bias)                # F.linear, decode batches faster
    y = cpu_linear_packed_op()(x, pw.data, pw.out_features, bias)   # on a PackedWeight
    y = cpu_linear_lora_packed_op()(x, pw.data, pw.out_features, bias, a, b_t, ...)
    cpu_decode_attention_op(H, Hkv, D)(q, rows, k_cache, v_cache, tables, lens, bs, scale, out)
(ranks: SlotWeights.ranks, the rows each slot's slices hold, or None for all of them)

The torch path of `lora_linear` uses the LoRA kernel for decode-shaped batches (few tokens per
adapter), where reading every active adapter's weights is the whole cost and torch's batched
GEMM reads the expand's weights at about half the memory bandwidth. A float32 CPU model's
linears (base layers, lm_head) are packed once at load (raylora_kernels/packed_weight.py) and run on
`linear_packed` at any batch size: faster than MKL here at 1-2048 rows, most at decode's few
rows, where BLAS repacks the weight on every call. `linear` (the column-split sgemm) serves
plain float32 weights. Everything else stays on torch ops, and so does everything
when the kernels are off:
  RAYLORA_CPU_KERNEL=0   never build or use them (the pure torch path);
  a failed build         logs one warning and falls back to the torch path.
It is compiled with -march=native, so the cache folder's name carries a hash of the CPU's
feature flags: machines sharing a home directory never load each other's build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / f
    for f in (
        "lora_cpu.cpp",
        "linear_cpu.cpp",
        "packed_cpu.cpp",
        "attention_cpu.cpp",
        "prefill_attention_cpu.cpp",
        "elementwise_cpu.cpp",
        "layers_cpu.cpp",
        "sample_cpu.cpp",
        "head_cpu.cpp",
    )
]
_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("RAYLORA_CPU_KERNEL", "1") != "0"


def _cpu_tag() -> str:
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _headers_tag() -> str:
    """A hash of csrc's headers. cpp_extension rebuilds when a source file or a flag changes,
    not when only an included header does: this goes into the flags."""
    h = hashlib.sha1()
    for p in sorted(_CSRC.glob("*.h")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:12]


def _build() -> object:
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, for processes whose PATH lacks the venv's bin folder
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    name = f"raylora_cpu_{_cpu_tag()}"
    try:  # only to say whether this is the slow first build
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        fresh = not any(build_dir.glob("*.so"))
    except Exception:
        fresh = True
    if fresh:
        log.warning("raylora: compiling the CPU LoRA kernel (once per machine, ~15 s)")
    t0 = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=[str(p) for p in _SOURCES],
        # -fopenmp: at::parallel_for is an OpenMP loop in the header; without it, one thread
        extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DRAYLORA_HEADERS={_headers_tag()}"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    if fresh:
        log.warning("raylora: CPU LoRA kernel built in %.1f s", time.perf_counter() - t0)
    return torch.ops.raylora_cpu


def _ops() -> object | None:
    """The kernel's ops namespace, built on the first call (thread-safe); None if off or
    unbuildable."""
    if not enabled():
        return None
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                try:
                    _state["ops"] = _build()
                except Exception as e:  # no compiler, no headers, a failed build: torch path
                    log.warning("raylora: CPU LoRA kernel unavailable, using torch ops: %s", e)
                    _state["ops"] = None
    return _state["ops"]


def cpu_lora_op() -> Callable[..., None] | None:
    """`lora_add(x, a, b_t, segments, widths, ranks, y)`: y += the LoRA of x; None if off."""
    ops = _ops()
    return None if ops is None else ops.lora_add


def cpu_linear_op() -> Callable[..., torch.Tensor] | None:
    """`linear(x, weight, bias)`: F.linear, with float32 decode-sized batches (at most 128
    rows) split by output columns between the threads, one single-threaded BLAS call each
    (csrc/linear_cpu.cpp: 1.04-1.95x faster than F.linear here); None if off."""
    ops = _ops()
    return None if ops is None else ops.linear


def cpu_linear_lora_op() -> Callable[..., torch.Tensor] | None:
    """`linear_lora(x, weight, bias, a, b_t, segments, widths, ranks)`: F.linear(x, weight, bias)
    plus the LoRA of x, one call; None if off."""
    ops = _ops()
    return None if ops is None else ops.linear_lora


def cpu_linear_packed_op() -> Callable[..., torch.Tensor] | None:
    """`linear_packed(x, packed, N, bias)`: F.linear on a PackedWeight's data; None if off."""
    ops = _ops()
    return None if ops is None else ops.linear_packed


def cpu_linear_lora_packed_op() -> Callable[..., torch.Tensor] | None:
    """`linear_lora_packed(x, packed, N, bias, a, b_t, segments, widths, ranks)`: the packed
    linear plus the LoRA of x, one call; None if off."""
    ops = _ops()
    return None if ops is None else ops.linear_lora_packed


def cpu_decode_attention_op(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[..., None] | None:
    """`paged_decode_attention(q, rows, k_cache, v_cache, tables, lens, block_size, scale,
    out)`: float32 decode attention over the paged KV cache, read in place
    (csrc/attention_cpu.cpp); None if off or if it has no build for these head counts and
    head_dim (H / Hkv up to 8; head_dim 64 or 128)."""
    ops = _ops()
    if ops is None or not ops.decode_attention_supported(num_heads, num_kv_heads, head_dim):
        return None
    return ops.paged_decode_attention


def cpu_prefill_attention_op(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[..., None] | None:
    """`paged_prefill_attention(q, k_cache, v_cache, chunks, tables, bs, scale, out)`: float32
    causal attention of prefill chunks over the paged KV cache, read in place
    (csrc/prefill_attention_cpu.cpp; chunks [C, 3] int64 = first row, tokens, first position);
    None if off or if it has no build for these head counts and head_dim."""
    ops = _ops()
    if ops is None or not ops.prefill_attention_supported(num_heads, num_kv_heads, head_dim):
        return None
    return ops.paged_prefill_attention


def cpu_forward_layers_op() -> Callable[..., torch.Tensor] | None:
    """`forward_layers(x, cos, sin, weights, biases, k_caches, v_caches, slots, decode_rows,
    decode_tables, decode_lens, prefill_chunks, prefill_tables, dims, eps, scale, lora,
    lora_ranks, segments)`: every decoder layer of a batch of decode tokens and prefill chunks
    in one call (csrc/layers_cpu.cpp; packed float32 weights); None if off."""
    ops = _ops()
    return None if ops is None else ops.forward_layers


def cpu_elementwise_ops() -> tuple[Callable[..., torch.Tensor], Callable[..., tuple]] | None:
    """(`silu_and_mul(gate_up, intermediate)`, `rope_qk(qkv, cos, sin, H, Hkv, D)`): the
    decoder layer's activation and rope as one float32 pass each, for the Python layers
    (prefill, LoRA batches), where torch's ops make 2 and 8 passes and as many temporaries
    (csrc/elementwise_cpu.cpp); None if off."""
    ops = _ops()
    return None if ops is None else (ops.silu_and_mul, ops.rope_qk)


def cpu_argmax_op() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`argmax_rows(x)`: torch.argmax(x, -1) of float32 [T, V] logits (the first of equal
    maxima, a row's first NaN if it has one), vectorised (csrc/sample_cpu.cpp); None if off."""
    ops = _ops()
    return None if ops is None else ops.argmax_rows


def cpu_greedy_head_op() -> Callable[..., torch.Tensor] | None:
    """`greedy_head(x, packed, packed16, wnorm, N)`: the ids argmax(linear_packed(x, packed, N))
    gives, bit for bit, from a bfloat16 screen and an exact recheck (csrc/head_cpu.cpp); None
    if off, if this build has no AVX512-BF16, or with RAYLORA_GREEDY_HEAD=0 (A/B runs)."""
    ops = _ops()
    if ops is None or os.environ.get("RAYLORA_GREEDY_HEAD", "1") == "0":
        return None
    return ops.greedy_head if bool(ops.greedy_head_native()) else None


def packed_gemm_fast() -> bool:
    """Whether the packed GEMM was built with AVX-512, the only ISA it is measured on (its
    register tile needs AVX-512's 32 registers); the engine packs its weights only then."""
    ops = _ops()
    return ops is not None and bool(ops.packed_native())
