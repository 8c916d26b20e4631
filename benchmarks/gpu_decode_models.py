"""Pieces of benchmarks/gpu_decode_check.py's engine parts: random-weight models and PEFT
adapters written without building an HF model, the engine's graph-replayed decode path on any
device, and decode steps over hand-made rows outside the scheduler (decode_rows + decode_step:
the model runner's staging, graph replay or eager forward, and logits)."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING
from unittest import mock

import torch

from benchmarks.common import sync
from engine import LLMEngine, LoRARequest
from engine.cuda_graphs import EagerGraph
from engine.decode_inputs import capture_sizes
from engine.model_runner import order_by_slot
from engine.models.llama import ModelArgs
from engine.models.loader import build_model, load_model_config
from engine.static_decode import StaticDecode
from raylora_kernels.paged_attention import paged_decode_attention_op

if TYPE_CHECKING:
    from benchmarks.gpu_decode_check import Context

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---- models and adapters -------------------------------------------------------------------


def smollm2_checkpoint(ctx: Context) -> Path:
    """A random SmolLM2-shaped checkpoint with the tiny test tokenizer (once per run)."""
    from tests.model_fixtures import make_tiny_llama

    if "smollm2" not in ctx.state:
        ctx.state["smollm2"] = make_tiny_llama(ctx.tmp / "smollm2", **ctx.scale.smollm2)
    return ctx.state["smollm2"]


def shape_only_checkpoint(path: Path, config: dict) -> Path:
    """config.json of these shapes, the tiny test tokenizer and a placeholder weight file (the
    loader checks that one exists): the weights come from random_weights(), on the device."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tests.model_fixtures import BOS_ID, EOS_ID, make_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    hf_config = LlamaConfig(**config, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    hf_config.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    save_file({"placeholder": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


@contextmanager
def random_weights(seed: int = 0) -> Iterator[None]:
    """ModelRunner builds its model with random weights made on its device (norms 1, the rest
    N(0, 0.02)) instead of reading the checkpoint: 16 GB of Llama-3-8B in a fraction of a
    second, nothing written to disk."""
    import engine.model_runner

    def load(path: Path, args: ModelArgs, device: torch.device, dtype: torch.dtype):
        model = build_model(args, device, dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # the RMSNorm weights (a Llama has no biases)
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        return model.eval()

    with mock.patch.object(engine.model_runner, "load_model", load):
        yield


def write_random_adapter(
    folder: Path, args: ModelArgs, rank: int, targets: list[str], seed: int
) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) of random A, B in
    bf16, written directly: no HF model is built (Llama-3-8B's would be 16 GB on the host)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    gen, shapes, tensors = torch.Generator().manual_seed(seed), args.lora_module_shapes(), {}
    for layer in range(args.num_layers):
        for m in targets:
            out_f, in_f = shapes[m]
            parent = "self_attn" if m in _ATTN else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"  # PEFT's names
            a = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            b = torch.randn(out_f, rank, generator=gen) * 0.02  # small: outputs stay model-like
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def random_loras(
    ctx: Context, path: Path, tag: str, specs: list[tuple[int, list[str]]]
) -> list[LoRARequest]:
    """One random adapter per (rank, target modules), for the checkpoint in `path`."""
    args = ModelArgs.from_hf_config(load_model_config(path))
    loras = []
    for i, (rank, targets) in enumerate(specs):
        folder = write_random_adapter(ctx.tmp / f"{tag}-{i}", args, rank, targets, seed=i)
        loras.append(LoRARequest(f"{tag}-{i}", i + 1, str(folder)))
    return loras


# ---- decode steps outside the scheduler ----------------------------------------------------


def graphed(engine: LLMEngine) -> StaticDecode:
    """The engine's graph-replayed decode path: its own CUDA graphs on a GPU; on the CPU the
    same StaticDecode over EagerGraph at the same capture sizes, with the Triton paged
    attention (interpreted) that CUDA runs in place of the C++ or SDPA one."""
    runner, cfg = engine.model_runner, engine.config
    if runner.device.type == "cuda":
        assert runner.static_decode is not None and runner.static_decode.graphs is not None
        return runner.static_decode
    runner.decode_attention = paged_decode_attention_op
    runner.model.fused_layers_op = None
    sizes = capture_sizes(cfg.max_num_seqs)
    sd = StaticDecode(runner, paged_decode_attention_op, cfg.max_model_len, EagerGraph, sizes)
    runner.static_decode = sd
    return sd


def decode_rows(
    contexts: list[int], slots: list[int], blocks: list[int], block_size: int, rng: random.Random
) -> list[tuple[object, int]]:
    """(scheduled-like row, LoRA slot) pairs for StaticDecode.run, in the model runner's order
    (order_by_slot): row i decodes position contexts[i] - 1 over blocks of its own, the next
    ones of `blocks`, a random token."""
    rows, used = [], 0
    for length, slot in zip(contexts, slots, strict=True):
        n = -(-length // block_size)
        if used + n > len(blocks):
            raise ValueError(f"{sum(contexts)} positions need more than {len(blocks)} KV blocks")
        seq = SimpleNamespace(
            token_ids=[rng.randrange(3, 300)] * length,  # only the last one is read
            num_computed_tokens=length - 1,
            block_table=blocks[used : used + n],
        )
        used += n
        rows.append((SimpleNamespace(seq=seq), slot))
    return order_by_slot(rows)


@torch.inference_mode()
def decode_step(sd: StaticDecode, ordered: list[tuple[object, int]]) -> torch.Tensor:
    """The runner's decode step less the scheduler and sampler: stage, replay (or run
    eagerly), logits [n, vocab] fp32, greedy ids back on the host (the step's one sync)."""
    _, hidden = sd.run(ordered)
    logits = sd.runner.model.compute_logits(hidden)
    logits.argmax(-1).tolist()  # the sync: a step ends when its ids are on the host
    return logits


def median_time(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def lora_mix(kind: str, n: int, num_slots: int, rng: random.Random) -> list[int]:
    if kind == "base":
        return [-1] * n
    if kind == "one":
        return [num_slots - 1] * n
    if kind == "distinct":  # every slot and base, round robin
        return [i % (num_slots + 1) - 1 for i in range(n)]
    if kind == "skewed":
        return [-1 if i % 6 == 5 else 0 if i % 4 else 1 for i in range(n)]
    return [rng.randrange(-1, num_slots) for _ in range(n)]
