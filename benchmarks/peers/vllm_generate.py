"""vLLM's `LLM.generate` on a peer workload, in its own process (run with .venv-vllm's python).

    .venv-vllm/bin/python benchmarks/peers/vllm_generate.py WORKLOAD.json OUT.json [--t0 EPOCH]

Normally started by benchmarks/peers/vllm_peer.py:run_peer, which sets vLLM's documented CPU
settings in this process's environment (vllm_peer.vllm_cpu_env); to run it by hand, set
them yourself:

    VLLM_CPU_KVCACHE_SPACE=1            KV cache size in GiB (unset: vLLM sizes it from free
                                        memory). 1, its smallest, is raylora's default KV
                                        budget (kv_cache_memory_gb=1.0) and holds the whole
                                        engine-throughput workload at once (23k fp32 tokens of
                                        SmolLM2-135M; the workload needs 12.4k)
    VLLM_CPU_OMP_THREADS_BIND=0-1       the worker's OpenMP threads on every core, as raylora
                                        computes on every core. vLLM's default, "auto", keeps
                                        one core for the engine-core (scheduler) process on
                                        x86 and binds the worker to the others: on a 2-core
                                        machine, core 0 alone (vllm/utils/ompmultiprocessing.py);
                                        measured here at about half the throughput of 0-1
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:.venv-vllm/lib/libiomp5.so
                                        tcmalloc (Debian's libtcmalloc-minimal4) and the Intel
                                        OpenMP that vllm-cpu pins (intel-openmp); vLLM warns
                                        when either is missing (vllm/v1/worker/cpu_worker.py)
    VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1

Everything else is vLLM's default, its compilation included (on the CPU: torch.compile with
inductor at start-up, off when LoRA is enabled), unless the workload sets enforce_eager.
Greedy (temperature 0), ignore_eos, max_tokens = each request's output length, one
LoRARequest per request that names an adapter; generation_config="vllm" so that the model's
generation_config.json cannot change the sampling. Writes a PeerResult (vllm_peer.py) as
JSON: start-up (process start, or --t0, to LLM ready), memory right after load (this process
and its children: vLLM's engine core and worker), warm-up and generate wall times, tokens.
"""

from __future__ import annotations

import os
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

SETTINGS_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "LD_PRELOAD",
    "OMP_NUM_THREADS",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
)


def lora_requests(specs: list[dict[str, str] | None] | None, ids: dict[str, int], n: int):
    from vllm.lora.request import LoRARequest

    if specs is None:
        return [None] * n
    return [None if s is None else LoRARequest(s["name"], ids[s["name"]], s["path"]) for s in specs]


def generate(llm, prompts, output_lens, loras) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    lora_arg = loras if any(r is not None for r in loras) else None
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, lora_request=lora_arg, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> PeerResult:
    work, out, t0 = runner_args(argv, __doc__.split("\n")[0])

    import vllm
    from vllm import LLM

    adapters = work.adapters
    ids = {name: i + 1 for i, name in enumerate(adapters)}  # vLLM's lora_int_id: >= 1, unique
    kwargs = {}
    if adapters:
        kwargs = dict(
            enable_lora=True,
            max_loras=work.max_loras,
            max_lora_rank=work.max_lora_rank,
            max_cpu_loras=max(work.max_loras, len(adapters)),
        )
    llm = LLM(
        model=work.model,
        dtype=work.dtype,
        max_num_seqs=work.max_num_seqs,
        seed=0,
        enforce_eager=work.enforce_eager,
        generation_config="vllm",
        **kwargs,
    )
    startup_s = time.time() - t0
    memory = memory_mb()
    print(f"vLLM {vllm.__version__} ready in {startup_s:.1f} s, memory {memory}", flush=True)

    warmup_s = 0.0
    if work.warmup_prompts:
        n = len(work.warmup_prompts)
        warm = lora_requests(work.warmup_loras, ids, n)
        warmup_s, _ = generate(llm, work.warmup_prompts, work.warmup_output_lens, warm)
    loras = lora_requests(work.loras, ids, len(work.prompts))
    seconds, token_ids = generate(llm, work.prompts, work.output_lens, loras)
    num_tokens = sum(len(t) for t in token_ids)
    short = sum(len(t) != n for t, n in zip(token_ids, work.output_lens, strict=True))
    if short:
        raise SystemExit(f"{short} requests did not generate exactly their output length")
    settings = {k: os.environ.get(k, "") for k in SETTINGS_ENV}
    mode = llm.llm_engine.vllm_config.compilation_config.mode
    settings.update(
        compilation=getattr(mode, "name", str(mode)),
        enforce_eager=str(work.enforce_eager),
        torch_threads=str(_torch_threads()),
    )
    result = PeerResult(
        engine="vllm",
        version=vllm.__version__,
        startup_s=startup_s,
        memory_mb=memory,
        warmup_s=warmup_s,
        generate_s=seconds,
        num_tokens=num_tokens,
        token_ids=token_ids,
        settings=settings,
    )
    write_result(result, out)
    print(
        f"vLLM: {num_tokens} tokens in {seconds:.2f} s = {num_tokens / seconds:.1f} tok/s",
        flush=True,
    )
    return result


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()  # this process's; the worker's OpenMP threads are bound


if __name__ == "__main__":
    main()
