"""The LoRA work of one CPU decode step, isolated: every LoRA linear of the model, against the
memory bandwidth, for the C++ CPU kernel and the torch ops.

    python benchmarks/cpu_lora_step.py                    # default model's shapes, issue 3 workload
    python benchmarks/cpu_lora_step.py --num-adapters 16 --rank 16 --tokens-per-adapter 2

Random slot weights for every packed linear of the model (num_layers x qkv/o/gate_up/down),
as many active adapters as slots, tokens grouped by slot as the model runner orders them.
Three ways over the same weights, interleaved --repeats times in one process (medians):
  sum       `w.a.sum(); w.b_t.sum()`: reads the same bytes, no math (the bandwidth bound)
  kernel    the C++ CPU kernel (`raylora_cpu::lora_add`, kernels/cpu_kernel.py)
  bf16      the same kernel on bfloat16 copies of the weights (lora_dtype="bfloat16": half
            the bytes; its GB/s counts the fp32 bytes, i.e. it is the fp32-equivalent rate)
  torch     `lora_linear` on torch ops (RAYLORA_CPU_KERNEL=0)
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
    args = p.parse_args(argv)
    setup_threads(args.threads)

    import torch
    from tqdm import tqdm

    from engine.models.llama import PACKED_MODULES, ModelArgs
    from engine.models.loader import load_model_config, resolve_model
    from kernels import LoRABatchMeta, SlotWeights, lora_linear
    from kernels.cpu_kernel import cpu_lora_op

    op = cpu_lora_op()
    if op is None:
        raise SystemExit("the C++ CPU kernel is off or did not build (see the warning above)")
    margs = ModelArgs.from_hf_config(load_model_config(resolve_model(args.model)))
    shapes = margs.lora_module_shapes()  # HF module -> (out, in)
    n, r = args.num_adapters, args.rank
    gen = torch.Generator().manual_seed(0)
    linears = []
    for _ in range(margs.num_layers):
        for modules in PACKED_MODULES.values():
            widths = [shapes[m][0] for m in modules]
            h_in = shapes[modules[0]][1]
            a = torch.randn(n, len(widths) * r, h_in, generator=gen) * h_in**-0.5
            b_t = torch.randn(n, r, sum(widths), generator=gen) * 0.02
            linears.append(SlotWeights(a, b_t, widths))
    tokens = n * args.tokens_per_adapter
    slots = torch.arange(n, dtype=torch.int32).repeat_interleave(args.tokens_per_adapter)
    meta = LoRABatchMeta.build(slots, n)
    xs = {w.a.shape[2]: torch.randn(tokens, w.a.shape[2]) for w in linears}
    ys = {w.b_t.shape[2]: torch.zeros(tokens, w.b_t.shape[2]) for w in linears}
    num_bytes = sum(w.a.numel() + w.b_t.numel() for w in linears) * 4

    def run_sum() -> None:
        for w in linears:
            w.a.sum()
            w.b_t.sum()

    def run_kernel() -> None:
        for w in linears:
            op(xs[w.a.shape[2]], w.a, w.b_t, meta.segments, w.widths, ys[w.b_t.shape[2]])

    halves = [(w.a.bfloat16(), w.b_t.bfloat16(), w.widths) for w in linears]

    def run_bf16() -> None:
        for a, b_t, widths in halves:
            op(xs[a.shape[2]], a, b_t, meta.segments, widths, ys[b_t.shape[2]])

    def run_torch() -> None:
        os.environ["RAYLORA_CPU_KERNEL"] = "0"
        try:
            for w in linears:
                lora_linear(xs[w.a.shape[2]], ys[w.b_t.shape[2]], w, meta, backend="torch")
        finally:
            os.environ["RAYLORA_CPU_KERNEL"] = "1"

    ways = {"sum": run_sum, "kernel": run_kernel, "bf16": run_bf16, "torch": run_torch}
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
    for k in ways:
        log(f"{k:>7}: {med[k] * 1e3:7.2f} ms  ({num_bytes / med[k] / 1e9:5.1f} GB/s)")
    log(
        f"kernel / sum: {med['kernel'] / med['sum']:.2f}x   torch / kernel: "
        f"{med['torch'] / med['kernel']:.2f}x   bf16 / kernel: {med['bf16'] / med['kernel']:.2f}x"
    )
    return {k: v * 1e3 for k, v in med.items()}


if __name__ == "__main__":
    main()
