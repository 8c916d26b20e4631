"""Where a routing benchmark's slow requests spend their time (benchmarks/routing.py).

`TimedLLMServer` is LLMServer with one more method, `complete_timed`: the same `complete`,
returning with it the replica's wall-clock times of the request's phases and the replica's
load when it arrived. The benchmark calls it in every arm alike (the wrapper costs a few
`time.time()` calls), so each request's latency splits into:

  to_replica   driver send -> the replica's method starts (routing, Ray's transport, the
               replica's event loop)
  adapter      -> the adapter's LoRARequest is ready (the catalog lookup)
  first_token  -> the first output (a missing adapter's read: raylora's in the thread that
               adds the request, off the engine lock, the peer's under it; the engine queue,
               slot activation, prefill)
  rest         -> the last output (decode)
  back         -> the driver has the answer

All on one machine, so the driver's and the replicas' `time.time()` agree. `held` is where the
request's adapter was when it arrived ("slot", "cpu" or "none"; "base" without one), as the
engine last reported (its residency listener): a hit or a miss of each tier.
"""

from __future__ import annotations

import contextvars
import statistics
import time
from collections import Counter

from benchmarks.routing_cpu import run_cpu_text, thread_cpu
from deployments.llm_server import LLMServer

PHASES = ("to_replica", "adapter", "first_token", "rest", "back")

# the running request's timing dict, for the _lora_request and _run overrides (same task)
_TIMING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("timing", default=None)


class TimedLLMServer(LLMServer):
    async def complete_timed(self, request):
        """`complete`, and the replica's times of the request's phases."""
        timing = {"arrive": time.time(), "inflight": self._num_inflight, "replica": self.replica_id}
        token = _TIMING.set(timing)
        try:
            out = await self.complete(request)
        finally:
            _TIMING.reset(token)
        timing["done"] = time.time()
        timing.setdefault("lora", timing["arrive"])
        timing.setdefault("held", "base")
        return out, timing

    async def _lora_request(self, name: str):
        timing = _TIMING.get()
        if timing is not None:
            timing["held"] = self._held(name)
        out = await super()._lora_request(name)
        _mark("lora")
        return out

    async def _run(self, request):
        async for out, first in super()._run(request):
            if first:
                _mark("first")
            yield out, first

    def stats(self):
        out = super().stats()
        out["thread_cpu"] = thread_cpu()
        return out

    def _held(self, name: str) -> str:
        in_slots = getattr(self, "_in_slots", frozenset())
        return "slot" if name in in_slots else "cpu" if name in self._in_cpu else "none"

    def _on_residency(self, slots: list[str], cpu: list[str]) -> None:
        super()._on_residency(slots, cpu)
        self._in_slots = set(slots)  # one assignment from the engine thread


def _mark(phase: str) -> None:
    """Note when the running request (complete_timed's, in this task) reached `phase`."""
    timing = _TIMING.get()
    if timing is not None:
        timing[phase] = time.time()


def phases(sent: float, received: float, t: dict) -> dict[str, float]:
    """One request's phases in ms (driver send / receive times and the replica's dict)."""
    marks = [sent, t["arrive"], t["lora"], t.get("first", t["done"]), t["done"], received]
    return {p: 1000 * (b - a) for p, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}


def summarize(timings: dict[int, dict], tail: float = 0.01) -> dict:
    """Mean phases over all requests and over the slowest `tail` of them, and how the tail's
    requests spread over replicas and over the replica's load at arrival."""
    rows = sorted(timings.values(), key=lambda r: -r["total"])
    slow = rows[: max(1, int(tail * len(rows)))]

    def mean_phases(rs: list[dict]) -> dict[str, float]:
        return {p: statistics.fmean(r["phases"][p] for r in rs) for p in PHASES}

    return {
        "all": mean_phases(rows),
        "tail": mean_phases(slow),
        "tail_n": len(slow),
        "tail_replicas": sorted(Counter(r["replica"] for r in slow).values(), reverse=True),
        "tail_inflight": statistics.fmean(r["inflight"] for r in slow),
        "all_inflight": statistics.fmean(r["inflight"] for r in rows),
        "served": sorted(Counter(r["replica"] for r in rows).values(), reverse=True),
    }


def print_summary(policy: str, s: dict) -> None:
    fmt = " ".join(f"{p} {s['all'][p]:.1f}" for p in PHASES)
    tail = " ".join(f"{p} {s['tail'][p]:.1f}" for p in PHASES)
    print(f"  {policy}: mean ms: {fmt}; in flight at arrival {s['all_inflight']:.2f}")
    print(
        f"  {policy}: slowest {s['tail_n']} ms: {tail}; in flight at arrival "
        f"{s['tail_inflight']:.2f}; per replica {s['tail_replicas']} (all: {s['served']})"
    )


# ---- reading a benchmark's --latencies-out file ---------------------------------------------

# the trace's adapters, most requested first, split into groups of these sizes (the rest last)
POPULARITY_GROUPS = (1, 4, 10)


def percentile(xs: list[float], q: float) -> float:
    """The value at index int(q * n) of `xs` sorted (NaN if empty): benchmarks/routing.py's
    judged p50 / p99 and this file's figures."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def popularity_groups(trace: list, sizes: tuple[int, ...] = POPULARITY_GROUPS) -> list[set[str]]:
    """The trace's adapters by request count, most requested first (name among equals), in
    groups of `sizes`, then one group of the rest (empty groups left out)."""
    counts = Counter(adapter for _, adapter in trace)
    ranked = sorted(counts, key=lambda a: (-counts[a], a))
    groups, start = [], 0
    for size in (*sizes, len(ranked)):
        if ranked[start : start + size]:
            groups.append(set(ranked[start : start + size]))
        start += size
    return groups


def by_popularity(record: dict, sizes: tuple[int, ...] = POPULARITY_GROUPS) -> dict[str, list]:
    """policy -> per popularity group, every run pooled: (adapters, requests, first token p50
    and p99 ms, latency p99 ms)."""
    adapter_of = [adapter for _, adapter in record["trace"]]
    groups = popularity_groups(record["trace"], sizes)
    out: dict[str, list] = {}
    for policy in dict.fromkeys(r["policy"] for r in record["runs"]):
        rows = []
        for group in groups:
            first, total = [], []
            for run in record["runs"]:
                if run["policy"] != policy:
                    continue
                for i, t in run["timings"].items():
                    if adapter_of[int(i)] in group:
                        first.append(t["phases"]["first_token"])
                        total.append(t["total"])
            rows.append(
                (
                    len(group),
                    len(first),
                    percentile(first, 0.5),
                    percentile(first, 0.99),
                    percentile(total, 0.99),
                )
            )
        out[policy] = rows
    return out


HELD = ("slot", "cpu", "none", "base")


def by_residency(record: dict) -> dict[str, list]:
    """policy -> per place the adapter was held at arrival (HELD), every run pooled:
    (place, requests, first token p50 and p99 ms, latency p99 ms); files from before `held`
    was recorded give none."""
    out: dict[str, list] = {}
    for policy in dict.fromkeys(r["policy"] for r in record["runs"]):
        rows = []
        for place in HELD:
            ts = [
                t
                for r in record["runs"]
                if r["policy"] == policy
                for t in r["timings"].values()
                if t.get("held") == place
            ]
            if ts:
                first = [t["phases"]["first_token"] for t in ts]
                total = [t["total"] for t in ts]
                row = (place, len(ts), percentile(first, 0.5), percentile(first, 0.99))
                rows.append((*row, percentile(total, 0.99)))
        out[policy] = rows
    return out


def decode_by_run(record: dict) -> list[tuple[int, str, float]]:
    """(run, policy, mean decode ms) in the order the runs ran: the decode of a few tokens is
    the same work in every arm, so its drift between runs is the machine's."""
    return [
        (
            r["run"],
            r["policy"],
            statistics.fmean(t["phases"]["rest"] for t in r["timings"].values()),
        )
        for r in record["runs"]
        if r["timings"]
    ]


def decode_alone(record: dict) -> list[tuple[int, str, float, int]]:
    """(run, policy, mean decode ms, requests) over the requests in flight while no other
    request of the run was (on any replica): nothing shared the machine's cores with them,
    so this is the machine's speed in that run, whatever the router did."""
    trace = record["trace"]
    out = []
    for r in record["runs"]:
        spans = sorted(
            (trace[int(i)][0] * 1000, trace[int(i)][0] * 1000 + t["total"], t["phases"]["rest"])
            for i, t in r["timings"].items()
        )
        alone = []
        reach = float("-inf")  # the latest end among the requests before this one
        for j, (start, end, rest) in enumerate(spans):
            after = spans[j + 1][0] if j + 1 < len(spans) else float("inf")
            if reach <= start and end <= after:
                alone.append(rest)
            reach = max(reach, end)
        if alone:
            out.append((r["run"], r["policy"], statistics.fmean(alone), len(alone)))
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(
        description="First-token and latency percentiles by adapter popularity, every run "
        "pooled, from benchmarks/routing.py --latencies-out"
    )
    ap.add_argument("latencies", help="the JSON file --latencies-out wrote")
    args = ap.parse_args(argv)
    with open(args.latencies) as f:
        record = json.load(f)
    names = ["most requested", *(f"next {n}" for n in POPULARITY_GROUPS[1:]), "the rest"]
    for policy, rows in by_popularity(record).items():
        timings = [
            t for r in record["runs"] if r["policy"] == policy for t in r["timings"].values()
        ]
        means = " ".join(
            f"{p} {statistics.fmean(t['phases'][p] for t in timings):.2f}"
            for p in PHASES
            if all(p in t["phases"] for t in timings)
        )
        print(f"{policy}: mean ms, all runs: {means}")
        for name, (adapters, n, ft50, ft99, p99) in zip(names, rows, strict=False):
            print(
                f"  {name:<15}{adapters:>3} adapters {n:>6} requests: first token p50 "
                f"{ft50:5.1f} p99 {ft99:5.1f} ms; latency p99 {p99:5.1f} ms"
            )
    for policy, rows in by_residency(record).items():
        print(f"{policy}: by where the adapter was held at arrival (slot / CPU cache / neither)")
        for place, n, ft50, ft99, p99 in rows:
            print(
                f"  {place:<5}{n:>6} requests: first token p50 {ft50:5.1f} p99 {ft99:5.1f} ms; "
                f"latency p99 {p99:5.1f} ms"
            )
    drift = ", ".join(f"{run}:{policy} {ms:.1f}" for run, policy, ms in decode_by_run(record))
    print(f"mean decode ms per run, in the order run: {drift}")
    alone = ", ".join(
        f"{run}:{policy} {ms:.1f} ({n})" for run, policy, ms, n in decode_alone(record)
    )
    print(f"the same over requests with nothing else in flight (the machine's speed): {alone}")
    for r in record["runs"]:  # files from before the CPU accounting have none
        if r.get("cpu_s"):
            print(f"run {r['run']}:{r['policy']}: {run_cpu_text(r)}")


if __name__ == "__main__":
    main()
