"""The GPU decode check (issue 17): kernels, graph replays and decode speed, once, on a GPU.

    python benchmarks/gpu_decode_check.py              # CUDA; run by benchmarks/gpu_check.sh
    python benchmarks/gpu_decode_check.py --dry-run    # CPU: Triton interpreter, tiny shapes,
                                                       # EagerGraph in place of CUDA graphs

Parts, in order, each in try/except under its own time limit (--limit-scale scales them):
  kernels  paged decode attention and the graph-safe LoRA shrink/expand (StaticLoRAMeta), each
           captured once and replayed with other context lengths, block tables and adapter
           mixes, against the float64 / fp32 references (*_ref);
  replay   the engine's decode graphs (SmolLM2 shapes, fp32, Triton LoRA, three adapters),
           replayed for batches, contexts, tables and adapter mixes other than the capture's,
           against the eager static step of the same rows (gpu_decode_engines.part_replay);
  smollm2  a random SmolLM2-shaped model: engine.step() under graphs against the bare graph
           forward of the same batch; 16 adapters (r16, all linears) against base; engine
           against HF generate (base) and PEFT (mixed adapters);
  llama    Llama-3-8B shapes, random weights made on the device: tok/s at batch 1/16/64 and
           context 512/2048, base and 16 adapters; KV blocks at gpu_memory_utilization 0.9;
           graph capture time; bytes per step against the copy bandwidth of this run;
  profile  the top kernels of one replay (the llama part's largest LoRA step).
Targets (printed, never asserted): graph step <= 1.3x the bare graph forward; 16 adapters
<= 1.15x base; engine >= 10x HF generate (64 requests); Llama-3-8B batch 64: bytes read per
step / step time >= 60% of the copy bandwidth.

Every figure goes to --json (default $OUT/gpu_decode_check.json, OUT=/tmp) as it is measured.
Exit status 1 when a correctness check fails or a part does not finish; timings never fail it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

if "--dry-run" in sys.argv:  # before triton is imported: its kernels run on the CPU
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("RAYLORA_CPU_KERNEL", "0")  # no C++ build; the GPU's code paths
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import gpu_decode_kernels as kernel_checks  # noqa: E402
from benchmarks.common import log, sync  # noqa: E402

PARTS = ("kernels", "replay", "smollm2", "llama", "profile")


@dataclass(frozen=True)
class Scale:
    """Every size of the run: GPU (the real shapes) or DRY (tiny, for the CPU)."""

    attn_shapes: tuple[tuple[int, int, int], ...]  # (heads, kv heads, head_dim)
    attn_contexts: tuple[tuple[int, ...], ...]  # the capture's contexts, then each replay's
    block_size: int
    dtypes: tuple[str, ...]
    lora_layers: tuple[tuple[int, tuple[int, ...]], ...]  # (H_in, [H_out per slice])
    lora_tokens: int  # the capture size T (three rows of padding)
    lora_slots: int
    rank: int
    smollm2: dict  # make_tiny_llama kwargs ({}: the tiny test model)
    replay_seqs: int  # max_num_seqs of the replay engine
    replay_max_len: int
    batch: int  # decode batch of the smollm2 step timings
    prompt_len: int
    steps: int  # timed decode steps (medians)
    num_adapters: int
    kv_blocks: int  # KV blocks of each smollm2 engine (two engines share the device)
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    hf_batch: int
    peft_requests: int
    llama: dict  # LlamaConfig kwargs
    llama_batches: tuple[int, ...]
    llama_contexts: tuple[int, ...]
    llama_max_len: int
    copy_bytes: int
    lora_backend: str
    limits: dict[str, float] = field(default_factory=dict)  # part -> seconds


GPU = Scale(
    attn_shapes=((9, 3, 64), (32, 8, 128)),  # SmolLM2, Llama-3-8B
    attn_contexts=(
        (1, 17, 200, 513, 2048, 64, 1000, 5),
        (2048, 0, 31, 1024, 7, 513, 16, 300),  # 0: a padding row
        (3, 1, 2, 16, 17, 33, 1, 9),
    ),
    block_size=16,
    dtypes=("bfloat16", "float32"),
    lora_layers=((576, (576, 192, 192)), (4096, (14336, 14336)), (14336, (4096,))),
    lora_tokens=64,
    lora_slots=16,
    rank=16,
    smollm2=dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        initializer_range=0.02,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        dtype="bfloat16",
    ),
    replay_seqs=16,
    replay_max_len=2048,
    batch=64,
    prompt_len=128,
    steps=30,
    num_adapters=16,
    kv_blocks=4096,
    num_requests=64,
    prompt_lens=(16, 256),
    output_lens=(16, 128),
    hf_batch=16,
    peft_requests=16,
    llama=dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    llama_batches=(1, 16, 64),
    llama_contexts=(512, 2048),
    llama_max_len=4096,
    copy_bytes=1 << 30,
    lora_backend="auto",
    limits=dict(kernels=40, replay=40, smollm2=90, llama=75, profile=15),  # 260 s
)
DRY = Scale(
    attn_shapes=((4, 2, 16),),
    attn_contexts=((1, 5, 33), (33, 0, 8), (2, 1, 17)),
    block_size=4,
    dtypes=("float32",),
    lora_layers=((64, (64, 32, 32)), (48, (96,))),
    lora_tokens=8,
    lora_slots=3,
    rank=4,
    smollm2={},
    replay_seqs=8,
    replay_max_len=64,
    batch=4,
    prompt_len=6,
    steps=3,
    num_adapters=2,
    kv_blocks=256,
    num_requests=4,
    prompt_lens=(4, 12),
    output_lens=(2, 6),
    hf_batch=2,
    peft_requests=2,
    llama=dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    llama_batches=(1, 4),
    llama_contexts=(8, 24),
    llama_max_len=64,
    copy_bytes=16 << 20,
    lora_backend="triton",
    limits=dict(kernels=60, replay=60, smollm2=90, llama=60, profile=30),
)


class Report:
    """The run's JSON: meta, per part its status, seconds, figures and checks; the targets.
    Saved (atomically) after every part and wherever a part has new figures."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.data: dict = {"meta": meta, "parts": {}, "targets": {}}
        self.failed: list[str] = []  # checks that failed and parts that did not finish

    def part(self, name: str) -> dict:
        return self.data["parts"].setdefault(name, {})

    def check(self, part: dict, name: str, ok: bool, **detail: object) -> bool:
        part.setdefault("checks", {})[name] = {"ok": bool(ok), **detail}
        figures = ", ".join(f"{k} {_fmt(v)}" for k, v in detail.items())
        log(f"{'PASS' if ok else 'FAIL'} {name}: {figures}")
        if not ok:
            self.failed.append(name)
        return bool(ok)

    def target(self, name: str, value: float, target: float, higher_is_better: bool) -> None:
        """A figure against its target: printed MET / MISSED and saved, never asserted."""
        met = value >= target if higher_is_better else value <= target
        self.data["targets"][name] = {
            "value": value,
            "target": target,
            "higher_is_better": higher_is_better,
            "met": met,
        }
        log(f"{name}: {_target_line(value, met, target, higher_is_better)}")
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _fmt(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _target_line(value: float, met: bool, target: float, higher: bool) -> str:
    # targets below 1 are fractions (of the copy bandwidth), the others ratios
    show = (lambda v: f"{v:.0%}") if target < 1 else (lambda v: f"{v:.3f}x")
    return f"{show(value)}  {'MET' if met else 'MISSED'} (target {'>=' if higher else '<='} {show(target)})"


@dataclass
class Context:
    """What every part gets: the sizes, the device, a temp folder, the report, and state that
    one part leaves to a later one (checkpoints, the llama engine for the profile)."""

    scale: Scale
    device: torch.device
    tmp: Path
    report: Report
    state: dict = field(default_factory=dict)


class PartTimeout(BaseException):
    """A BaseException, as KeyboardInterrupt: the engine's step fails only its requests on an
    Exception and goes on, which would swallow the time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise PartTimeout in the main thread after `seconds` (SIGALRM: between Python
    bytecodes, so a long CUDA call finishes first). An alarm already set (pytest-timeout's)
    is put back afterwards, less the time spent here."""

    def fire(signum: int, frame: object) -> None:
        raise PartTimeout(f"stopped at its {seconds:.0f} s limit")

    t0 = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, fire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            left = max(old_delay - (time.monotonic() - t0), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def run_part(ctx: Context, name: str, fn: Callable[[dict, Context], None], limit: float) -> None:
    part = ctx.report.part(name)
    log(f"=== {name} (limit {limit:.0f} s)")
    t0 = time.perf_counter()
    try:
        with time_limit(limit):
            fn(part, ctx)
        part["status"] = "ok"
    except PartTimeout as e:
        part.update(status="timeout", error=str(e))
    except Exception as e:  # the next part still runs
        traceback.print_exc()
        part.update(status="error", error=f"{type(e).__name__}: {e}")
    finally:
        part["seconds"] = round(time.perf_counter() - t0, 2)
        if part.get("status") != "ok":
            ctx.report.failed.append(f"part {name}")
        ctx.report.save()
        gc.collect()  # the part's engines and graphs go before the next part plans memory
        if ctx.device.type == "cuda":
            with contextlib.suppress(Exception):  # a device error was reported above
                sync(ctx.device)
                torch.cuda.empty_cache()


def summary(report: Report) -> None:
    log(f"=== gpu_decode_check summary (json: {report.path})")
    for name, part in report.data["parts"].items():
        checks = part.get("checks", {})
        passed = sum(c["ok"] for c in checks.values())
        ok = part.get("status") == "ok" and passed == len(checks)
        extra = f", {passed}/{len(checks)} checks" if checks else ""
        error = f": {part['error']}" if "error" in part else ""
        log(
            f"  {'PASS' if ok else 'FAIL'} {name}: {part.get('status')} in "
            f"{part.get('seconds', 0):.1f} s{extra}{error}"
        )
    for name, t in report.data["targets"].items():
        log(f"  {name}: {_target_line(t['value'], t['met'], t['target'], t['higher_is_better'])}")
    if report.data["meta"]["dry_run"]:
        log("  (dry run: tiny shapes on the CPU; the timings are not measurements)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--json", type=Path, default=None, help="default $OUT/gpu_decode_check.json")
    p.add_argument("--smollm2", default=None, help="a SmolLM2 checkpoint folder (else random)")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiplies every time limit")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        log("FAIL: no CUDA device visible (use --dry-run on the CPU)")
        return 2
    from benchmarks import gpu_decode_engines as engines  # after the environment is set

    device = torch.device("cpu" if args.dry_run else "cuda")
    scale = DRY if args.dry_run else GPU
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (triton interpreter)"
    meta = {"device": name, "dry_run": args.dry_run, "torch": torch.__version__}
    json_path = args.json or Path(os.environ.get("OUT", "/tmp")) / "gpu_decode_check.json"
    report = Report(json_path, meta)
    log(f"gpu_decode_check on {name}, torch {torch.__version__}, parts {' '.join(args.parts)}")
    fns = {
        "kernels": kernel_checks.part_kernels,
        "replay": engines.part_replay,
        "smollm2": engines.part_smollm2,
        "llama": engines.part_llama,
        "profile": engines.part_profile,
    }
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="raylora-gpu-decode-") as tmp:
        ctx = Context(scale, device, Path(tmp), report)
        if args.smollm2:
            ctx.state["smollm2"] = Path(args.smollm2)
        for part in args.parts:
            run_part(ctx, part, fns[part], scale.limits[part] * args.limit_scale)
        ctx.state.clear()
    summary(report)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
