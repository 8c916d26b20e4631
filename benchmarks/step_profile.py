"""Where raylora's engine step spends its time: torch.profiler over step_times.py's cases.

    python benchmarks/step_times.py --profile [--cases decode:32x128,ttft_2k]

Per case, the timed part (decode: the timed steps; prefill: until every first token) runs
under torch.profiler, with the model forward, the lm_head and the sampler marked by
record_function. The wall time is split into
  linears    the projections (raylora_cpu::linear_packed and friends, aten::linear/mm)
  attention  SDPA, KV block gathers (index_select), KV cache writes (index_put), the C++
             decode and prefill attention
  elementwise norms, rope, activations, residual adds, and the other ops of the forward
  lm_head    the vocabulary projection of the rows that sample
  sampler    the sampler's ops and Python
  forward py the model forward's own Python and dispatch (its wall time minus its ops')
  step py    everything else: scheduling, input building, the attention metadata,
             detokenizing (the step's wall time minus the above)
The fused C++ forward (raylora_cpu::forward_layers, csrc/layers_cpu.cpp: every layer in one
op, which the profiler sees whole) is split into linears, attention and elementwise by its
own phase clocks (raylora_cpu::layer_times).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import log, setup_threads
from benchmarks.peers.step_times_run import make_engine, run_case, warmup_case

LINEAR_OPS = ("linear", "addmm", "aten::mm", "bmm", "lora_add", "matmul")
ATTENTION_OPS = ("scaled_dot_product", "index_select", "index_put", "decode_attention")
COLUMNS = ("linears", "attention", "elementwise", "lm_head", "sampler", "forward py", "step py")


def category(name: str) -> str:
    if any(k in name for k in LINEAR_OPS):
        return "linears"
    if any(k in name for k in ATTENTION_OPS):
        return "attention"
    return "elementwise"


def _self_us(ev) -> float:
    return ev.self_cpu_time_total


def _subtree(ev):
    yield ev
    for child in ev.cpu_children:
        yield from _subtree(child)


FUSED_OP = "raylora_cpu::forward_layers"
PHASES = ("linears", "attention", "elementwise")  # raylora_cpu::layer_times' order


def split(prof, wall_us: float, fused_s: list[float] | None = None) -> dict[str, float]:
    """The profile's events -> microseconds per COLUMNS entry (they sum to wall_us).
    fused_s: the seconds per phase forward_layers reported for the same span."""
    out: dict[str, float] = defaultdict(float)
    marked = fused_us = 0.0
    for ev in prof.events():
        if ev.name not in ("raylora.forward", "raylora.lm_head", "raylora.sampler"):
            continue
        marked += ev.cpu_time_total
        if ev.name == "raylora.forward":
            ops = 0.0
            for sub in _subtree(ev):
                if sub is ev or sub.name.startswith("raylora."):
                    continue
                ops += _self_us(sub)
                if sub.name == FUSED_OP and fused_s:  # split below by its own clocks
                    fused_us += _self_us(sub)
                    continue
                out[category(sub.name)] += _self_us(sub)
            out["forward py"] += ev.cpu_time_total - ops
        else:
            out[ev.name.removeprefix("raylora.")] += ev.cpu_time_total
    if fused_us:  # the fused op's time by phase; what its clocks did not see: dispatch
        for phase, seconds in zip(PHASES, fused_s, strict=True):
            out[phase] += seconds * 1e6
        out["forward py"] += max(0.0, fused_us - sum(fused_s) * 1e6)
    out["step py"] = max(0.0, wall_us - marked)
    return dict(out)


def _marked(obj, attr: str, label: str) -> None:
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, attr, wrapped)


def profile_cases(spec: dict) -> dict:
    threads = setup_threads(None)
    engine = make_engine("raylora", spec)
    runner = engine.model_runner
    _marked(runner.model, "hidden_states", "raylora.forward")
    _marked(runner.model, "compute_logits", "raylora.lm_head")
    _marked(runner.sampler, "sample_isolated", "raylora.sampler")
    log(f"raylora, {threads} threads, torch.profiler (CPU)")
    log(f"{'case':<16}{'wall':>9}" + "".join(f"{c:>12}" for c in COLUMNS) + "   (ms per step)")
    results = {}
    fused = runner.model.fused_layers_op is not None
    for i, case in enumerate(spec["cases"]):
        run_case(engine, "raylora", warmup_case(case), f"w{i}")
        box: dict = {}

        @contextlib.contextmanager
        def around(box=box):
            if fused:
                torch.ops.raylora_cpu.layer_times()  # from zero
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                yield
                box["wall_us"] = (time.perf_counter() - t) * 1e6
            box["prof"] = prof
            box["fused_s"] = list(torch.ops.raylora_cpu.layer_times()) if fused else None

        run_case(engine, "raylora", case, f"c{i}", around)
        n = case.get("steps", 1) if case["kind"] == "decode" else 1
        spans = split(box["prof"], box["wall_us"], box["fused_s"])
        parts = {k: v / n / 1e3 for k, v in spans.items()}
        wall = box["wall_us"] / n / 1e3
        log(
            f"{case['label']:<16}{wall:>9.1f}"
            + "".join(f"{parts.get(c, 0.0):>12.1f}" for c in COLUMNS)
        )
        results[case["label"]] = {"wall_ms": wall, **parts}
    log("(the profiler's own cost is in the wall times: compare ratios, not absolutes)")
    torch.set_num_threads(threads)
    return results
