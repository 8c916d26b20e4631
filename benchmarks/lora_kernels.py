"""Benchmark (and check) lora_shrink / lora_expand at real model shapes.

    python benchmarks/lora_kernels.py                      # CUDA: Llama-3-8B shapes, triton vs torch
    python benchmarks/lora_kernels.py --model smollm2 --strategies   # CPU: torch strategies
    python benchmarks/lora_kernels.py --check              # correctness only (device vs fp32 ref)
    python benchmarks/lora_kernels.py --tiny --interpret   # dry run on CPU, triton interpreter, < 60 s
    python benchmarks/lora_kernels.py --no-check --adapter-rank 8  # smaller adapters in the slots

On CUDA: CUDA events, median of --iters runs (on CPU: the min, cores are shared); the device copy bandwidth is measured in
the same run and each op's achieved bandwidth (bytes of weights + activations it must
move / its time) is printed as a fraction of it. With --adapter-rank below a scenario's rank
(the slots' max_lora_rank), the adapters fill only that many rows (the rest zero, as the LoRA
manager leaves them) and the Triton ops are also timed with `ranks` (SlotWeights.ranks_device:
rows past each adapter's rank are not read), against the padded run. Exit status 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from raylora_kernels import (  # noqa: E402
    LoRABatchMeta,
    SlotWeights,
    lora_expand,
    lora_expand_ref,
    lora_linear,
    lora_shrink,
    lora_shrink_ref,
)
from raylora_kernels.torch_ops import (  # noqa: E402
    expand_strategy,
    lora_expand_torch,
    lora_shrink_torch,
    shrink_strategy,
)

# layer -> (H_in, [H_out per slice])
MODELS = {
    "llama3-8b": {
        "qkv": (4096, [4096, 1024, 1024]),
        "gate_up": (4096, [14336, 14336]),
        "down": (14336, [4096]),
    },
    "smollm2": {"qkv": (576, [576, 192, 192]), "gate_up": (576, [1536, 1536])},
    "tiny": {"qkv": (64, [64, 32, 32]), "gate_up": (48, [96, 96]), "odd": (37, [45])},
}
# (phase, num_tokens, num_adapters, rank)
SCENARIOS = {
    "llama3-8b": [
        ("decode", 64, 1, 16),
        ("decode", 64, 8, 16),
        ("decode", 64, 64, 16),
        ("decode", 64, 8, 64),
        ("decode", 64, 64, 8),
        ("prefill", 2048, 1, 16),
        ("prefill", 2048, 4, 16),
        ("prefill", 2048, 4, 64),
    ],
    "smollm2": [("decode", 32, 16, 16), ("decode", 32, 4, 16), ("prefill", 512, 4, 16)],
    "tiny": [("decode", 5, 3, 4), ("decode", 9, 9, 16), ("prefill", 37, 2, 8)],
}
TOL = {torch.float32: (1e-3, 1e-3), torch.float16: (3e-2, 1e-2), torch.bfloat16: (1e-1, 3e-2)}


def log(msg: str) -> None:
    print(msg, flush=True)


def timer(fn, device: torch.device, iters: int) -> float:
    """Seconds per call: median on CUDA; min on CPU, where the cores are often shared
    and the median measures the neighbours."""
    for _ in range(3):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a big device-to-device copy (read + write)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda: dst.copy_(src), device, 20)


def make_case(layer, num_tokens, num_adapters, rank, dtype, device, seed=0, frac_none=0.0):
    hidden_in, widths = layer
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(num_tokens) % num_adapters  # round-robin: every adapter in use
    slots = slots[torch.randperm(num_tokens, generator=gen)]
    if frac_none:
        slots[torch.rand(num_tokens, generator=gen) < frac_none] = -1
        slots[0] = 0

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device)

    x = randn(num_tokens, hidden_in)
    lora_a = [randn(num_adapters, rank, hidden_in, std=hidden_in**-0.5) for _ in widths]
    lora_b = [randn(num_adapters, w, rank, std=rank**-0.5) for w in widths]
    y = randn(num_tokens, sum(widths))
    return slots.to(device), x, lora_a, lora_b, y


def check_case(layer, num_tokens, num_adapters, rank, dtype, device, backend) -> bool:
    """Both ops vs the fp32 reference, with poisoned outputs and no-adapter tokens."""
    slots, x, lora_a, lora_b, y = make_case(
        layer, num_tokens, num_adapters, rank, dtype, device, seed=num_tokens, frac_none=0.3
    )
    meta = LoRABatchMeta.build(slots, num_adapters)
    none = (slots < 0).cpu()
    out = torch.full((len(lora_a), num_tokens, rank), float("nan"), device=device)
    lora_shrink(x, lora_a, meta, 0.5, out, backend=backend)
    ref = lora_shrink_ref(x, lora_a, slots.cpu(), 0.5, out=out.cpu())
    atol, rtol = TOL[dtype]
    ok = torch.allclose(out.cpu(), ref, atol=atol, rtol=rtol, equal_nan=True)
    buf = ref.to(device)  # expand is checked on its own, from the reference buffer
    y_ref = lora_expand_ref(buf, lora_b, slots.cpu(), y)
    y_before = y.clone()
    lora_expand(buf, lora_b, meta, y, backend=backend)
    ok &= torch.allclose(y.float().cpu(), y_ref, atol=atol, rtol=rtol)
    ok &= torch.equal(y[none.to(device)].cpu(), y_before[none.to(device)].cpu())
    base = LoRABatchMeta.build(torch.full_like(slots, -1), num_adapters)
    y_before = y.clone()
    lora_expand(buf, lora_b, base, y, backend=backend)  # base-only: untouched
    ok &= torch.equal(y.cpu(), y_before.cpu())
    return bool(ok)


def run_checks(args, device, dtypes, backends) -> bool:
    all_ok = True
    layers = MODELS["tiny"] if args.tiny else {**MODELS["tiny"], **MODELS["smollm2"]}
    shapes = [(1, 1, 1), (3, 2, 4), (7, 7, 16), (133, 5, 64), (40, 3, 8)]
    for dtype in dtypes:
        for backend in backends:
            for i, (name, layer) in enumerate(layers.items()):
                for num_tokens, num_adapters, rank in shapes[i % 2 :: 2] if args.tiny else shapes:
                    ok = check_case(layer, num_tokens, num_adapters, rank, dtype, device, backend)
                    all_ok &= ok
                    log(
                        f"check {backend:6s} {str(dtype)[6:]:8s} {name:7s} T={num_tokens:<4d} "
                        f"A={num_adapters:<2d} R={rank:<2d} {'ok' if ok else 'FAIL'}"
                    )
    return all_ok


def moved_bytes(op, num_tokens, num_adapters, rank, layer, esize) -> int:
    hidden_in, widths = layer
    if op == "shrink":  # weights of the active slots, x, fp32 out
        return esize * (num_adapters * rank * hidden_in * len(widths) + num_tokens * hidden_in) + (
            4 * len(widths) * num_tokens * rank
        )
    # weights, fp32 buf, y read + written
    return esize * (num_adapters * rank * sum(widths) + 2 * num_tokens * sum(widths)) + (
        4 * len(widths) * num_tokens * rank
    )


def run_timings(args, device, dtype) -> None:
    model = "tiny" if args.tiny else args.model
    use_triton = device.type == "cuda" or args.interpret
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if bandwidth:
        log(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s")
    esize = torch.empty(0, dtype=dtype).element_size()
    head = f"{'op':6s} {'layer':7s} {'phase':7s} {'T':>5s} {'A':>3s} {'R':>3s}  torch(strategy)"
    log(head + ("        triton   x_torch  GB/s  %copyBW" if use_triton else ""))
    for phase, num_tokens, num_adapters, rank in SCENARIOS[model]:
        for name, layer in MODELS[model].items():
            slots, x, lora_a, lora_b, y = make_case(
                layer, num_tokens, num_adapters, rank, dtype, device
            )
            meta = LoRABatchMeta.build(slots, num_adapters)
            hidden_in, widths = layer
            offsets = [sum(widths[:s]) for s in range(len(widths))]
            ranks = None
            if args.adapter_rank is not None and args.adapter_rank < rank:
                for a, b in zip(lora_a, lora_b, strict=True):  # what the manager leaves
                    a[:, args.adapter_rank :] = 0
                    b[:, :, args.adapter_rank :] = 0
                ranks = torch.full(
                    (num_adapters, len(widths)), args.adapter_rank, dtype=torch.int32, device=device
                )
            buf = lora_shrink(x, lora_a, meta, backend="torch")
            strat = {
                "shrink": shrink_strategy(meta, len(widths), num_adapters, rank, hidden_in),
                "expand": expand_strategy(meta, len(widths), rank, sum(widths)),
            }
            alternatives = {"shrink": ["dense", "segments"], "expand": ["gather", "segments"]}
            for op in ("shrink", "expand"):
                if op == "shrink":
                    torch_fn = partial(lora_shrink_torch, x, lora_a, meta, 1.0, buf)
                    triton_fn = partial(lora_shrink, x, lora_a, meta, out=buf, backend="triton")
                else:
                    torch_fn = partial(lora_expand_torch, buf, lora_b, meta, y, offsets, True)
                    triton_fn = partial(lora_expand, buf, lora_b, meta, y, backend="triton")

                def run(strategy, torch_fn=torch_fn):
                    return partial(torch_fn, strategy=strategy)

                t_torch = timer(run(strat[op]), device, args.iters)
                line = (
                    f"{op:6s} {name:7s} {phase:7s} {num_tokens:5d} {num_adapters:3d} {rank:3d}"
                    f"  {t_torch * 1e6:9.1f}us({strat[op]})"
                )
                if args.strategies:
                    for alt in alternatives[op]:
                        if alt != strat[op]:
                            line += f" {alt}={timer(run(alt), device, args.iters) * 1e6:.1f}us"
                if use_triton:
                    t_tri = timer(triton_fn, device, 2 if args.interpret else args.iters)
                    gbps = moved_bytes(op, num_tokens, num_adapters, rank, layer, esize) / t_tri
                    frac = f"{100 * gbps / bandwidth:6.1f}%" if bandwidth else "     -"
                    line += (
                        f"  {t_tri * 1e6:9.1f}us {t_torch / t_tri:7.2f}x {gbps / 1e9:6.1f} {frac}"
                    )
                    if ranks is not None:
                        t_r = timer(
                            partial(triton_fn, ranks=ranks),
                            device,
                            2 if args.interpret else args.iters,
                        )
                        line += f"  ranks {t_r * 1e6:.1f}us (padded / ranks {t_tri / t_r:.2f}x)"
                log(line)
            # The engine's CPU path: shrink + expand fused, tokens ordered by slot as the model
            # runner orders them (raylora_kernels/lora_linear.py), against the two ops above.
            w = SlotWeights.zeros(num_adapters, rank, hidden_in, widths, device, dtype)
            for dst, src in zip(w.lora_a + w.lora_b, lora_a + lora_b, strict=True):
                dst.copy_(src)
            sorted_slots, order = torch.sort(slots, stable=True)
            fused = partial(
                lora_linear,
                x[order],
                y[order],
                w,
                LoRABatchMeta.build(sorted_slots, num_adapters),
                backend="torch",
            )
            t_fused = timer(fused, device, args.iters)
            log(
                f"{'linear':6s} {name:7s} {phase:7s} {num_tokens:5d} {num_adapters:3d} {rank:3d}"
                f"  {t_fused * 1e6:9.1f}us(torch fused, tokens by slot)"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (dry run)")
    parser.add_argument("--interpret", action="store_true", help="triton on CPU, interpreter")
    parser.add_argument("--check", action="store_true", help="correctness checks only")
    parser.add_argument("--no-check", action="store_true", help="timings only")
    parser.add_argument("--model", choices=["llama3-8b", "smollm2"], default=None)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument(
        "--strategies", action="store_true", help="also time other torch strategies"
    )
    parser.add_argument(
        "--adapter-rank", type=int, default=None, help="adapters' rank, below the slots' (timings)"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.interpret
    device = torch.device("cuda" if cuda else "cpu")
    args.model = args.model or ("llama3-8b" if cuda else "smollm2")
    args.iters = args.iters or (100 if cuda else 30)
    dtype = (
        getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    )
    backends = ["triton", "torch"] if (cuda or args.interpret) else ["torch"]
    log(
        f"device={device} torch={torch.__version__} interpret={args.interpret} "
        f"model={'tiny' if args.tiny else args.model} dtype={dtype}"
    )
    t0 = time.time()
    ok = True
    if not args.no_check:
        dtypes = (
            [torch.float32, torch.bfloat16]
            if args.tiny
            else [torch.float16, torch.bfloat16, torch.float32]
        )
        ok = run_checks(args, device, dtypes, backends)
        log(f"checks: {'all passed' if ok else 'FAILED'} ({time.time() - t0:.1f}s)")
    if not args.check:
        run_timings(args, device, dtype)
    log(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'} ({time.time() - t0:.1f}s total)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
