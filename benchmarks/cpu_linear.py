"""The model's linears on the CPU, three ways: F.linear (MKL), the column-split sgemm
(`raylora_cpu::linear`) and the packed GEMM the engine uses (`raylora_cpu::linear_packed`).

    python benchmarks/cpu_linear.py                       # default model's shapes
    python benchmarks/cpu_linear.py --rows 1,32,2048 --repeats 9

Per linear shape of the model (qkv, o, gate_up, down, lm_head) and row count: every layer's
own weight (so the weights stream from memory as in a forward, not from cache), the three
ways interleaved --repeats times in one process, medians. Prints each way's time per layer
and F.linear's time over the packed GEMM's. Then a decode step's linears: all layers' four
linears and the lm_head at --step-rows rows, the same three ways. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, machine, setup_threads  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default' or a local checkpoint folder")
    p.add_argument("--rows", default="1,8,32,64,128,512,2048")
    p.add_argument("--step-rows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    setup_threads(args.threads)

    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from engine.models.llama import PACKED_MODULES, ModelArgs
    from engine.models.loader import load_model_config, resolve_model
    from raylora_kernels.cpu_kernel import cpu_linear_op, cpu_linear_packed_op
    from raylora_kernels.packed_weight import PackedWeight

    split, packed = cpu_linear_op(), cpu_linear_packed_op()
    if split is None or packed is None:
        raise SystemExit("the C++ CPU kernels are off or did not build (see the warning above)")
    margs = ModelArgs.from_hf_config(load_model_config(resolve_model(args.model)))
    module_shapes = margs.lora_module_shapes()  # HF module -> (out, in)
    shapes = {
        name: (sum(module_shapes[m][0] for m in mods), module_shapes[mods[0]][1])
        for name, mods in PACKED_MODULES.items()
    }
    layers = args.layers or margs.num_layers
    gen = torch.Generator().manual_seed(0)
    weights = {  # random weights of the model's shapes: speed does not depend on the values
        name: [torch.randn(n, k, generator=gen) * k**-0.5 for _ in range(layers)]
        for name, (n, k) in shapes.items()
    }
    weights["lm_head"] = [torch.randn(margs.vocab_size, margs.hidden_size, generator=gen) * 0.04]
    packs = {name: [PackedWeight.pack(w) for w in ws] for name, ws in weights.items()}
    ways = {
        "F.linear": lambda x, w, pw: F.linear(x, w),
        "split": lambda x, w, pw: split(x, w, None),
        "packed": lambda x, w, pw: packed(x, pw.data, pw.out_features, None),
    }

    def timed(rows: int, names: list[str]) -> dict[str, float]:
        xs = {
            k: torch.randn(rows, k, generator=gen)
            for k in {w[0].shape[1] for w in weights.values()}
        }
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, f in ways.items():
                t0 = time.perf_counter()
                for name in names:
                    for w, pw in zip(weights[name], packs[name], strict=True):
                        f(xs[w.shape[1]], w, pw)
                times[way].append(time.perf_counter() - t0)
        return {way: statistics.median(v) for way, v in times.items()}

    log(f"machine: {machine()}")
    names = list(weights)
    rows_list = [int(r) for r in args.rows.split(",")]
    table: dict[str, dict[int, dict[str, float]]] = {name: {} for name in names}
    for rows in tqdm(rows_list, desc="row counts", unit="rows", mininterval=1.0):
        for name in names:
            table[name][rows] = timed(rows, [name])
    log(f"ms per layer (F.linear / split / packed), and F.linear over packed; {layers} layers")
    log("rows  " + "  ".join(f"{n} {shapes.get(n, weights[n][0].shape)}" for n in names))
    for rows in rows_list:
        cells = []
        for name in names:
            t = {k: v * 1e3 / len(weights[name]) for k, v in table[name][rows].items()}
            cells.append(
                f"{t['F.linear']:.3f}/{t['split']:.3f}/{t['packed']:.3f} "
                f"({t['F.linear'] / t['packed']:.2f}x)"
            )
        log(f"{rows:>4}  " + "  ".join(cells))
    step = timed(args.step_rows, names)
    log(
        f"a decode step's linears ({layers} layers x 4 + lm_head, {args.step_rows} rows): "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in step.items())
        + f"; F.linear / packed {step['F.linear'] / step['packed']:.2f}x,"
        f" split / packed {step['split'] / step['packed']:.2f}x"
    )
    return {"table": table, "step": step}


if __name__ == "__main__":
    main()
