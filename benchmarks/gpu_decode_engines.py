"""The engine parts of benchmarks/gpu_decode_check.py: the graph replays against eager steps,
decode timings at SmolLM2 and Llama-3-8B shapes, and the profile of one replay.

Each part_* takes (part, ctx): `part` is the part's JSON dict, filled as figures come (a part
stopped at its time limit keeps what it had), `ctx` the run's gpu_decode_check.Context.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING

import torch

from benchmarks.common import (
    ALL_LINEARS,
    Workload,
    finish_all,
    load_hf_model,
    log,
    make_workload,
    num_matching,
    run_engine,
    run_hf,
    sync,
    vocab_range,
)
from benchmarks.decode_timing import paired_ratio, time_paired_decode_steps
from benchmarks.gpu_decode_kernels import new_graph
from benchmarks.gpu_decode_models import (
    decode_rows,
    decode_step,
    graphed,
    lora_mix,
    median_time,
    random_loras,
    random_weights,
    shape_only_checkpoint,
    smollm2_checkpoint,
    write_random_adapter,
)
from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.models.llama import ModelArgs
from engine.models.loader import load_model_config
from engine.static_decode import StaticDecode

if TYPE_CHECKING:
    from benchmarks.gpu_decode_check import Context


# ---- parts ---------------------------------------------------------------------------------


def part_replay(part: dict, ctx: Context) -> None:
    """Graphs captured once at start-up (padding inputs), replayed under batches, contexts,
    block tables and adapter mixes of their own; each against the eager static step of the
    same rows (unpadded, host-built LoRA metadata, no graph), fp32."""
    s, report = ctx.scale, ctx.report
    path = smollm2_checkpoint(ctx)
    specs = [
        (4, ["q_proj", "v_proj"]),
        (16, ALL_LINEARS),
        (8, ["gate_proj", "up_proj", "down_proj"]),
    ]
    loras = random_loras(ctx, path, "replay", specs)
    m, bs = s.replay_seqs, s.block_size
    num_blocks = m * -(-s.replay_max_len // bs) + 1
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            lora_backend="triton",
            max_loras=len(loras),
            max_lora_rank=16,
            max_num_seqs=m,
            max_model_len=s.replay_max_len,
            block_size=bs,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=False,
        )
    )
    runner = engine.model_runner
    sd = graphed(engine)
    eager = StaticDecode(runner, runner.decode_attention, engine.config.max_model_len)
    for slot, lora in enumerate(loras):
        runner.lora_manager.activate(slot, lora)
    with torch.no_grad():  # attention over random KV: every context position counts
        for layer in runner.model.layers:
            layer.self_attn.k_cache.normal_()
            layer.self_attn.v_cache.normal_()
    rng = random.Random(0)
    cases = [
        (1, "one"),
        (3, "distinct"),
        (5, "random"),
        (m - 3, "skewed"),
        (m, "one"),
        (m, "base"),
        (5, "random"),
        (m - 1, "distinct"),
    ]
    replays_before = sum(sd.graphs.replays.values())
    for i, (n, mix) in enumerate(cases):
        contexts = [rng.randint(2, engine.config.max_model_len - 1) for _ in range(n)]
        blocks = rng.sample(range(runner.num_kv_blocks), runner.num_kv_blocks)
        ordered = decode_rows(contexts, lora_mix(mix, n, len(loras), rng), blocks, bs, rng)
        graph_logits, eager_logits = decode_step(sd, ordered), decode_step(eager, ordered)
        err = float((graph_logits - eager_logits).abs().max() / eager_logits.abs().max())
        same = int((graph_logits.argmax(-1) == eager_logits.argmax(-1)).sum())
        name = f"replay {i}: {n} rows on graph {sd.inputs.padded_size(n)}, {mix} adapter mix"
        detail = dict(rel_err=err, tol=1e-3, greedy_equal=f"{same}/{n}", max_context=max(contexts))
        report.check(part, name, err <= 1e-3, **detail)
    replayed = sum(sd.graphs.replays.values()) - replays_before
    report.check(part, "every replay case ran its graph", replayed == len(cases), replays=replayed)


def bare_graph_forward(engine: LLMEngine, lora: bool, iters: int) -> float:
    """Median seconds of the bare forward (hidden states + logits) captured by hand over the
    engine's static decode buffers as its last step staged them, replayed: the model alone, no
    staging, sampler, scheduler or output processing."""
    runner = engine.model_runner
    sd = runner.static_decode
    size = sd.inputs.padded_size(len(engine.scheduler.running))
    hidden = sd._graph_forward(size, lora)  # the closure the engine captures: static buffers
    graph = new_graph(runner.device)
    graph.capture(lambda: runner.model.compute_logits(hidden()), None)
    return median_time(graph.replay, iters, 3, runner.device)


def part_smollm2(part: dict, ctx: Context) -> None:
    s, report, dev = ctx.scale, ctx.report, ctx.device
    path = smollm2_checkpoint(ctx)
    n = s.num_adapters
    loras = random_loras(ctx, path, "smol", [(s.rank, ALL_LINEARS)] * n)
    common = dict(
        model=str(path),
        lora_backend=s.lora_backend,
        max_num_seqs=max(s.batch, s.num_requests),
        max_loras=n,
        max_lora_rank=s.rank,
        max_cpu_loras=n,
        num_kv_blocks=s.kv_blocks,
    )
    engines = {
        "base": LLMEngine(EngineConfig(**common, enable_lora=False)),
        "lora": LLMEngine(EngineConfig(**common)),
    }
    part["capture_s"] = {k: graphed(e).graphs.capture_seconds for k, e in engines.items()}
    tokenizer = engines["base"].tokenizer
    low, high = vocab_range(tokenizer, engines["base"].model_runner.args.vocab_size)

    # (a), (b): steady decode at one batch, the two engines stepped in turn (common.py)
    prompts = make_workload(s.batch, (s.prompt_len,) * 2, (1, 1), low, high, 0).prompts
    params = SamplingParams(temperature=0.0, max_tokens=s.steps + 8, ignore_eos=True)
    for kind, eng in engines.items():
        for i, prompt in enumerate(prompts):
            lora = loras[i % n] if kind == "lora" else None
            eng.add_request(f"{kind}-{i}", {"prompt_token_ids": prompt}, params, lora)
    timing = time_paired_decode_steps(engines, s.steps, with_forward=False, desc="decode steps")
    part["bare_graph_forward"] = "hidden states + logits, captured over the engine's buffers"
    for kind, eng in engines.items():
        step, bare = timing[kind].step_median, bare_graph_forward(eng, kind == "lora", s.steps)
        part[kind] = {
            "batch": s.batch,
            "step_ms": step * 1e3,
            "bare_graph_forward_ms": bare * 1e3,
            "contexts": timing[kind].context_lens,
        }
        log(f"{kind}: engine.step() {step * 1e3:.3f} ms, bare graph forward {bare * 1e3:.3f} ms")
        report.target(
            f"smollm2 {kind} batch {s.batch}: graph step / bare graph forward",
            step / bare,
            1.3,
            False,
        )
    ratio = paired_ratio(timing["lora"].step_s, timing["base"].step_s)
    report.target(
        f"smollm2 batch {s.batch}: {n} adapters r{s.rank} all linears / base step",
        ratio,
        1.15,
        False,
    )
    for eng in engines.values():
        finish_all(eng)

    # (c) throughput: base engine against HF generate, LoRA engine against PEFT
    work = make_workload(s.num_requests, s.prompt_lens, s.output_lens, low, high, 0)
    # Warm-up, as HF's below: the same workload once, untimed. The engine's start-up warm-up
    # (engine/warmup.py) covers the first request of each kind, not every kernel variant of
    # this workload's mixed steps: after it and an 8-request warm-up the timed run still spent
    # ~4 s of ~5.5 s in Triton compiles (H200, 2026-12-04).
    run_engine(engines["base"], work, desc="warm-up (the same workload)")
    engines["base"].reset_prefix_cache()  # the timed run computes its prompts again
    ours = run_engine(engines["base"], work, desc="raylora base")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf = load_hf_model(path, dev, engines["base"].model_runner.dtype)
    run_hf(hf, make_workload(2, (8, 8), (4, 4), low, high, 1), 2, pad, desc="warm-up HF")
    theirs = run_hf(hf, work, s.hf_batch, pad, desc=f"HF generate, batch {s.hf_batch}")
    part["hf"] = {
        "requests": s.num_requests,
        "hf_batch": s.hf_batch,
        "engine_tok_s": ours.tok_per_s,
        "hf_tok_s": theirs.tok_per_s,
        "identical": num_matching(ours.token_ids, theirs.token_ids)[0],
    }
    report.target(
        f"smollm2 {s.num_requests} requests: engine / HF generate tok/s",
        ours.tok_per_s / theirs.tok_per_s,
        10.0,
        True,
    )
    from peft import PeftModel

    # PEFT loops over the adapters in every LoRA module: on the H200 (2026-12-04) 16 requests
    # with outputs up to 128 tokens outlasted the part's limit. Outputs capped at 32 tokens.
    k = s.peft_requests
    sub = Workload(work.prompts[:k], [min(o, 32) for o in work.output_lens[:k]])
    req_loras = [loras[i % n] for i in range(k)]
    run_engine(engines["lora"], sub, req_loras, desc="warm-up (the same requests)")
    engines["lora"].reset_prefix_cache()
    ours = run_engine(engines["lora"], sub, req_loras, desc="raylora mixed adapters")
    del engines
    pm = PeftModel.from_pretrained(hf, loras[0].lora_path, adapter_name=loras[0].lora_name)
    for lora in loras[1:]:
        pm.load_adapter(lora.lora_path, adapter_name=lora.lora_name)
    names = [lora.lora_name for lora in req_loras]
    theirs = run_hf(pm.eval(), sub, s.hf_batch, pad, names, desc="PEFT mixed adapters")
    ratio = ours.tok_per_s / theirs.tok_per_s
    part["peft"] = {
        "requests": k,
        "adapters": n,
        "engine_tok_s": ours.tok_per_s,
        "peft_tok_s": theirs.tok_per_s,
        "ratio": ratio,
    }
    log(f"ratio raylora / PEFT mixed adapters ({k} requests): {ratio:.2f}x (reported only)")


def part_llama(part: dict, ctx: Context) -> None:
    """Llama-3-8B shapes (random weights made on the device, all layers): KV blocks planned at
    0.9, capture time, and decode steps over hand-made rows at each (batch, context), base and
    with every row on one of the adapters; bytes read per step against the copy bandwidth."""
    s, dev = ctx.scale, ctx.device
    path = shape_only_checkpoint(ctx.tmp / "llama", s.llama)
    args = ModelArgs.from_hf_config(load_model_config(path))
    n = s.num_adapters
    adapter = write_random_adapter(ctx.tmp / "llama-lora", args, s.rank, ALL_LINEARS, 0)
    t0 = time.perf_counter()
    with random_weights():
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                lora_backend=s.lora_backend,
                max_num_seqs=max(s.llama_batches),
                max_loras=n,
                max_lora_rank=s.rank,
                max_cpu_loras=n,
                max_model_len=s.llama_max_len,
                gpu_memory_utilization=0.9,
                enable_prefix_caching=False,
                kv_cache_memory_gb=0.1,  # the CPU's knob (dry run); CUDA plans at 0.9
            )
        )
    runner, model = engine.model_runner, engine.model_runner.model
    sd = graphed(engine)
    plan = runner.memory_plan
    part.update(
        step="StaticDecode.run over hand-made rows, logits, greedy ids to the host: the "
        "runner's decode step without scheduler and sampler (replay_ms: the graph alone)",
        engine_start_s=time.perf_counter() - t0,
        layers=args.num_layers,
        num_kv_blocks=runner.num_kv_blocks,
        memory_plan=asdict(plan) if plan else None,
        capture_s=sd.graphs.capture_seconds,
        num_graphs=len(sd.graphs.graphs),
    )
    log(plan.describe() if plan else f"{runner.num_kv_blocks} KV blocks (CPU)")
    log(f"captured {len(sd.graphs.graphs)} graphs in {sd.graphs.capture_seconds:.1f} s")
    t0 = time.perf_counter()
    for slot in range(n):
        runner.lora_manager.activate(slot, LoRARequest(f"llama-{slot}", slot + 1, str(adapter)))
    part["adapters_load_s"] = time.perf_counter() - t0
    src = torch.empty(s.copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bandwidth = 2 * s.copy_bytes / median_time(partial(dst.copy_, src), 10, 2, dev)
    del src, dst
    part["copy_bandwidth_gb_s"] = bandwidth / 1e9
    log(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)")
    esize = runner.dtype.itemsize
    weights = sum(p.numel() * esize for name, p in model.named_parameters() if "embed" not in name)
    kv_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * esize
    slot_bytes = sum(w.lora.a.nbytes + w.lora.b_t.nbytes for w in model.lora_linears().values())
    rng = random.Random(0)
    blocks = rng.sample(range(runner.num_kv_blocks), runner.num_kv_blocks)
    part["grid"] = grid = []
    for lora in (False, True):
        for context in s.llama_contexts:
            for batch in s.llama_batches:
                slots = [i % n if lora else -1 for i in range(batch)]
                ordered = decode_rows(
                    [context] * batch, slots, blocks, engine.config.block_size, rng
                )
                step = median_time(partial(decode_step, sd, ordered), s.steps, 3, dev)
                size = sd.inputs.padded_size(batch)
                replay = median_time(partial(sd.graphs.replay, size, lora), s.steps, 1, dev)
                moved = weights + batch * context * kv_per_token + (slot_bytes if lora else 0)
                row = {
                    "batch": batch,
                    "context": context,
                    "lora": lora,
                    "step_ms": step * 1e3,
                    "replay_ms": replay * 1e3,
                    "tok_s": batch / step,
                    "gb_per_step": moved / 1e9,
                    "bandwidth_frac": moved / step / bandwidth,
                }
                grid.append(row)
                log(
                    f"batch {batch:3d} context {context:5d} {f'{n} adapters' if lora else 'base':11s}"
                    f" step {step * 1e3:7.3f} ms (replay {replay * 1e3:7.3f}) {batch / step:9.1f} tok/s,"
                    f" {moved / 1e9:6.2f} GB read: {moved / step / bandwidth:.0%} of copy bandwidth"
                )
                ctx.state["profile"] = (sd, ordered, lora)  # the last: largest, with adapters
                ctx.report.save()
    for row in grid:
        if row["batch"] == max(s.llama_batches) and not row["lora"]:
            ctx.report.target(
                f"llama3-8b batch {row['batch']} context {row['context']}: bytes "
                "per step / step time, fraction of copy bandwidth",
                row["bandwidth_frac"],
                0.6,
                True,
            )


def _top_events(prof: object, cuda: bool) -> list[dict]:
    events = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t > 0 and not (cuda and e.key.startswith("cuda")):  # kernels, not runtime calls
            events.append({"name": e.key[:100], "calls": e.count, "us": float(t)})
    return sorted(events, key=lambda r: -r["us"])


def part_profile(part: dict, ctx: Context) -> None:
    """torch.profiler over one replay of the llama part's last step: its top kernels (CPU:
    the top ops of the EagerGraph replay). Should the profiler see no kernel inside the
    replay, the same step run eagerly is profiled instead (part["source"] says which)."""
    from torch.profiler import ProfilerActivity, profile

    if "profile" not in ctx.state:
        raise RuntimeError("needs the llama part's engine (run --parts llama profile)")
    sd, ordered, lora = ctx.state["profile"]
    cuda = ctx.device.type == "cuda"
    decode_step(sd, ordered)  # stage this step
    size = sd.inputs.padded_size(len(ordered))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sd.graphs.replay(size, lora)
        sync(ctx.device)
    events, source = _top_events(prof, cuda), "graph replay"
    if not events:
        eager = StaticDecode(sd.runner, sd.attention_op, sd.inputs.width * sd.block_size)
        decode_step(eager, ordered)  # warm-up
        with profile(activities=activities) as prof:
            decode_step(eager, ordered)
        events, source = _top_events(prof, cuda), "eager step (no kernels seen in the replay)"
    total = sum(r["us"] for r in events) or 1.0
    part.update(source=source, batch=len(ordered), lora=lora, total_us=total, top=events[:15])
    log(f"top {'kernels' if cuda else 'ops'} of one {source}, batch {len(ordered)}: {total:.0f} us")
    for r in events[:15]:
        log(f"  {r['us']:9.1f} us {r['us'] / total:6.1%} x{r['calls']:<4d} {r['name']}")
    ctx.report.check(part, "profile saw the step's work", bool(events), events=len(events))
