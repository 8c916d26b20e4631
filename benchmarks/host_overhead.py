"""The host's share of a decode step: what is left of `engine.step()` besides the forward.

    python benchmarks/host_overhead.py [--batch 64] [--steps 300]

On a GPU the forward replays from a CUDA graph in 2-4 ms (SmolLM2 shapes, batch 64), so the
step's Python (scheduling, staging the inputs, sampling, output processing: detokenizing,
stop rules, RequestOutputs) decides how close the step gets to the bare forward
(docs/benchmarks.md, "GPU-grade decode"). That Python is the same on the CPU: here it runs
around the tiny test model, whose forward is cheap, so the host parts stand out. Prints the
medians of the step, the model forward, the sampler and output processing, per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, machine  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tests.model_fixtures import make_tiny_llama  # noqa: E402


def timed(obj: object, name: str, into: list[float]) -> None:
    """Wrap obj.name so that each call's seconds are appended to `into`."""
    fn: Callable = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return result

    setattr(obj, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    model_dir = make_tiny_llama(Path(tempfile.mkdtemp(prefix="raylora-host-")) / "tiny")
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), max_num_seqs=args.batch, block_size=16, enable_lora=False
        )
    )
    params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(3, 43 + i))}, params)
    for _ in range(5):  # the prefills and the first decodes
        engine.step()
    parts: dict[str, list[float]] = {"forward": [], "sampler": [], "output processing": []}
    runner = engine.model_runner
    timed(runner.model, "hidden_states", parts["forward"])
    timed(runner, "_sample_into", parts["sampler"])
    timed(engine.output_processor, "process", parts["output processing"])
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    log(f"{machine()}; tiny model, decode batch {args.batch}, medians of {args.steps} steps")
    step = statistics.median(steps)
    log(f"  engine.step()        {step * 1e3:7.3f} ms")
    rest = step
    for name, times in parts.items():
        t = statistics.median(times)
        rest -= t
        log(f"  {name:<20} {t * 1e3:7.3f} ms")
    log(f"  the rest             {rest * 1e3:7.3f} ms  (scheduling, staging, lm_head, metadata)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
