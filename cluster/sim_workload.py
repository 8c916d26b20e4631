"""The simulator's workload: the Zipf law of adapter popularity and the trace drawn from it
(Poisson arrivals, each request an independent draw: base model or an adapter by its share).
One place for both, so the floors (cluster/sim_floors.py) reason about the law the trace is
drawn from."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator, Sequence

from cluster.sim_config import Request, SimConfig


def zipf_weights(cfg: SimConfig) -> list[float]:
    """Popularity of the adapter of each rank (1/k^s, unnormalised), most popular first."""
    return [1.0 / (k**cfg.zipf_s) for k in range(1, cfg.num_adapters + 1)]


def zipf_shares(cfg: SimConfig) -> list[float]:
    """p_a of the adapter of each popularity rank (the workload's own law), most popular first."""
    w = zipf_weights(cfg)
    total = sum(w)
    return [x / total for x in w]


def adapter_name(popularity_rank: int) -> str:
    return f"adapter-{popularity_rank:04d}"


def adapter_shares(cfg: SimConfig) -> dict[str, float]:
    """adapter -> its share of the workload's law (the true rates, which no system is told)."""
    return {adapter_name(k): p for k, p in enumerate(zipf_shares(cfg))}


def workload(cfg: SimConfig) -> Iterator[Request]:
    """`cfg`'s requests in arrival order (same seed -> same requests)."""
    rng = random.Random(cfg.seed)
    cum = list(itertools.accumulate(zipf_weights(cfg)))
    total = cum[-1]
    rate = cfg.arrival_rate_per_ms()
    t = 0.0
    for seq in range(cfg.num_requests):
        t += rng.expovariate(rate)
        if rng.random() < cfg.base_fraction:
            adapter = ""
        else:
            k = min(bisect.bisect_left(cum, rng.random() * total), cfg.num_adapters - 1)
            adapter = adapter_name(k)
        p = rng.randint(cfg.prompt_tokens // 2, cfg.prompt_tokens * 3 // 2)
        o = rng.randint(max(1, cfg.output_tokens // 2), cfg.output_tokens * 3 // 2)
        tenant, prefix = "", 0
        if cfg.system_prompt_tokens > 0:  # a tenant's system prompt, then the user's turn
            tenant = adapter or f"base-{rng.randrange(max(1, cfg.num_base_tenants))}"
            prefix = cfg.system_prompt_tokens
        yield Request(seq, adapter, t, prefix + p, o, tenant, prefix)


def adapter_trace(cfg: SimConfig) -> list[str]:
    """The adapters of `cfg`'s trace, in arrival order (base requests need no slot)."""
    return [r.adapter for r in workload(cfg) if r.adapter]


def adapter_ranks(cfg: SimConfig, seq: Sequence[str] | None = None) -> list[int]:
    """The popularity ranks (0 = most requested) of the trace's adapter requests, in arrival
    order: what cluster/sim_floors.py's `learner_slot_floor_per_1k` takes (`seq`: that
    trace's adapters, if the caller made them already)."""
    rank = {adapter_name(k): k for k in range(cfg.num_adapters)}
    return [rank[a] for a in (adapter_trace(cfg) if seq is None else seq)]
