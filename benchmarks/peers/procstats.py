"""Start-up time and resident memory of this process and its children, from /proc only.

Standard library only: both peer scripts import it, one under .venv (raylora) and one under
.venv-vllm (vLLM), so that both engines are measured the same way. vLLM runs its engine core
and its CPU worker in child processes, so its memory is the sum over the process tree;
raylora runs in one process, where the tree is the process itself.
"""

from __future__ import annotations

import os
from pathlib import Path


def _status_kb(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _pss_kb(pid: int | str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces: the fields after it follow its ")"
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def memory_mb() -> dict[str, float]:
    """This process's VmRSS, and RSS and PSS summed over it and its descendants, in MB (1e6
    bytes). The tree's RSS counts pages shared between processes (libraries, shared memory)
    once per process; its PSS splits them, so PSS is the fairer total of a multi-process
    engine."""
    me = os.getpid()
    tree = [me, *descendants(me)]
    rss = pss = 0
    for pid in tree:
        try:
            rss += _status_kb(pid, "VmRSS")
            pss += _pss_kb(pid)
        except OSError:  # exited meanwhile
            pass
    return {
        "rss_mb": _status_kb(me, "VmRSS") * 1.024e-3,
        "rss_tree_mb": rss * 1.024e-3,
        "pss_tree_mb": pss * 1.024e-3,
        "num_processes": float(len(tree)),
    }


def process_start_epoch() -> float:
    """When this process started (seconds since the epoch; boot time has 1 s resolution)."""
    stat = Path("/proc/self/stat").read_text()
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
    btime = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")
