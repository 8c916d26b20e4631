"""Prefix caching: multi-tenant chat, enable_prefix_caching off against on, in one process.

    python benchmarks/prefix_cache.py                        # default model, issue 18 workload
    python benchmarks/prefix_cache.py --model PATH --system-len 64 --num-requests 10 ...

Workload (build_workload, reusable: it returns the requests as chat messages and as token
ids): --num-requests chat requests from --num-adapters + 1 tenants (one per random PEFT
adapter, rank --rank on every linear layer, plus one base-model tenant), in a seeded random
order. Each tenant has its own system prompt of --system-len tokens (tool definitions in
JSON, random words) and each request a short user turn (--user-words words); the chat
template makes the prompt. Outputs: exactly --output-len greedy tokens (ignore_eos).

Two engines with the same config but enable_prefix_caching, in the same process. Each run
submits every request at once (a burst) and steps to the end: TTFT per request (first token
time - add_request time, RequestOutput.metrics) and throughput (generated tokens / wall time).
The runs alternate, --alternations times (off/on, on/off, ...: a drift in the machine's speed
hits both), the caching engine's cache emptied before each of its runs (reset_prefix_cache),
so every run starts cold: each tenant's first request computes its system prompt. Ratios are
the median over the alternations of off / on (TTFT) and on / off (throughput); p50 / p99 are
over every run pooled. The KV cache (--kv-cache-gb) holds the whole burst without
preemption, so the figures measure the compute saved, not the memory. Targets (issue 18):
TTFT p50 >= 3x better and throughput >= 1.5x with caching on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    ALL_LINEARS,
    log,
    machine,
    make_random_adapters,
    setup_threads,
    verdict,
)
from benchmarks.peers.compare import add_peer_args  # noqa: E402

TTFT_TARGET = 3.0  # TTFT p50, caching off / on, at least
THROUGHPUT_TARGET = 1.5  # generated tok/s, caching on / off, at least

_WORDS = (
    "account address amount api array booking calendar cancel city code country currency "
    "customer date default delete description email enum event file filter flight format "
    "hotel id integer invoice item language limit list location message name number order "
    "page parameter payment phone price product query range record refund request required "
    "reservation result search status string ticket time timezone title type unit update "
    "user value weather"
).split()


@dataclass
class ChatRequest:
    req_id: str
    tenant: int  # 0 .. num_adapters - 1: adapter tenant; num_adapters: the base tenant
    lora_name: str | None  # the tenant's adapter (None: the base model)
    messages: list[dict]  # [system, user], the OpenAI chat form
    prompt_token_ids: list[int]  # the messages through the chat template
    max_tokens: int


def system_prompt(tokenizer, num_tokens: int, rng: random.Random) -> str:
    """A tenant's own opening, then tool definitions in JSON, random words, cut to num_tokens
    tokens (on their own)."""
    opening = "You are the assistant for " + " ".join(rng.choice(_WORDS) for _ in range(6))
    tools, ids = [], []
    while len(ids) < num_tokens:
        k = len(tools)
        words = " ".join(rng.choice(_WORDS) for _ in range(12))
        params = {rng.choice(_WORDS): {"type": rng.choice(["string", "integer"])} for _ in range(3)}
        tools.append({"name": f"tool_{k}", "description": words, "parameters": params})
        text = opening + ". You can call these tools:\n" + "\n".join(map(json.dumps, tools))
        ids = tokenizer(text).input_ids
    return tokenizer.decode(ids[:num_tokens])


def build_workload(
    tokenizer,
    num_requests: int = 64,
    num_adapters: int = 4,
    system_len: int = 1024,
    user_words: tuple[int, int] = (8, 24),
    output_len: int = 32,
    seed: int = 0,
    lora_names: list[str] | None = None,
) -> list[ChatRequest]:
    """The multi-tenant chat workload (issue 18): num_adapters adapter tenants plus one base
    tenant, each with its own system prompt of system_len tokens; every tenant gets
    num_requests // (num_adapters + 1) requests or one more, in a seeded random order.
    lora_names[t]: tenant t's adapter name (default "pc-lora-t")."""
    rng = random.Random(seed)
    num_tenants = num_adapters + 1
    names = lora_names or [f"pc-lora-{t}" for t in range(num_adapters)]
    systems = [system_prompt(tokenizer, system_len, rng) for _ in range(num_tenants)]
    tenants = [i % num_tenants for i in range(num_requests)]
    rng.shuffle(tenants)
    reqs = []
    for i, t in enumerate(tenants):
        user = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*user_words))) + "?"
        messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        lora_name = names[t] if t < num_adapters else None
        reqs.append(ChatRequest(f"chat-{i}", t, lora_name, messages, list(ids), output_len))
    return reqs


@dataclass
class RunStats:
    ttft_s: list[float]  # [num_requests] first token time - add_request time
    seconds: float  # first add_request to the last token
    num_tokens: int  # generated tokens
    num_cached_tokens: int  # sum of RequestOutput.num_cached_tokens
    outputs: dict[str, list[int]]  # req_id -> generated ids

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.seconds


def run_burst(engine, reqs: list[ChatRequest], loras: dict) -> RunStats:
    """Submit every request at once, step to the end."""
    from engine import SamplingParams

    outputs, ttft, cached = {}, {}, 0
    t0 = time.perf_counter()
    for r in reqs:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        prompt = {"prompt_token_ids": r.prompt_token_ids}
        engine.add_request(r.req_id, prompt, params, loras.get(r.lora_name))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                m = out.metrics
                ttft[out.request_id] = m["first_token_time"] - m["arrival_time"]
                cached += out.num_cached_tokens
    seconds = time.perf_counter() - t0
    num_tokens = sum(len(t) for t in outputs.values())
    return RunStats([ttft[r.req_id] for r in reqs], seconds, num_tokens, cached, outputs)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]  # nearest rank


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """build_workload's arguments (both prefix-cache benchmarks take them), and --seed."""
    p.add_argument("--model", default="default", help="'default' or a local checkpoint folder")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=4, help="adapter tenants (+1 base)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024, help="system prompt tokens")
    p.add_argument("--user-words", type=int, nargs=2, default=(8, 24), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(p)
    add_peer_args(p)  # --alternations: off/on pairs of runs, or rounds against vLLM
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gb", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = setup_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="raylora-bench-") as tmp:
        if args.peer == "vllm":
            return against_vllm(args, Path(tmp))
        return run(args, threads, Path(tmp))


def against_vllm(args: argparse.Namespace, out_dir: Path) -> dict:
    """The same burst, caching on in both engines (vLLM v1's default, raylora's), raylora
    against vLLM CPU, each in its own process (benchmarks/peers): throughput and agreement."""
    from transformers import AutoTokenizer

    from benchmarks.peers.compare import run_against_vllm
    from benchmarks.peers.vllm_peer import PeerWorkload
    from engine.models.loader import resolve_model

    path = resolve_model(args.model)
    n = args.num_adapters
    paths = make_random_adapters(path, out_dir, n, args.rank, ALL_LINEARS, args.seed)
    names = [f"pc-lora-{t}" for t in range(n)]
    specs = {name: {"name": name, "path": str(p)} for name, p in zip(names, paths, strict=True)}
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    reqs = build_workload(
        tokenizer, args.num_requests, n, args.system_len, tuple(args.user_words),
        args.output_len, args.seed, names,
    )  # fmt: skip
    warm = build_workload(tokenizer, n + 1, n, args.system_len, (4, 4), 2, args.seed + 1, names)
    work = PeerWorkload(
        model=str(path),
        prompts=[r.prompt_token_ids for r in reqs],
        output_lens=[r.max_tokens for r in reqs],
        loras=[specs.get(r.lora_name) for r in reqs],
        warmup_prompts=[r.prompt_token_ids for r in warm],
        warmup_output_lens=[r.max_tokens for r in warm],
        warmup_loras=[specs.get(r.lora_name) for r in warm],
        max_num_seqs=max(64, args.num_requests),
        max_loras=max(1, n),
        max_lora_rank=args.rank,
    )
    log(f"machine: {machine()}")
    return run_against_vllm(work, args, f"Prefix-cache burst, {n} adapters + base")


def run(args: argparse.Namespace, threads: int, out_dir: Path) -> dict:
    from engine import EngineConfig, LLMEngine, LoRARequest
    from engine.models.loader import resolve_model

    path = resolve_model(args.model)
    n = args.num_adapters
    paths = make_random_adapters(path, out_dir, n, args.rank, ALL_LINEARS, args.seed)
    names = [f"pc-lora-{t}" for t in range(n)]
    loras = {
        name: LoRARequest(name, i + 1, str(p))
        for i, (name, p) in enumerate(zip(names, paths, strict=True))
    }
    config = dict(
        model=str(path),
        max_loras=max(1, n),
        max_lora_rank=args.rank,
        max_num_seqs=max(64, args.num_requests),
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_gb,
    )
    engines = {
        "off": LLMEngine(EngineConfig(**config, enable_prefix_caching=False)),
        "on": LLMEngine(EngineConfig(**config, enable_prefix_caching=True)),
    }
    tokenizer = engines["on"].tokenizer
    reqs = build_workload(
        tokenizer, args.num_requests, n, args.system_len, tuple(args.user_words),
        args.output_len, args.seed, names,
    )  # fmt: skip
    runner = engines["on"].model_runner
    num_prompt = sum(len(r.prompt_token_ids) for r in reqs)
    log(f"machine: {machine()}")
    log(
        f"model: {path} ({runner.args.num_layers} layers, {runner.device.type} "
        f"{str(runner.dtype)[6:]}, {threads} threads), block_size {args.block_size}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    log(
        f"workload: {len(reqs)} chat requests, {n} adapters (rank {args.rank}) + base = "
        f"{n + 1} tenants, system prompts {args.system_len} tokens, prompts "
        f"{min(len(r.prompt_token_ids) for r in reqs)}-{max(len(r.prompt_token_ids) for r in reqs)}"
        f" tokens ({num_prompt} in all), {args.output_len} output tokens each, seed {args.seed}"
    )
    # warm-up: every adapter into its slot once, allocators and kernels at prefill size
    warm = build_workload(tokenizer, n + 1, n, args.system_len, (4, 4), 2, args.seed + 1, names)
    for engine in engines.values():
        run_burst(engine, warm, loras)
    warm_stats = engines["on"].stats()

    runs: dict[str, list[RunStats]] = {"off": [], "on": []}
    for i in range(args.alternations):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            engines[mode].reset_prefix_cache()
            stats = run_burst(engines[mode], reqs, loras)
            runs[mode].append(stats)
            log(
                f"  run {i + 1} caching {mode:3s}: TTFT p50 {percentile(stats.ttft_s, 50):6.2f} s"
                f" p99 {percentile(stats.ttft_s, 99):6.2f} s, {stats.tok_per_s:6.1f} tok/s "
                f"({stats.seconds:.1f} s), cached prompt tokens {stats.num_cached_tokens}"
            )
    return report(engines, runs, num_prompt, warm_stats)


def report(
    engines: dict, runs: dict[str, list[RunStats]], num_prompt: int, warm_stats: dict
) -> dict:
    pooled = {m: [t for r in rs for t in r.ttft_s] for m, rs in runs.items()}
    p50 = {m: percentile(pooled[m], 50) for m in runs}
    p99 = {m: percentile(pooled[m], 99) for m in runs}
    tps = {m: statistics.median(r.tok_per_s for r in rs) for m, rs in runs.items()}
    pairs = list(zip(runs["off"], runs["on"], strict=True))
    ttft_p50_ratio = statistics.median(
        percentile(off.ttft_s, 50) / percentile(on.ttft_s, 50) for off, on in pairs
    )
    ttft_p99_ratio = statistics.median(
        percentile(off.ttft_s, 99) / percentile(on.ttft_s, 99) for off, on in pairs
    )
    tput_ratio = statistics.median(on.tok_per_s / off.tok_per_s for off, on in pairs)
    identical = sum(off.outputs[rid] == on.outputs[rid] for off, on in pairs for rid in off.outputs)
    stats = {m: e.stats() for m, e in engines.items()}
    queries = stats["on"]["prefix_cache_queries"] - warm_stats["prefix_cache_queries"]
    hits = stats["on"]["prefix_cache_hits"] - warm_stats["prefix_cache_hits"]
    log()
    log(f"{'':22s}{'caching off':>14s}{'caching on':>14s}")
    log(f"{'TTFT p50 (s)':22s}{p50['off']:14.3f}{p50['on']:14.3f}")
    log(f"{'TTFT p99 (s)':22s}{p99['off']:14.3f}{p99['on']:14.3f}")
    log(f"{'throughput (tok/s)':22s}{tps['off']:14.1f}{tps['on']:14.1f}")
    on_cached = statistics.median(r.num_cached_tokens for r in runs["on"])
    log(f"cached prompt tokens per run (on): {on_cached:.0f} of {num_prompt}")
    log(
        f"prefix cache (on engine, timed runs): queries {queries}, hits {hits}, hit rate "
        f"{hits / max(1, queries):.3f}; preemptions off {stats['off']['num_preemptions']}, "
        f"on {stats['on']['num_preemptions']}"
    )
    log(
        f"greedy outputs identical off / on: {identical}/{len(pairs) * len(runs['off'][0].outputs)}"
    )
    log(
        f"ratio TTFT p50 off / on: {ttft_p50_ratio:.2f}x  {verdict(ttft_p50_ratio, TTFT_TARGET, True)}"
    )
    log(f"ratio TTFT p99 off / on: {ttft_p99_ratio:.2f}x")
    log(
        f"ratio throughput on / off: {tput_ratio:.2f}x  "
        f"{verdict(tput_ratio, THROUGHPUT_TARGET, True)}"
    )
    return {
        "ttft_p50_off": p50["off"],
        "ttft_p50_on": p50["on"],
        "ttft_p99_off": p99["off"],
        "ttft_p99_on": p99["on"],
        "tok_s_off": tps["off"],
        "tok_s_on": tps["on"],
        "ttft_p50_ratio": ttft_p50_ratio,
        "ttft_p99_ratio": ttft_p99_ratio,
        "throughput_ratio": tput_ratio,
        "identical": identical,
        "num_outputs": len(pairs) * len(runs["off"][0].outputs),
        "cached_tokens_on": on_cached,
        "cached_tokens_off": statistics.median(r.num_cached_tokens for r in runs["off"]),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "stats": stats,
    }


if __name__ == "__main__":
    main()
