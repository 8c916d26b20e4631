"""Shared pieces of the engine benchmarks: the workload, the two runners (raylora's engine
and HF transformers / PEFT `generate`) and random PEFT adapters; decode-step timing is in
benchmarks/decode_timing.py.

Every benchmark runs raylora and its peer in the same process, one after the other, on the
same workload, and prints the ratio: the CPUs are shared, so absolute figures drift from run
to run while ratios measured seconds apart hold much better.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg: str = "") -> None:
    print(msg, flush=True)


def setup_threads(num_threads: int | None) -> int:
    """Same intra-op thread count for raylora and its peer (default: every core)."""
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    return torch.get_num_threads()


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), python {platform.python_version()}"
    )


# ---- workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]  # [num_requests] prompt token ids
    output_lens: list[int]  # [num_requests] exact number of tokens to generate

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    vocab_low: int,
    vocab_high: int,
    seed: int,
) -> Workload:
    """Random prompt token ids in [vocab_low, vocab_high) (past the special tokens) and output
    lengths, both uniform in their inclusive ranges, from one seed."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(vocab_low, vocab_high) for _ in range(n)])
        outs.append(rng.randint(*output_lens))
    return Workload(prompts, outs)


def vocab_range(tokenizer, vocab_size: int) -> tuple[int, int]:
    """Token ids that are ordinary text tokens: past every special id, inside the tokenizer."""
    low = max(tokenizer.all_special_ids, default=-1) + 1
    return low, min(vocab_size, len(tokenizer))


# ---- runners -------------------------------------------------------------------------------


@dataclass
class RunResult:
    num_tokens: int  # useful generated tokens (the ones the workload asked for)
    seconds: float  # wall time from the first submit to the last token
    token_ids: list[list[int]]  # [num_requests] generated ids, workload order

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.seconds


def run_engine(
    engine, workload: Workload, loras: list | None = None, desc: str = "raylora"
) -> RunResult:
    """Submit every request at once (greedy, exact lengths), step until all finish."""
    from engine import SamplingParams

    loras = loras or [None] * len(workload.prompts)
    bar = tqdm(total=workload.num_output_tokens, desc=desc, unit="tok", mininterval=1.0)
    done: dict[str, list[int]] = {}
    seen: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, loras[i])
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            bar.update(n - seen.get(out.request_id, 0))
            seen[out.request_id] = n
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    bar.close()
    ids = [done[f"r{i}"] for i in range(len(workload.prompts))]
    return RunResult(sum(len(t) for t in ids), seconds, ids)


@torch.inference_mode()
def run_hf(
    model,
    workload: Workload,
    batch_size: int,
    pad_id: int,
    adapter_names: list[str] | None = None,
    desc: str = "HF generate",
) -> RunResult:
    """HF `generate` in batches of batch_size (workload order): left padding, greedy, each
    batch runs to its longest requested output; only the requested tokens count as useful.
    adapter_names (one per request) turns on PEFT's mixed-adapter batches."""
    n_req = len(workload.prompts)
    ids: list[list[int]] = []
    t0 = time.perf_counter()
    for b in tqdm(range(0, n_req, batch_size), desc=desc, unit="batch"):
        prompts = workload.prompts[b : b + batch_size]
        wants = workload.output_lens[b : b + batch_size]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        input_ids, mask = input_ids.to(model.device), mask.to(model.device)
        extra = (
            {} if adapter_names is None else {"adapter_names": adapter_names[b : b + batch_size]}
        )
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max(wants),
            min_new_tokens=max(wants),  # no early EOS: exact lengths
            pad_token_id=pad_id,
            top_p=None,
            top_k=None,
            temperature=None,
            **extra,
        )
        ids.extend(out[row, width : width + want].tolist() for row, want in enumerate(wants))
    seconds = time.perf_counter() - t0
    return RunResult(sum(len(t) for t in ids), seconds, ids)


def load_hf_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
):
    """The HF peer, on the device and in the dtype raylora's engine runs (fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock timer covers it (CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def num_matching(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(requests whose outputs are identical, mean fraction of the common prefix)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next(
            (i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y))
        )
        prefix.append(k / max(len(x), 1))
    return same, statistics.fmean(prefix)


# ---- adapters ------------------------------------------------------------------------------


def make_random_adapters(
    model_path: str | Path,
    out_dir: Path,
    num_adapters: int,
    rank: int,
    targets: list[str],
    seed: int,
) -> list[Path]:
    """num_adapters PEFT LoRA folders with seeded random A and B (PEFT starts B at zero, which
    would make every adapter a no-op). B is small so the outputs stay model-like."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(
        load_hf_model(model_path), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    )
    paths = []
    for i in tqdm(range(num_adapters), desc="random adapters", unit="adapter"):
        gen = torch.Generator().manual_seed(seed * 10_007 + i)
        with torch.no_grad():
            for name, w in pm.named_parameters():
                if "lora_A" in name:
                    w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
                elif "lora_B" in name:
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
        path = out_dir / f"bench-lora-{i}"
        pm.save_pretrained(str(path))
        paths.append(path)
    return paths


def finish_all(engine) -> None:
    for req_id in list(engine.output_processor.requests):
        engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return f"{'MET' if ok else 'MISSED'} (target {sign} {target:g}x)"
