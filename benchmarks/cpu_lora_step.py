"""The LoRA work of one CPU decode step, isolated: every LoRA linear of the model, against the
memory bandwidth, for the C++ CPU kernel and the torch ops.

    python benchmarks/cpu_lora_step.py                    # default model's shapes, issue 3 workload
    python benchmarks/cpu_lora_step.py --num-adapters 16 --rank 16 --tokens-per-adapter 2
    python benchmarks/cpu_lora_step.py --adapter-rank 8 --targets q_proj,v_proj  # smaller adapters

Random slot weights for every packed linear of the model (num_layers x qkv/o/gate_up/down),
as many active adapters as slots, tokens grouped by slot as the model runner orders them.
Three ways over the same weights, interleaved --repeats times in one process (medians):
  sum       `w.a.sum(); w.b_t.sum()`: reads the same bytes, no math (the bandwidth bound)
  kernel    the C++ CPU kernel (`raylora_cpu::lora_add`, raylora_kernels/cpu_kernel.py)
  bf16      the same kernel on bfloat16 copies of the weights (lora_dtype="bfloat16": half
            the bytes; its GB/s counts the fp32 bytes, i.e. it is the fp32-equivalent rate)
  torch     `lora_linear` on torch ops (RAYLORA_CPU_KERNEL=0)
With --adapter-rank below --rank (max_lora_rank: the slots' rank) or --targets a subset of the
modules, the adapters fill part of their slots (the rest zero, as the LoRA manager leaves it)
and two more rows compare what the kernel reads: `kernel` and `bf16` get the slots' ranks
(SlotWeights.ranks, as the engine passes them: rows past an adapter's rank and untargeted
slices are skipped), `padded` is the kernel without them (every row of every slot).
Decode with many adapters is bound by reading their weights, so kernel / sum is the figure
to watch. See docs/benchmarks.md (LoRA overhead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, machine, setup_threads  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default' or a local checkpoint folder")
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens-per-adapter", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--adapter-rank", type=int, default=None, help="default: --rank")
    p.add_argument("--targets", default=None, help="comma-separated HF modules; default: all")
    args = p.parse_args(argv)
    setup_threads(args.threads)

    import torch
    from tqdm import tqdm

    from engine.models.llama import PACKED_MODULES, ModelArgs
    from engine.models.loader import load_model_config, resolve_model
    from raylora_kernels import LoRABatchMeta, SlotWeights, lora_linear
    from raylora_kernels.cpu_kernel import cpu_lora_op

    op = cpu_lora_op()
    if op is None:
        raise SystemExit("the C++ CPU kernel is off or did not build (see the warning above)")
    margs = ModelArgs.from_hf_config(load_model_config(resolve_model(args.model)))
    shapes = margs.lora_module_shapes()  # HF module -> (out, in)
    n, r = args.num_adapters, args.rank
    ar = args.adapter_rank or r
    targets = args.targets.split(",") if args.targets else list(shapes)
    if ar > r or not set(targets) <= set(shapes):
        raise SystemExit(f"--adapter-rank must be <= --rank and --targets among {list(shapes)}")
    partial = ar < r or len(targets) < len(shapes)
    gen = torch.Generator().manual_seed(0)
    linears = []
    for _ in range(margs.num_layers):
        for modules in PACKED_MODULES.values():
            widths = [shapes[m][0] for m in modules]
            h_in = shapes[modules[0]][1]
            w = SlotWeights.zeros(n, r, h_in, widths)
            w.ranks = torch.tensor([[ar if m in targets else 0 for m in modules]] * n)
            for s in range(len(modules)):  # what the manager copies into a slot
                rank = int(w.ranks[0, s])
                w.lora_a[s][:, :rank] = torch.randn(n, rank, h_in, generator=gen) * h_in**-0.5
                w.lora_b[s][:, :, :rank] = torch.randn(n, widths[s], rank, generator=gen) * 0.02
            linears.append(w)
    tokens = n * args.tokens_per_adapter
    slots = torch.arange(n, dtype=torch.int32).repeat_interleave(args.tokens_per_adapter)
    meta = LoRABatchMeta.build(slots, n)
    xs = {w.a.shape[2]: torch.randn(tokens, w.a.shape[2]) for w in linears}
    ys = {w.b_t.shape[2]: torch.zeros(tokens, w.b_t.shape[2]) for w in linears}
    num_bytes = sum(w.a.numel() + w.b_t.numel() for w in linears) * 4  # the slots' bytes
    used = sum(
        int(w.ranks[0, s]) * (w.a.shape[2] + width) * n
        for w in linears
        for s, width in enumerate(w.widths)
    )

    def run_sum() -> None:
        for w in linears:
            w.a.sum()
            w.b_t.sum()

    def run_kernel() -> None:
        for w in linears:
            op(xs[w.a.shape[2]], w.a, w.b_t, meta.segments, w.widths, w.ranks, ys[w.b_t.shape[2]])

    def run_padded() -> None:
        for w in linears:
            op(xs[w.a.shape[2]], w.a, w.b_t, meta.segments, w.widths, None, ys[w.b_t.shape[2]])

    halves = [(w.a.bfloat16(), w.b_t.bfloat16(), w.widths, w.ranks) for w in linears]

    def run_bf16() -> None:
        for a, b_t, widths, ranks in halves:
            op(xs[a.shape[2]], a, b_t, meta.segments, widths, ranks, ys[b_t.shape[2]])

    def run_torch() -> None:
        os.environ["RAYLORA_CPU_KERNEL"] = "0"
        try:
            for w in linears:
                lora_linear(xs[w.a.shape[2]], ys[w.b_t.shape[2]], w, meta, backend="torch")
        finally:
            os.environ["RAYLORA_CPU_KERNEL"] = "1"

    ways = {"sum": run_sum, "kernel": run_kernel, "bf16": run_bf16, "torch": run_torch}
    if partial:
        ways["padded"] = run_padded
    for f in ways.values():
        f()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in tqdm(range(args.repeats), desc="interleaved repeats", unit="round", mininterval=1.0):
        for k, f in ways.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    log(f"machine: {machine()}")
    log(
        f"{len(linears)} LoRA linears ({margs.num_layers} layers), {n} adapters x rank {r}, "
        f"{args.tokens_per_adapter} tokens each: {num_bytes / 1e6:.0f} MB of fp32 weights"
    )
    if partial:
        log(
            f"adapters of rank {ar} on {','.join(targets)}: {used * 4 / 1e6:.0f} MB of those "
            "hold weights (GB/s below: slot bytes over time)"
        )
    for k in ways:
        log(f"{k:>7}: {med[k] * 1e3:7.2f} ms  ({num_bytes / med[k] / 1e9:5.1f} GB/s)")
    log(
        f"kernel / sum: {med['kernel'] / med['sum']:.2f}x   torch / kernel: "
        f"{med['torch'] / med['kernel']:.2f}x   bf16 / kernel: {med['bf16'] / med['kernel']:.2f}x"
    )
    if partial:
        log(f"padded / kernel: {med['padded'] / med['kernel']:.2f}x (skipping the empty rows)")
    return {k: v * 1e3 for k, v in med.items()}


if __name__ == "__main__":
    main()
