"""GPU memory planning: how many KV cache blocks fit (vLLM's gpu_memory_utilization).

On CUDA, unless ``num_kv_blocks`` is given, the engine sizes its KV cache the way vLLM does:

1. before loading anything, ``MemorySnapshot.take(device)``: free and total device memory
   (``torch.cuda.mem_get_info``) and what torch already holds;
2. the model and the max_loras LoRA slots are allocated: ``model_bytes`` is the growth of
   ``torch.cuda.memory_allocated``;
3. ``profile_run``: one dummy prefill forward of max_num_batched_tokens tokens (LoRA on
   when enabled) and the logits of max_num_seqs rows; ``peak_activation_bytes`` is the peak of
   ``torch.cuda.max_memory_allocated`` over it;
4. ``plan_kv_blocks``: with ``budget = total * gpu_memory_utilization``,
       num_kv_blocks = floor((budget - in_use_before - model - peak_activations - non_torch)
                             / bytes_per_block)
   where ``in_use_before = total - free`` at step 1 (other processes, the CUDA context: what
   is not ours counts against the budget) and ``non_torch`` is what device memory grew by
   outside torch's allocator since step 1 (cuBLAS workspaces, Triton modules).

The CPU has no such accounting: there the KV cache is ``kv_cache_memory_gb`` (as vLLM's CPU
backend takes VLLM_CPU_KVCACHE_SPACE), and ``gpu_memory_utilization`` is not used. Once the
model is loaded and packed, ``release_host_heap`` hands the heap that loading freed (the
unpacked weights, the checkpoint's buffers) back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import ForwardContext, LlamaForCausalLM
from raylora_kernels import LoRABackend, LoRABatchMeta

GiB = 2**30
MemGetInfo = Callable[[], tuple[int, int]]  # () -> (free bytes, total bytes)


def release_host_heap() -> None:
    """glibc's malloc_trim(0): return the freed parts of the process heap to the OS. Loading a
    float32 model frees its unpacked weights and the checkpoint's buffers in pieces that glibc
    keeps for reuse (111 MB of SmolLM2-135M's load here); nothing will reuse them. A no-op off
    glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        pass


class KVCacheMemoryError(RuntimeError):
    """Not even one KV block fits in the memory budget; ``plan`` holds every number."""

    def __init__(self, message: str, plan: MemoryPlan) -> None:
        super().__init__(message)
        self.plan = plan


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """Device memory before the engine allocates anything."""

    free_bytes: int
    total_bytes: int
    torch_allocated_bytes: int  # torch.cuda.memory_allocated: live tensors
    torch_reserved_bytes: int  # torch.cuda.memory_reserved: the caching allocator's pool

    @staticmethod
    def take(device: torch.device) -> MemorySnapshot:
        """The CUDA device's numbers, with torch's unused cached blocks released first (so
        they are neither counted as in use nor counted twice)."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return MemorySnapshot(
            free,
            total,
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
        )

    @property
    def non_torch_bytes(self) -> int:
        """In use on the device but not by this process's torch allocator."""
        return self.total_bytes - self.free_bytes - self.torch_reserved_bytes


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Every number of the KV cache sizing, in bytes (see the module docstring)."""

    total_bytes: int
    utilization: float
    budget_bytes: int  # floor(total * utilization)
    in_use_before_bytes: int  # total - free before the engine loaded: not ours
    model_bytes: int  # weights + LoRA slots
    peak_activation_bytes: int  # the profiling forward's peak above the model
    non_torch_bytes: int  # device memory grown outside torch's allocator since the snapshot
    kv_cache_bytes: int  # what is left for the KV cache (negative: over budget)
    bytes_per_block: int
    num_kv_blocks: int

    def describe(self) -> str:
        return (
            f"GPU memory plan: {self.utilization:.2f} x {_gib(self.total_bytes)} total = "
            f"{_gib(self.budget_bytes)} budget - {_gib(self.in_use_before_bytes)} in use "
            f"before the engine (other processes, CUDA context) - {_gib(self.model_bytes)} "
            f"model weights and LoRA slots - {_gib(self.peak_activation_bytes)} peak "
            f"activations - {_gib(self.non_torch_bytes)} non-torch = "
            f"{_gib(self.kv_cache_bytes)} for the KV cache: {self.num_kv_blocks} blocks of "
            f"{self.bytes_per_block / 2**20:.2f} MiB"
        )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_kv_blocks(
    mem_get_info: MemGetInfo,
    utilization: float,
    model_bytes: int,
    peak_activation_bytes: int,
    bytes_per_block: int,
    *,
    baseline: MemorySnapshot,
    torch_reserved_bytes: int,
) -> MemoryPlan:
    """The number of KV blocks that fit, from the measured numbers (pure arithmetic).

    mem_get_info: () -> (free, total) of the device now, after the profiling forward
        (torch.cuda.mem_get_info, or a fake in tests).
    utilization: gpu_memory_utilization, in (0, 1].
    model_bytes: torch memory allocated by the model and the LoRA slots.
    peak_activation_bytes: the profiling forward's peak allocation above model_bytes.
    bytes_per_block: one block's K and V over all layers.
    baseline: the snapshot taken before the engine loaded anything.
    torch_reserved_bytes: torch.cuda.memory_reserved() now (to tell non-torch growth).
    Raises KVCacheMemoryError when not one block fits, ValueError for impossible inputs.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if model_bytes < 0 or peak_activation_bytes < 0:
        raise ValueError(
            f"measured memory cannot be negative: model {model_bytes}, "
            f"peak activations {peak_activation_bytes}"
        )
    free, total = mem_get_info()
    non_torch_now = total - free - torch_reserved_bytes
    non_torch = max(0, non_torch_now - baseline.non_torch_bytes)
    budget = int(baseline.total_bytes * utilization)
    in_use_before = baseline.total_bytes - baseline.free_bytes
    kv_bytes = budget - in_use_before - model_bytes - peak_activation_bytes - non_torch
    plan = MemoryPlan(
        total_bytes=baseline.total_bytes,
        utilization=utilization,
        budget_bytes=budget,
        in_use_before_bytes=in_use_before,
        model_bytes=model_bytes,
        peak_activation_bytes=peak_activation_bytes,
        non_torch_bytes=non_torch,
        kv_cache_bytes=kv_bytes,
        bytes_per_block=bytes_per_block,
        num_kv_blocks=max(0, kv_bytes // bytes_per_block),
    )
    if plan.num_kv_blocks < 1:
        raise KVCacheMemoryError(
            f"no room for the KV cache: {plan.describe()}; one block needs "
            f"{bytes_per_block} bytes. Raise gpu_memory_utilization (now {utilization}), "
            "lower max_num_batched_tokens (the profiling forward's size), max_loras or "
            "max_lora_rank, free the memory other processes hold, use a smaller dtype or "
            "model, or set num_kv_blocks explicitly.",
            plan,
        )
    return plan


class MemoryMeter(Protocol):
    """Allocation statistics of one device (CudaMeter; tests pass a CPU probe)."""

    def reset_peak(self) -> None: ...
    def allocated(self) -> int: ...
    def peak(self) -> int: ...


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def dummy_seq_lens(num_tokens: int, max_seq_len: int, max_num_seqs: int) -> list[int]:
    """The profiling batch: num_tokens split into as few sequences as max_seq_len allows (the
    longest prefills cost attention the most), at most max_num_seqs of them."""
    lens: list[int] = []
    while num_tokens > 0 and len(lens) < max_num_seqs:
        lens.append(min(num_tokens, max_seq_len))
        num_tokens -= lens[-1]
    return lens


@torch.inference_mode()
def profile_run(
    model: LlamaForCausalLM,
    *,
    num_tokens: int,
    max_seq_len: int,
    max_num_seqs: int,
    block_size: int,
    max_loras: int,
    lora_backend: LoRABackend,
    meter: MemoryMeter | None = None,
) -> int:
    """Run the largest step the engine can schedule; return its peak memory above the model.

    A dummy prefill of num_tokens tokens (dummy_seq_lens) through every layer, LoRA on in
    all max_loras slots (0: off; the slots must be allocated), writing into a scratch KV
    cache (allocated before the meter starts, so it is not counted: the real cache is planned
    separately), then the fp32 logits of max_num_seqs rows and their log_softmax (sampling and
    prompt logprobs). The layers' own caches are put back and everything it allocated is
    freed. Returns ``meter.peak() - meter.allocated()`` at the start; 0 without a meter (the
    CPU: the run still checks that the step executes).
    """
    device = model.embed_tokens.weight.device
    a = model.args
    lens = dummy_seq_lens(num_tokens, max_seq_len, max_num_seqs)
    total = sum(lens)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    starts = [sum(blocks_per_seq[:i]) for i in range(len(lens))]
    specs = [
        (0, n, list(range(s, s + b))) for n, s, b in zip(lens, starts, blocks_per_seq, strict=True)
    ]
    attn = [layer.self_attn for layer in model.layers]
    saved = [(m.k_cache, m.v_cache) for m in attn]
    shape = (sum(blocks_per_seq) * block_size, a.num_kv_heads, a.head_dim)
    dtype = model.embed_tokens.weight.dtype
    try:
        for m in attn:
            m.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            m.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        if meter is not None:
            meter.reset_peak()
            base = meter.allocated()
        _dummy_step(model, specs, total, max_num_seqs, block_size, max_loras, lora_backend)
        peak = meter.peak() - base if meter is not None else 0
    finally:
        for m, (k, v) in zip(attn, saved, strict=True):
            m.k_cache, m.v_cache = k, v
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return max(0, peak)


def _dummy_step(
    model: LlamaForCausalLM,
    specs: list[tuple[int, int, list[int]]],
    num_tokens: int,
    max_num_seqs: int,
    block_size: int,
    max_loras: int,
    lora_backend: LoRABackend,
) -> None:
    device = model.embed_tokens.weight.device
    lora = None
    if max_loras > 0:
        # every slot busy, tokens grouped by slot as the runner orders them
        slots = torch.arange(num_tokens, device=device) * max_loras // num_tokens
        lora = LoRABatchMeta.build(slots.to(torch.int32), max_loras)
    ctx = ForwardContext(
        attn=AttentionMetadata.build(specs, block_size, device),
        lora=lora,
        lora_backend=lora_backend,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for _, n, _ in specs])
    num_rows = min(num_tokens, max_num_seqs)
    rows = torch.arange(num_tokens - num_rows, num_tokens, device=device)
    hidden = model.hidden_states(input_ids, positions, ctx, rows)
    torch.log_softmax(model.compute_logits(hidden), dim=-1)
