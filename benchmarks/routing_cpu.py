"""Where the machine's CPU went during a routing benchmark's run (benchmarks/routing.py): by
process role, the replicas' by thread (TimedLLMServer.stats adds `thread_cpu`), and the
replicas' engines' batches (LLMEngine.stats()["steps"]), each the difference between two
readings, and the text the benchmark and `routing_timing` print of a run's.
"""

from __future__ import annotations

import threading
from pathlib import Path

# a process's role, from the title Ray gives its workers (first match wins)
CPU_ROLES = (
    ("ServeReplica", "replicas"),
    ("ServeController", "controller"),
    ("AdapterRegistry", "registry"),
    ("raylet", "ray"),
    ("gcs_server", "ray"),
    ("ray::", "ray"),
    ("ray/", "ray"),
)


def cpu_by_role(roles: tuple[tuple[str, str], ...] = CPU_ROLES) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process on this machine, summed by role:
    `driver` (this process: it hosts the router), the roles of `roles` ((a text in the
    command line, its role), first match wins), `other`. The difference of two calls is what
    each used in between; a process that ended in between drops out (the roles of a run are
    alive throughout it)."""
    import os

    import psutil

    out: dict[str, float] = {}
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:  # gone, or not ours to read
            continue
        if proc.info["pid"] == me:
            role = "driver"
        else:
            title = " ".join(proc.info["cmdline"] or ())
            role = next((r for key, r in roles if key in title), "other")
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds by role between two cpu_by_role() calls (roles seen in both)."""
    return {role: max(0.0, after[role] - before[role]) for role in after if role in before}


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process's threads, by name: a Python thread's
    name with its trailing number dropped (`asyncio_3` -> `asyncio`: the default executor's
    threads, where the replica reads adapters off the engine lock), other threads (Ray's and
    torch's, started in C++) by the kernel's name for them, prefixed `native:`."""
    import os

    names = {t.native_id: t.name.rstrip("_0123456789") for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0]
        name = names.get(int(tid)) or f"native:{comm}"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def growth(before: dict[str, dict], after: dict[str, dict], field: str) -> dict[str, float]:
    """How much each total in the replicas' stats()[field] grew between two sets of replica
    stats ({replica id: stats()}), summed over the replicas (one not in `before` from 0):
    `thread_cpu` (TimedLLMServer: CPU seconds by thread name) or `steps` (LLMEngine: the
    steps that ran something, and their batches' sequences, adapters and tokens)."""
    out: dict[str, float] = {}
    for replica, stats in after.items():
        earlier = before.get(replica, {}).get(field, {})
        for key, value in stats.get(field, {}).items():
            out[key] = out.get(key, 0) + value - earlier.get(key, 0)
    return out


def cpu_text(cpu: dict[str, float]) -> str:
    """`role seconds, ...` by role name: how the benchmark and this tool print cpu_used."""
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()))


# a run's CPU seconds by role and the replicas' by thread, and the engines' batches
CPU_KEYS = ("cpu_s", "thread_cpu_s", "batches")


def run_cpu_text(run: dict, threads: int = 8) -> str:
    """A run's CPU seconds during the replay by role and (files from before the thread
    accounting have none) the replicas' `threads` busiest threads and their engines' batches."""
    text = f"CPU s during the replay: {cpu_text(run['cpu_s'])}"
    if run.get("thread_cpu_s"):
        top = sorted(run["thread_cpu_s"].items(), key=lambda kv: -kv[1])[:threads]
        text += f"; the replicas' threads: {cpu_text(dict(top))}"
    steps = (run.get("batches") or {}).get("steps")
    if steps:  # a batch's mean shape, and the engine loops' CPU a step
        b, engine_s = run["batches"], (run.get("thread_cpu_s") or {}).get("raylora-engine", 0.0)
        text += (
            f"; {steps} steps: {b['seqs'] / steps:.2f} sequences, {b['adapters'] / steps:.2f}"
            f" adapters, {b['tokens'] / steps:.1f} tokens, {1000 * engine_s / steps:.1f} ms a step"
        )
    return text
