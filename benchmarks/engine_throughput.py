"""Engine throughput: raylora's engine against HF transformers `generate`, same run.

    python benchmarks/engine_throughput.py                  # default model, issue 2 workload
    python benchmarks/engine_throughput.py --model PATH --num-requests 64 --hf-batch 16 --seed 0

Workload: --num-requests requests, prompt lengths uniform in --prompt-len (random token ids)
and output lengths uniform in --output-len, from --seed; every output has exactly its length
(ignore_eos on raylora, min_new_tokens on HF). Greedy on both sides.

1. Throughput (generated tokens / wall time): raylora with every request submitted at once
   (max_num_seqs), against HF `generate` in batches of --hf-batch (left padding, each batch
   runs to its longest output; only the requested tokens count). Target: >= 2x.
2. Per-step overhead: --overhead-steps steady-state decode steps of engine.step() over a batch
   of min(num_requests, max_num_seqs) sequences, each paired with the bare
   LlamaForCausalLM forward of the same batch (engine/models/llama.py, inputs prepared ahead:
   no scheduler, input building, sampler or detokenizer). Target: step / forward <= 1.3x.

--peer vllm (after `make peer-vllm`): instead of both parts, raylora against vLLM CPU's
`LLM.generate` on the same workload (and the same warm-up), each in its own process
(benchmarks/peers/), alternated --alternations times: every run, the median ratio raylora /
vLLM, start-up and memory after load, greedy agreement. Issue 16's target: >= 1.2x.

    python benchmarks/engine_throughput.py --peer vllm --alternations 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    finish_all,
    load_hf_model,
    log,
    machine,
    make_workload,
    num_matching,
    run_engine,
    run_hf,
    setup_threads,
    verdict,
    vocab_range,
)
from benchmarks.decode_timing import time_decode_steps  # noqa: E402
from benchmarks.peers.compare import add_peer_args, run_against_vllm  # noqa: E402
from benchmarks.peers.vllm_peer import PeerWorkload  # noqa: E402

THROUGHPUT_TARGET = 2.0  # raylora tok/s over HF generate, at least
VLLM_TARGET = 1.2  # raylora tok/s over vLLM CPU's, at least (issue 16)
OVERHEAD_TARGET = 1.3  # engine step over bare forward, at most


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default' or a local checkpoint folder")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--overhead-steps",
        type=int,
        default=40,
        help="decode steps timed for the step-vs-forward overhead (0: skip)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    add_peer_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.peer == "vllm":
        return against_vllm(args)
    threads = setup_threads(args.threads)
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, enable_lora=False)
    )
    path = engine.model_path
    low, high = vocab_range(engine.tokenizer, engine.model_runner.args.vocab_size)
    work = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), low, high, args.seed
    )
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else engine.tokenizer.eos_token_id
    runner = engine.model_runner
    hf = load_hf_model(path, runner.device, runner.dtype)
    log(f"machine: {machine()}")
    log(
        f"model: {path} ({engine.model_runner.args.num_layers} layers, "
        f"hidden {runner.args.hidden_size}, {runner.device.type} {str(runner.dtype)[6:]}, "
        f"{threads} threads)"
    )
    log(
        f"workload: {args.num_requests} requests, prompts {args.prompt_len[0]}-"
        f"{args.prompt_len[1]} tokens (total {sum(map(len, work.prompts))}), outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tokens (total {work.num_output_tokens}), "
        f"seed {args.seed}"
    )

    # warm-up both sides (first calls allocate, pick kernels, fill caches)
    warm = make_workload(2, (8, 8), (4, 4), low, high, args.seed + 1)
    run_engine(engine, warm, desc="warm-up raylora")
    run_hf(hf, warm, 2, pad_id, desc="warm-up HF")

    ours = run_engine(engine, work, desc="raylora")
    preempted = engine.scheduler.num_preemptions
    theirs = run_hf(hf, work, args.hf_batch, pad_id, desc=f"HF generate, batch {args.hf_batch}")
    same, prefix = num_matching(ours.token_ids, theirs.token_ids)
    ratio = ours.tok_per_s / theirs.tok_per_s
    log("")
    log("== Engine throughput ==")
    log(
        f"raylora engine (max_num_seqs {args.max_num_seqs}): {ours.num_tokens} tokens in "
        f"{ours.seconds:.2f} s = {ours.tok_per_s:.1f} tok/s  (preemptions: {preempted})"
    )
    log(
        f"HF generate (batch {args.hf_batch}):          {theirs.num_tokens} tokens in "
        f"{theirs.seconds:.2f} s = {theirs.tok_per_s:.1f} tok/s"
    )
    log(f"ratio raylora / HF: {ratio:.2f}x  {verdict(ratio, THROUGHPUT_TARGET, True)}")
    log(
        f"greedy agreement: {same}/{len(work.prompts)} requests identical, mean common prefix "
        f"{prefix:.0%} (fp32; random-token prompts make near-ties frequent)"
    )
    result = {
        "engine_tok_s": ours.tok_per_s,
        "hf_tok_s": theirs.tok_per_s,
        "throughput_ratio": ratio,
        "identical": same,
    }
    del hf

    if args.overhead_steps > 0:
        batch = min(args.num_requests, args.max_num_seqs)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.overhead_steps + 64, ignore_eos=True
        )
        for i in range(batch):
            engine.add_request(f"o{i}", {"prompt_token_ids": work.prompts[i]}, params)
        t = time_decode_steps(engine, args.overhead_steps, desc=f"decode steps, batch {batch}")
        finish_all(engine)
        over = t.step_median / t.forward_median
        log("")
        log("== Engine step vs bare model forward (steady-state decode) ==")
        log(
            f"batch {t.batch_size}, context {t.context_lens[0]}-{t.context_lens[1]} tokens, "
            f"{len(t.step_s)} paired steps (medians)"
        )
        log(f"engine.step():       {t.step_median * 1e3:.2f} ms")
        log(f"bare model forward:  {t.forward_median * 1e3:.2f} ms")
        log(f"overhead step / forward: {over:.3f}x  {verdict(over, OVERHEAD_TARGET, False)}")
        result.update(
            step_ms=t.step_median * 1e3, forward_ms=t.forward_median * 1e3, overhead_ratio=over
        )
    return result


def against_vllm(args: argparse.Namespace) -> dict:
    """The throughput workload (and warm-up) of main(), run by raylora and by vLLM CPU, each in
    its own process (benchmarks/peers/); this process only builds the workload."""
    import json

    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model

    path = resolve_model(args.model)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    low, high = vocab_range(AutoTokenizer.from_pretrained(str(path)), vocab_size)
    work = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), low, high, args.seed
    )
    warm = make_workload(2, (8, 8), (4, 4), low, high, args.seed + 1)
    log(f"machine: {machine()}")
    log(f"model: {path}")
    log(
        f"workload: {args.num_requests} requests, prompts {args.prompt_len[0]}-"
        f"{args.prompt_len[1]} tokens (total {sum(map(len, work.prompts))}), outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tokens (total {work.num_output_tokens}), "
        f"seed {args.seed}, max_num_seqs {args.max_num_seqs}"
    )
    peer_work = PeerWorkload(
        model=str(path),
        prompts=work.prompts,
        output_lens=work.output_lens,
        warmup_prompts=warm.prompts,
        warmup_output_lens=warm.output_lens,
        max_num_seqs=args.max_num_seqs,
    )
    result = run_against_vllm(peer_work, args, "Engine throughput, base model")
    log(
        f"ratio raylora / vLLM: {result['ratio']:.2f}x  {verdict(result['ratio'], VLLM_TARGET, True)}"
    )
    return result


if __name__ == "__main__":
    main()
