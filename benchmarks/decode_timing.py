"""Decode-step timing for the engine benchmarks: the engine's step against the bare model
forward of the same batch (what the host adds around the model), steps of several engines
taken in turn so that their ratio holds on shared cores, and a CUDA-graph probe of the
forward."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchmarks.common import sync
from engine.attention import AttentionMetadata
from engine.model_runner import order_by_slot
from engine.models.llama import ForwardContext
from raylora_kernels import LoRABatchMeta


def all_decoding(engine) -> bool:
    """Every unfinished sequence is past its prompt: the next step is a pure decode step."""
    sched = engine.scheduler
    return not sched.waiting and all(
        s.num_computed_tokens >= s.num_prompt_tokens for s in sched.running
    )


def bare_decode_forward(engine, synced: bool = True) -> Callable[[], torch.Tensor]:
    """The forward the engine's last (pure decode) step ran, prepared ahead: the same
    LlamaForCausalLM, the same sequences, positions, block tables and LoRA slots, built once so
    that calling it is the model alone (no scheduler, input building, sampler or detokenizer).
    Re-running it rewrites the KV entries of the last step with the same values. synced: wait
    for the device at the end (CUDA), so that a wall-clock timer covers the forward."""
    runner, sched = engine.model_runner, engine.scheduler
    ids, positions, specs, slots = [], [], [], []
    tagged = [
        (seq, sched.slots.slot_of[seq.lora_name] if seq.lora_name is not None else -1)
        for seq in sched.running
    ]
    for seq, slot in order_by_slot(tagged):  # the order the runner gives the kernels
        p = seq.num_computed_tokens - 1  # the token the last step ran
        ids.append(seq.token_ids[p])
        positions.append(p)
        specs.append((p, 1, seq.block_table))
        slots.append(slot)
    dev = runner.device
    lora = None
    if runner.lora_manager is not None and any(s >= 0 for s in slots):
        lora = LoRABatchMeta.build(
            torch.tensor(slots, dtype=torch.int32, device=dev), engine.config.max_loras
        )
    ctx = ForwardContext(
        AttentionMetadata.build(specs, runner.block_size, dev, runner.decode_attention),
        lora,
        runner.lora_backend,
    )
    args = (
        torch.tensor(ids, device=dev),
        torch.tensor(positions, device=dev),
        ctx,
        torch.arange(len(ids), device=dev),
    )

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            out = runner.model(*args)
        if synced:
            sync(dev)
        return out

    return forward


def graphed_forward_ratio(engines: dict[str, object], iters: int = 50) -> dict[str, float]:
    """CUDA only, a probe of what CUDA graphs would give (the engine runs eager): each engine's
    bare decode forward (bare_decode_forward, same batch as its last step) captured in a
    torch.cuda.CUDAGraph, then the graphs replayed in turn, `iters` times each; median replay
    time per engine in seconds. The engines must be in steady-state decode."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    graphs = {}
    for kind, engine in engines.items():
        fwd = bare_decode_forward(engine, synced=False)  # no sync inside a capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up off the capture stream, as torch.cuda.graph asks
                fwd()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            fwd()
        graphs[kind] = graph
    for _ in range(iters):
        for kind, graph in graphs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


@dataclass
class DecodeTiming:
    batch_size: int
    step_s: list[float]  # engine.step() wall times
    forward_s: list[float]  # the bare forward of the same batch, right after each step
    context_lens: tuple[int, int]  # (min, max) context length over the timed steps

    @property
    def step_median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def forward_median(self) -> float:
        return statistics.median(self.forward_s)


def time_decode_steps(
    engine, num_steps: int, with_forward: bool = True, desc: str = "decode steps"
) -> DecodeTiming:
    """Step the engine to steady-state decode, then time num_steps engine.step() calls, each
    followed (paired, so both see the same load on shared cores) by the bare forward of the
    batch it just ran. The running sequences must not finish within these steps."""
    return time_paired_decode_steps({"": engine}, num_steps, with_forward, desc)[""]


def time_paired_decode_steps(
    engines: dict[str, object], num_steps: int, with_forward: bool = True, desc: str = "decode"
) -> dict[str, DecodeTiming]:
    """time_decode_steps for several engines at once, taking turns step by step (the order
    rotates each round), so that step i of every engine sees the same machine state: on
    shared cores the speed drifts by tens of percent within a minute, and the ratio of two
    steps taken a fraction of a second apart holds much better than that of two rounds."""
    for engine in engines.values():
        while not all_decoding(engine):
            engine.step()
        engine.step()  # one decode step untimed (first-touch of new blocks, allocator warm-up)
    kinds = list(engines)
    batch = {k: len(e.scheduler.running) for k, e in engines.items()}
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    forwards: dict[str, list[float]] = {k: [] for k in kinds}
    ctx: dict[str, list[int]] = {k: [] for k in kinds}
    for i in tqdm(range(num_steps), desc=desc, unit="step", mininterval=1.0):
        for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
            engine = engines[kind]
            t0 = time.perf_counter()
            engine.step()
            steps[kind].append(time.perf_counter() - t0)
            assert len(engine.scheduler.running) == batch[kind], "a sequence finished while timing"
            ctx[kind].extend(s.num_computed_tokens for s in engine.scheduler.running)
            if with_forward:
                fwd = bare_decode_forward(engine)
                t0 = time.perf_counter()
                fwd()
                forwards[kind].append(time.perf_counter() - t0)
    return {
        k: DecodeTiming(batch[k], steps[k], forwards[k], (min(ctx[k]), max(ctx[k]))) for k in kinds
    }


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median of the ratios of paired samples (num[i] / den[i])."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))
