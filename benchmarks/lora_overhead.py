"""LoRA overhead: many distinct adapters in one batch, against the base model and HF PEFT.

    python benchmarks/lora_overhead.py                      # default model, issue 3 workload
    python benchmarks/lora_overhead.py --model PATH --num-adapters 16 --rank 16 --batch 32
    RAYLORA_CPU_KERNEL=0 python benchmarks/lora_overhead.py   # LoRA on torch ops only (no C++)

Adapters: --num-adapters random PEFT LoRA adapters (rank --rank, every linear layer:
q,k,v,o,gate,up,down; seeded; PEFT's zero lora_B replaced by random values), written to a
temporary folder (or --adapter-dir, kept).

(a) Decode step time: --batch sequences, batch / num_adapters per adapter, all adapters in
    slots at once (max_loras = num_adapters), against the same prompts on the base model
    (no adapter) in a second, identical engine; with --lora-dtypes auto bfloat16 (the default
    on the CPU) a third engine holds the slots in bf16 (EngineConfig.lora_dtype) and is
    stepped in the same turns. Steady-state decode only (after every
    prefill); the two engines take turns, one step each, for --steps steps per round,
    --rounds rounds; the ratio is the median over the pairs of LoRA step / base step (the
    machine's speed drifts by tens of percent within a minute; a pair a fraction of a second
    apart sees the same speed). Each engine step is followed by the bare model forward of its
    batch, so the forward's own LoRA cost is printed too. Target: LoRA / base <= 1.1x.
(b) Mixed-adapter throughput: the engine_throughput workload (--num-requests, prompt and
    output lengths, --seed), request i on adapter i % num_adapters, all submitted at once,
    against HF PEFT's mixed-batch `generate(adapter_names=...)` at batch --hf-batch with the
    same adapters loaded into one PeftModel. Target: >= 2.5x.

--peer vllm (after `make peer-vllm`): (b) only, against vLLM CPU's `LLM.generate` with one
LoRARequest per request (enable_lora, max_loras = max_cpu_loras = --num-adapters, max_lora_rank
--rank) instead of HF PEFT; raylora and vLLM each in its own process (benchmarks/peers/),
after the same warm-up (one request per adapter), alternated --alternations times: every
run, the median ratio, start-up, memory after load, greedy agreement. Issue 16's target: >= 3x.

    python benchmarks/lora_overhead.py --peer vllm --alternations 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    ALL_LINEARS,
    finish_all,
    load_hf_model,
    log,
    machine,
    make_random_adapters,
    make_workload,
    num_matching,
    run_engine,
    run_hf,
    setup_threads,
    verdict,
    vocab_range,
)
from benchmarks.decode_timing import (  # noqa: E402
    graphed_forward_ratio,
    paired_ratio,
    time_paired_decode_steps,
)
from benchmarks.peers.compare import add_peer_args, run_against_vllm  # noqa: E402
from benchmarks.peers.vllm_peer import PeerWorkload  # noqa: E402

STEP_TARGET = 1.1  # LoRA decode step over base decode step, at most
MIXED_TARGET = 2.5  # raylora mixed-adapter tok/s over HF PEFT mixed-batch generate, at least
VLLM_MIXED_TARGET = 3.0  # raylora mixed-adapter tok/s over vLLM CPU's, at least (issue 16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default' or a local checkpoint folder")
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="decode batch of part (a)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per round, (a)")
    p.add_argument("--rounds", type=int, default=2, help="base/LoRA rounds of (a)")
    p.add_argument("--num-requests", type=int, default=64, help="workload of part (b)")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter-dir", default=None, help="write the adapters here (kept)")
    p.add_argument("--skip-hf", action="store_true", help="part (a) only")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--lora-dtypes",
        nargs="+",
        default=None,
        help="lora_dtype of each LoRA engine of (a); the first also runs (b) (default: auto "
        "bfloat16 on the CPU, auto on CUDA)",
    )
    add_peer_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.batch % args.num_adapters:
        raise SystemExit("--batch must be a multiple of --num-adapters")
    threads = setup_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="raylora-bench-") as tmp:
        out_dir = Path(args.adapter_dir or tmp)
        if args.peer == "vllm":
            return mixed_against_vllm(args, out_dir)
        return run(args, threads, out_dir)


def mixed_against_vllm(args: argparse.Namespace, out_dir: Path) -> dict:
    """(b) against vLLM CPU: the same adapters, workload and warm-up, each engine in its own
    process (benchmarks/peers/); this process only writes the adapters and the workload."""
    import json

    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model

    n = args.num_adapters
    path = resolve_model(args.model)
    paths = make_random_adapters(path, out_dir, n, args.rank, ALL_LINEARS, args.seed)
    specs = [{"name": p.name, "path": str(p)} for p in paths]
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    low, high = vocab_range(AutoTokenizer.from_pretrained(str(path)), vocab_size)
    work = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), low, high, args.seed
    )
    warm = make_workload(n, (8, 8), (4, 4), low, high, args.seed + 1)
    log(f"machine: {machine()}")
    log(f"model: {path}")
    log(f"adapters: {n} x rank {args.rank} on {','.join(ALL_LINEARS)} (max_loras {n})")
    log(
        f"workload: {args.num_requests} requests (request i on adapter i % {n}), prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
        f"{args.output_len[1]} ({work.num_output_tokens} tokens), seed {args.seed}"
    )
    peer_work = PeerWorkload(
        model=str(path),
        prompts=work.prompts,
        output_lens=work.output_lens,
        loras=[specs[i % n] for i in range(args.num_requests)],
        warmup_prompts=warm.prompts,
        warmup_output_lens=warm.output_lens,
        warmup_loras=specs,
        max_num_seqs=max(64, args.batch, args.num_requests),
        max_loras=n,
        max_lora_rank=args.rank,
    )
    title = f"Mixed-adapter throughput, {n} adapters rank {args.rank}"
    result = run_against_vllm(peer_work, args, title)
    log(
        f"ratio raylora / vLLM: {result['ratio']:.2f}x  "
        f"{verdict(result['ratio'], VLLM_MIXED_TARGET, True)}"
    )
    return result


def run(args: argparse.Namespace, threads: int, out_dir: Path) -> dict:
    import torch

    from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
    from engine.models.loader import resolve_model
    from raylora_kernels.cpu_kernel import cpu_lora_op

    n = args.num_adapters
    path = resolve_model(args.model)
    paths = make_random_adapters(path, out_dir, n, args.rank, ALL_LINEARS, args.seed)
    names = [p.name for p in paths]
    loras = [
        LoRARequest(name, i + 1, str(p))
        for i, (name, p) in enumerate(zip(names, paths, strict=True))
    ]
    config = dict(
        model=str(path),
        max_loras=n,
        max_lora_rank=args.rank,
        max_cpu_loras=max(32, n),
        max_num_seqs=max(64, args.batch, args.num_requests),
    )
    # the engines' device is "auto": CUDA when there is one
    on_cpu = not torch.cuda.is_available()
    dtypes = args.lora_dtypes or (["auto", "bfloat16"] if on_cpu else ["auto"])
    engine = LLMEngine(EngineConfig(**config, lora_dtype=dtypes[0]))
    low, high = vocab_range(engine.tokenizer, engine.model_runner.args.vocab_size)
    work = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), low, high, args.seed
    )
    log(f"machine: {machine()}")
    runner = engine.model_runner
    cpp = "on" if runner.device.type == "cpu" and cpu_lora_op() is not None else "off"
    log(
        f"model: {path} ({runner.args.num_layers} layers, {runner.device.type} "
        f"{str(runner.dtype)[6:]}, {threads} threads, LoRA backend {runner.lora_backend.name}, "
        f"C++ CPU kernel {cpp})"
    )
    log(f"adapters: {n} x rank {args.rank} on {','.join(ALL_LINEARS)} (max_loras {n})")

    # warm-up: every adapter into its slot once, and the allocator at batch size
    warm = make_workload(n, (8, 8), (4, 4), low, high, args.seed + 1)
    run_engine(engine, warm, loras, desc="warm-up raylora")

    # (a) decode step: the LoRA batch and the base batch on identical engines (one per LoRA
    # dtype), stepped in turn (decode_timing.time_paired_decode_steps), so each LoRA step has
    # a base step beside it.
    engines = {"base": LLMEngine(EngineConfig(**config)), "lora": engine}
    for d in dtypes[1:]:
        engines[f"lora {d}"] = LLMEngine(EngineConfig(**config, lora_dtype=d))
        run_engine(engines[f"lora {d}"], warm, loras, desc=f"warm-up lora_dtype {d}")
    labels = {
        k: "base" if k == "base" else f"LoRA, lora_dtype {k[5:] or dtypes[0]}" for k in engines
    }
    prompts = (work.prompts * (args.batch // len(work.prompts) + 1))[: args.batch]
    per = args.batch // n
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
    timing: dict[str, dict[str, list[float]]] = {k: {"step": [], "fwd": []} for k in engines}
    graphed: dict[str, float] = {}
    slot_mb = {  # the LoRA weights a decode step reads: every active slot's, all of it
        k: sum(
            (lin.lora.a.nbytes + lin.lora.b_t.nbytes) * n / lin.lora.a.shape[0]
            for lin in eng.model_runner.model.lora_linears().values()
        )
        / 1e6
        for k, eng in engines.items()
        if k != "base"
    }
    for r in range(args.rounds):
        for kind, eng in engines.items():
            for i, prompt in enumerate(prompts):
                lora = loras[i // per] if kind != "base" else None
                eng.add_request(f"{kind}{r}-{i}", {"prompt_token_ids": prompt}, params, lora)
        paired = time_paired_decode_steps(engines, args.steps, desc=f"round {r} paired decode")
        if r == 0 and runner.device.type == "cuda":
            try:
                graphed = graphed_forward_ratio(engines)
            except Exception as exc:  # a probe only: report, go on
                log(f"CUDA graph probe failed: {type(exc).__name__}: {exc}")
        for kind, eng in engines.items():
            finish_all(eng)
            timing[kind]["step"] += paired[kind].step_s
            timing[kind]["fwd"] += paired[kind].forward_s
    engines.clear()
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in timing.items()}
    log("")
    log("== LoRA overhead: decode step ==")
    log(
        f"batch {args.batch} ({per} per adapter, {n} adapters), contexts as in the workload, "
        f"{len(timing)} engines stepped in turn, {len(timing['lora']['step'])} steps each "
        "(medians; ratios: median over the step pairs)"
    )
    for k, label in labels.items():
        log(
            f"{label + ':':26s} engine.step() {med[k]['step'] * 1e3:8.2f} ms   "
            f"bare forward {med[k]['fwd'] * 1e3:8.2f} ms"
        )
    result: dict = {"base_step_ms": med["base"]["step"] * 1e3}
    for k, label in labels.items():
        if k == "base":
            continue
        step_ratio = paired_ratio(timing[k]["step"], timing["base"]["step"])
        fwd_ratio = paired_ratio(timing[k]["fwd"], timing["base"]["fwd"])
        pairs = zip(timing[k]["step"], timing["base"]["step"], strict=True)
        spread = sorted(a / b for a, b in pairs)
        log(
            f"ratio {label} / base (engine step): {step_ratio:.3f}x  "
            f"{verdict(step_ratio, STEP_TARGET, False)}  (quartiles "
            f"{spread[len(spread) // 4]:.3f} / {spread[3 * len(spread) // 4]:.3f}; "
            f"bare forward {fwd_ratio:.3f}x)"
        )
        added = statistics.median(
            a - b for a, b in zip(timing[k]["step"], timing["base"]["step"], strict=True)
        )
        rate = f": {slot_mb[k] / 1e3 / added:.1f} GB/s" if added > 0 else ""
        log(
            f"  LoRA adds {added * 1e3:.2f} ms a step (median of the pairs), reading "
            f"{slot_mb[k]:.0f} MB of slot weights{rate}"
        )
        result[f"added_ms{'' if k == 'lora' else '_' + k[5:]}"] = added * 1e3
        suffix = "" if k == "lora" else "_" + k[5:]
        result[f"lora_step_ms{suffix}"] = med[k]["step"] * 1e3
        result[f"step_ratio{suffix}"] = step_ratio
        result[f"forward_ratio{suffix}"] = fwd_ratio
    if graphed:  # a probe (CUDA only): the engine itself runs eager
        log(
            f"bare forward as a CUDA graph (replay, not what the engine runs): base "
            f"{graphed['base'] * 1e3:.3f} ms, LoRA {graphed['lora'] * 1e3:.3f} ms, ratio "
            f"{graphed['lora'] / graphed['base']:.3f}x"
        )
    if args.skip_hf:
        return result

    # (b) mixed-adapter throughput against HF PEFT
    from peft import PeftModel

    req_loras = [loras[i % n] for i in range(args.num_requests)]
    ours = run_engine(engine, work, req_loras, desc="raylora mixed adapters")
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else engine.tokenizer.eos_token_id
    del engine
    hf = load_hf_model(path, runner.device, runner.dtype)
    pm = PeftModel.from_pretrained(hf, str(paths[0]), adapter_name=names[0])
    for name, p in zip(names[1:], paths[1:], strict=True):
        pm.load_adapter(str(p), adapter_name=name)
    pm.eval()
    req_names = [names[i % n] for i in range(args.num_requests)]
    run_hf(
        pm,
        make_workload(2, (8, 8), (4, 4), low, high, args.seed + 1),
        2,
        pad_id,
        req_names[:2],
        desc="warm-up HF PEFT",
    )
    theirs = run_hf(
        pm, work, args.hf_batch, pad_id, req_names, desc=f"HF PEFT mixed, batch {args.hf_batch}"
    )
    same, prefix = num_matching(ours.token_ids, theirs.token_ids)
    ratio = ours.tok_per_s / theirs.tok_per_s
    log("")
    log("== LoRA overhead: mixed-adapter throughput ==")
    log(
        f"workload: {args.num_requests} requests (request i on adapter i % {n}), prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-"
        f"{args.output_len[1]} ({work.num_output_tokens} tokens), seed {args.seed}"
    )
    log(
        f"raylora engine (max_loras {n}): {ours.num_tokens} tokens in {ours.seconds:.2f} s = "
        f"{ours.tok_per_s:.1f} tok/s"
    )
    log(
        f"HF PEFT generate(adapter_names=...) (batch {args.hf_batch}): {theirs.num_tokens} "
        f"tokens in {theirs.seconds:.2f} s = {theirs.tok_per_s:.1f} tok/s"
    )
    log(f"ratio raylora / HF PEFT: {ratio:.2f}x  {verdict(ratio, MIXED_TARGET, True)}")
    log(
        f"greedy agreement: {same}/{args.num_requests} requests identical, mean common prefix "
        f"{prefix:.0%}"
    )
    result.update(
        engine_tok_s=ours.tok_per_s, peft_tok_s=theirs.tok_per_s, mixed_ratio=ratio, identical=same
    )
    return result


if __name__ == "__main__":
    main()
