"""raylora's engine on a peer workload, in its own process (run with .venv's python).

    .venv/bin/python benchmarks/peers/raylora_generate.py WORKLOAD.json OUT.json [--t0 EPOCH]

The same workload file and result format as vllm_generate.py (vllm_peer.PeerWorkload,
PeerResult), measured the same way (procstats), so the two engines are compared on equal
terms: each pays its own start-up, neither shares the other's allocator or caches. The
engine runs as the benchmarks configure it (EngineConfig defaults, with the workload's
max_num_seqs, dtype and, when it names adapters, max_loras / max_lora_rank; torch threads:
every core) and every request is submitted at once (benchmarks.common.run_engine).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.procstats import memory_mb  # noqa: E402
from benchmarks.peers.vllm_peer import (  # noqa: E402
    PeerResult,
    runner_args,
    write_result,
)


def _version() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        rev = ""
    return f"git {rev}" if rev else "dev"


def main(argv: list[str] | None = None) -> PeerResult:
    work, out, t0 = runner_args(argv, __doc__.split("\n")[0])

    from benchmarks.common import Workload, run_engine, setup_threads
    from engine import EngineConfig, LLMEngine, LoRARequest

    threads = setup_threads(None)
    adapters = work.adapters
    lora_of = {
        name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())
    }
    config = dict(model=work.model, max_num_seqs=work.max_num_seqs, dtype=work.dtype)
    if adapters:
        config.update(
            max_loras=work.max_loras,
            max_lora_rank=work.max_lora_rank,
            max_cpu_loras=max(32, len(adapters)),
        )
    else:
        config.update(enable_lora=False)
    engine = LLMEngine(EngineConfig(**config))
    startup_s = time.time() - t0
    memory = memory_mb()
    print(f"raylora ready in {startup_s:.1f} s, memory {memory}", flush=True)

    def loras(specs, n):
        return [None if s is None else lora_of[s["name"]] for s in (specs or [None] * n)]

    warmup_s = 0.0
    if work.warmup_prompts:
        warm = Workload(work.warmup_prompts, work.warmup_output_lens)
        n = len(work.warmup_prompts)
        warmup_s = run_engine(engine, warm, loras(work.warmup_loras, n), desc="warm-up").seconds
    timed = Workload(work.prompts, work.output_lens)
    res = run_engine(engine, timed, loras(work.loras, len(work.prompts)), desc="raylora")
    result = PeerResult(
        engine="raylora",
        version=_version(),
        startup_s=startup_s,
        memory_mb=memory,
        warmup_s=warmup_s,
        generate_s=res.seconds,
        num_tokens=res.num_tokens,
        token_ids=res.token_ids,
        settings={
            "torch_threads": str(threads),
            "kv_cache_memory_gb": str(engine.config.kv_cache_memory_gb),
            "preemptions": str(engine.scheduler.num_preemptions),
            "lora_backend": engine.model_runner.lora_backend.name,
        },
    )
    write_result(result, out)
    print(f"raylora: {res.num_tokens} tokens in {res.seconds:.2f} s = {res.tok_per_s:.1f} tok/s")
    return result


if __name__ == "__main__":
    main()
