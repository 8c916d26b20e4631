"""Decode steps replayed from CUDA graphs, one per (padded batch size, LoRA on/off).

An eager decode step on a GPU is bound by the host: about a thousand kernel launches, each a
few microseconds of Python and driver work, for a forward the GPU runs in a fraction of that
(docs/benchmarks.md, "On a GPU"). As in vLLM (gpu_model_runner.py, capture_model), the
model runner captures the decode forward once per capture size over the persistent buffers of
engine/decode_inputs.py and replays it: a step then costs one staging copy, one replay and
the sampler.

What makes a replay correct under another batch: everything the captured forward reads is a
fixed address written before the replay (DecodeInputs' views, the LoRA slot weights and their
ranks, the static LoRA metadata), and no kernel's grid or branch depends on a per-step host
value (the paged-attention and LoRA kernels read context lengths and per-slot token counts
on the device). `EagerGraph` checks exactly that on the CPU: it "captures" by keeping the
closure built at capture time and "replays" by running it again, so a forward that baked a
per-step value into its closure at capture time gives wrong tokens in the tests, as a real
graph would on a GPU. Only `torch.cuda.CUDAGraph` itself is GPU-only. What EagerGraph cannot
show is lifetime: it keeps its closure to replay it, a CUDA graph keeps only addresses, so
CudaGraph holds the closure (and every buffer only it refers to) for as long as the graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor], pool: object) -> torch.Tensor: ...

    def replay(self) -> None: ...

    def pool(self) -> object: ...


class CudaGraph:
    """torch.cuda.CUDAGraph: capture fn once (after warm-up runs), replay it."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor], pool: object) -> torch.Tensor:
        # The graph replays raw addresses: every tensor it reads must live as long as it does.
        # Some live only in fn's closure (the StaticLoRAMeta of a LoRA graph, allocated outside
        # the capture): dropped with fn, their memory is reused and a replay reads garbage
        # slot counts (an illegal address on the H200, 2026-12-04). Holding fn holds them.
        self.fn = fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton JIT and cuBLAS workspaces outside the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()

    def pool(self) -> object:
        return self.graph.pool()


class EagerGraph:
    """The CPU stand-in: keeps the capture-time closure and its output tensor; a replay runs
    the closure again and writes into that same output, as a CUDA graph replay does."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor], pool: object) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None, "replay before capture"
        self.out.copy_(self.fn())

    def pool(self) -> object:
        return None


class DecodeGraphs:
    """Captured decode forwards keyed by (padded batch size, LoRA on/off).

    build_forward(size, lora) returns the closure to capture: the decode forward of `size`
    rows over the persistent buffers, with the LoRA path on or off; it returns the hidden
    states [size, hidden]. Sizes are captured largest first, all in one memory pool (vLLM's
    order: the smaller graphs reuse the largest one's blocks)."""

    def __init__(
        self,
        build_forward: Callable[[int, bool], Callable[[], torch.Tensor]],
        sizes: Sequence[int],
        lora_modes: Sequence[bool],
        graph_factory: Callable[[], Graph] = CudaGraph,
    ) -> None:
        self.sizes = sorted(sizes)
        self.lora_modes = tuple(lora_modes)
        self._build, self._factory = build_forward, graph_factory
        self.graphs: dict[tuple[int, bool], tuple[Graph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays: dict[tuple[int, bool], int] = {}  # (size, lora) -> replays (tests, stats)

    def capture(self) -> None:
        t0, pool = time.perf_counter(), None
        for size in reversed(self.sizes):
            for lora in self.lora_modes:
                graph = self._factory()
                out = graph.capture(self._build(size, lora), pool)
                pool = pool if pool is not None else graph.pool()
                self.graphs[(size, lora)] = (graph, out)
        self.capture_seconds = time.perf_counter() - t0
        logger.info(
            "captured %d decode graphs (sizes %s, lora %s) in %.1f s",
            len(self.graphs),
            self.sizes,
            self.lora_modes,
            self.capture_seconds,
        )

    def replay(self, size: int, lora: bool) -> torch.Tensor:
        """Replay the graph of this size (the inputs already staged); its output tensor."""
        graph, out = self.graphs[(size, lora)]
        graph.replay()
        self.replays[(size, lora)] = self.replays.get((size, lora), 0) + 1
        return out
