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

All on one machine, so the driver's and the replicas' `time.time()` agree.
"""

from __future__ import annotations

import contextvars
import statistics
import time
from collections import Counter

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
        return out, timing

    async def _lora_request(self, name: str):
        out = await super()._lora_request(name)
        _mark("lora")
        return out

    async def _run(self, request):
        async for out, first in super()._run(request):
            if first:
                _mark("first")
            yield out, first


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
