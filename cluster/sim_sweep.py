"""The routing acceptance sweep (issue 15): every policy over a seeded Latin-hypercube design
of the configuration space, judged against `ray_multiplex`, with a Pareto plot.

Design: the default configuration (16 x 8 slots, 1,000 adapters Zipf 1.1, 10% base, 70%)
plus `--points` points of a lattice Latin hypercube over
    zipf 0.8-1.4, replicas 4-32 (log), slots 4-16, adapters 100-2,000 (log),
    base share 0-30%, utilisation 0.4-0.8:
each dimension takes `--points` evenly spaced values from its low end to its high end
(both ends included), in an order shuffled per dimension by `--design-seed`, so every range
end is run and every pair of dimensions is spread. Each point runs with two workload seeds.
A full factorial (even 3 levels: 729 points) does not fit a 2-core machine.

Judging, per run (point x seed), raylora (`affinity` on raylora's engine) against what a
Ray Serve LLM user runs (`ray_multiplex`: Ray's router on vLLM's engine, the peer): slot
loads <= 0.9x, cold loads <= 1.0x, p99 TTFT <= 0.8x, affinity's served max/mean <= 1.3, every
request completed. A run where every policy is overloaded (p50 TTFT over 10x the unloaded
time to first token) is reported, not judged. A missed target that no system can meet at
that run is marked `*` (`infeasible`, from cluster/sim_floors.py's bounds: the slot floor
of a run counts the floor of a system that must learn the adapters' shares from the run's
own trace, `learn`). The router-only
comparisons (both on raylora's engine, both on vLLM's) are printed as ranges, not judged.
One parameter set for the whole sweep: the SimConfig and router defaults.

    python -m cluster.sim_sweep --plot docs/img/routing_pareto.png     # ~4 min on 2 cores
    python -m cluster.sim_sweep --quick                                # seconds (a test)
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass, replace
from multiprocessing import get_context

from cluster.sim import SimResult, add_shared_tier_args, shared_tier_from_args, simulate
from cluster.sim_config import SimConfig
from cluster.sim_floors import (
    cold_load_floor,
    first_touch_per_1k,
    learner_slot_floor_per_1k,
    slot_load_floor,
)
from cluster.sim_workload import adapter_ranks

SWEEP_POLICIES = ("affinity", "ray_multiplex", "ray_multiplex@raylora", "affinity@vllm", "p2c")
PEER = "ray_multiplex"
DESIGN_POINTS = 24  # the sweep's design (--points, --design-seed): cluster/sim_pooled.py too
DESIGN_SEED = 15
# the router-only comparisons: (ours, theirs) on one engine
SAME_ENGINE = (("affinity", "ray_multiplex@raylora"), ("affinity@vllm", "ray_multiplex"))
TARGETS = {"slot": 0.9, "cold": 1.0, "p99": 0.8, "max_mean": 1.3}
OVERLOAD_P50 = 10.0  # x the unloaded time to first token: capacity, the autoscaler's job

# (field, low, high, log scale, integer)
DIMENSIONS = (
    ("zipf_s", 0.8, 1.4, False, False),
    ("num_replicas", 4, 32, True, True),
    ("max_loras", 4, 16, False, True),
    ("num_adapters", 100, 2000, True, True),
    ("base_fraction", 0.0, 0.3, False, False),
    ("utilization", 0.4, 0.8, False, False),
)


def design(num_points: int, seed: int) -> list[dict[str, float]]:
    """Lattice Latin hypercube: per dimension, num_points evenly spaced levels from low to
    high (ends included), shuffled independently; point i takes level perm[i]."""
    rng = random.Random(seed)
    columns: dict[str, list[float]] = {}
    for name, lo, hi, log, integer in DIMENSIONS:
        levels = []
        for i in range(num_points):
            f = i / max(1, num_points - 1)
            v = (
                math.exp(math.log(lo) + f * (math.log(hi) - math.log(lo)))
                if log
                else lo + f * (hi - lo)
            )
            levels.append(round(v) if integer else round(v, 3))
        rng.shuffle(levels)
        columns[name] = levels
    return [{name: columns[name][i] for name, *_ in DIMENSIONS} for i in range(num_points)]


@dataclass
class Run:
    point: int
    seed: int
    cfg: SimConfig
    results: dict[str, SimResult]
    floor: float  # slot_load_floor on the run's trace (the larger of the law's and `learn`)
    cold_floor: float  # cold_load_floor
    learn: float  # learner_slot_floor_per_1k: the floor of a system that learns the shares

    def overloaded(self) -> bool:
        limit = OVERLOAD_P50 * self.cfg.unloaded_service_ms()
        return all(r.ttft_p50_ms > limit for r in self.results.values())

    def ratios(self, ours: str = "affinity", peer: str = PEER) -> dict[str, float]:
        a, p = self.results[ours], self.results[peer]
        return {
            "slot": a.slot_loads_per_1k / max(p.slot_loads_per_1k, 1e-9),
            "cold": a.cold_loads_per_1k / max(p.cold_loads_per_1k, 1e-9),
            "p99": a.ttft_p99_ms / max(p.ttft_p99_ms, 1e-9),
            "max_mean": a.served_max_over_mean,
        }

    def infeasible(self) -> set[str]:
        """Targets no system can meet at this run (cluster/sim_floors.py):
        slot: the slot-load floor is over 0.9x the peer's slot loads (with the floor of a
          system that must learn the shares: no system is told them);
        cold: every adapter read once, plus the replicas a served max/mean of 1.3 forces on
          the hottest, is over the peer's cold loads;
        p99: over 1% of requests are the first of their adapter (each waits for its cold
          read, unless read ahead before anyone asks for it), so p99 TTFT >= the cold read
          + the shortest prefill, and that is over 0.8x the peer's p99."""
        cfg, p = self.cfg, self.results[PEER]
        out = set()
        if self.floor > TARGETS["slot"] * p.slot_loads_per_1k:
            out.add("slot")
        if cold_load_floor(cfg, TARGETS["max_mean"]) > TARGETS["cold"] * p.cold_loads_per_1k:
            out.add("cold")
        first_read = cfg.disk_load_ms + cfg.prompt_tokens // 2 * cfg.prefill_ms_per_token
        if first_touch_per_1k(cfg) >= 10 and first_read > TARGETS["p99"] * p.ttft_p99_ms:
            out.add("p99")
        return out

    def misses(self) -> list[str]:
        out = [k for k, v in self.ratios().items() if v > TARGETS[k]]
        if any(r.num_completed != self.cfg.num_requests for r in self.results.values()):
            out.append("incomplete")
        return out


def _run_one(job: tuple[int, int, SimConfig, tuple[str, ...]]) -> Run:
    point, seed, cfg, policies = job
    results = {p: simulate(p, cfg) for p in policies}
    ranks = adapter_ranks(cfg)
    learn = learner_slot_floor_per_1k(cfg, ranks)
    floors = slot_load_floor(cfg, learn), cold_load_floor(cfg), learn
    return Run(point, seed, cfg, results, *floors)


def parse_seeds(text: str) -> tuple[int, ...]:
    """Workload seeds from "0,1", "0-11" or "0-3,7"."""
    return tuple(
        seed
        for part in text.split(",")
        for seed in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)
    )


def sweep_configs(
    base: SimConfig, num_points: int, design_seed: int, seeds: tuple[int, ...]
) -> list[tuple[int, int, SimConfig]]:
    points = [{}] + design(num_points, design_seed)  # point 0: the default configuration
    return [
        (i, seed, replace(base, seed=seed, **point))
        for i, point in enumerate(points)
        for seed in seeds
    ]


def run_sweep(
    jobs: list[tuple[int, int, SimConfig]], policies: tuple[str, ...], workers: int
) -> list[Run]:
    tasks = [(i, s, cfg, policies) for i, s, cfg in jobs]
    if workers <= 1:
        return [_run_one(t) for t in tasks]
    # the longest first (replicas x requests), so the two workers end together
    tasks.sort(key=lambda t: -t[2].num_replicas * t[2].num_requests)
    with get_context("spawn").Pool(workers) as pool:
        runs = pool.map(_run_one, tasks, chunksize=1)
    return sorted(runs, key=lambda r: (r.point, r.seed))


def _vs_floor(loads: float, floor: float) -> str:
    # a floor under 1 load/1k makes the ratio meaningless
    return f"{loads / floor:>7.2f}" if floor >= 1.0 else f"{'-':>7}"


def _mark(run: Run, miss: str) -> str:
    """A missed target, `*` where no system can meet it."""
    return miss + ("*" if miss in run.infeasible() else "")


def format_runs(runs: list[Run]) -> str:
    head = (
        f"{'pt':>3}{'seed':>5}{'zipf':>6}{'n':>4}{'slots':>6}{'adapters':>9}{'base':>6}"
        f"{'util':>6}  {'floor':>6}{'aff':>7}{'mux':>7}{'aff/fl':>7}{'mux/fl':>7}{'learn':>7}  "
        f"{'cfloor':>6}{'aff':>6}{'mux':>6}  {'slot':>6}{'cold':>6}{'p99':>6}{'max/mean':>9}"
        f"{'mux m/m':>8}  verdict (* = no system can meet it here)"
    )
    rows = [head, "-" * len(head)]
    for run in runs:
        c, a, p = run.cfg, run.results["affinity"], run.results[PEER]
        r = run.ratios()
        if run.overloaded():
            verdict = "overloaded (not judged)"
        elif not run.misses():
            verdict = "met"
        else:
            verdict = "MISSED " + ",".join(_mark(run, m) for m in run.misses())
        rows.append(
            f"{run.point:>3}{run.seed:>5}{c.zipf_s:>6.2f}{c.num_replicas:>4}{c.max_loras:>6}"
            f"{c.num_adapters:>9}{c.base_fraction:>6.0%}{c.utilization:>6.0%}  {run.floor:>6.1f}"
            f"{a.slot_loads_per_1k:>7.1f}{p.slot_loads_per_1k:>7.1f}"
            f"{_vs_floor(a.slot_loads_per_1k, run.floor)}{_vs_floor(p.slot_loads_per_1k, run.floor)}"
            f"{run.learn:>7.1f}"
            f"  {run.cold_floor:>6.1f}{a.cold_loads_per_1k:>6.1f}{p.cold_loads_per_1k:>6.1f}  "
            f"{r['slot']:>6.2f}{r['cold']:>6.2f}{r['p99']:>6.2f}{r['max_mean']:>9.2f}"
            f"{p.served_max_over_mean:>8.2f}  {verdict}"
        )
    return "\n".join(rows)


def _range(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def summary(runs: list[Run]) -> str:
    judged = [r for r in runs if not r.overloaded()]
    met = [r for r in judged if not r.misses()]
    feasible = [r for r in judged if not set(r.misses()) - r.infeasible()]
    counts = {k: sum(1 for r in judged if k in r.misses()) for k in (*TARGETS, "incomplete")}
    derived = {k: sum(1 for r in judged if k in set(r.misses()) & r.infeasible()) for k in TARGETS}
    over = sorted({(r.point, r.seed) for r in runs if r.overloaded()})
    lines = [
        f"{len(met)}/{len(judged)} judged runs meet every target; "
        f"{len(feasible)}/{len(judged)} meet every target some system can meet there",
        "misses per target (of them, no system can meet): "
        + ", ".join(
            f"{k} {v}" + (f" ({derived[k]})" if k in derived else "") for k, v in counts.items()
        ),
        "ratios to the peer over the judged runs: "
        + ", ".join(f"{k} {_range([r.ratios()[k] for r in judged])}" for k in TARGETS),
        f"overloaded (not judged): {over or 'none'}",
    ]
    cold = [r for r in judged if "cold" in r.misses()]
    if cold:
        unbalanced = [r for r in cold if r.results[PEER].served_max_over_mean > TARGETS["max_mean"]]
        lines.append(
            f"cold reads missed in {len(cold)} runs; in {len(unbalanced)} of them the peer's own "
            f"served max/mean is over {TARGETS['max_mean']} "
            f"({_range([r.results[PEER].served_max_over_mean for r in cold])})"
        )
    for ours, theirs in SAME_ENGINE:
        both = [r for r in judged if ours in r.results and theirs in r.results]
        if both:
            ratios = [r.ratios(ours, theirs) for r in both]
            lines.append(
                f"router only, {ours} / {theirs}: "
                + ", ".join(
                    f"{k} {_range([x[k] for x in ratios])}" for k in ("slot", "cold", "p99")
                )
                + f"; slot <= 0.9 in {sum(x['slot'] <= 0.9 for x in ratios)}/{len(both)}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=DESIGN_POINTS)
    ap.add_argument("--design-seed", type=int, default=DESIGN_SEED)
    ap.add_argument("--seeds", default="0,1", help="workload seeds: 0,1 or a range, 0-11")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policies", default=",".join(SWEEP_POLICIES))
    ap.add_argument("--plot", default=None, help="save the Pareto plot (PNG) here")
    ap.add_argument("--quick", action="store_true", help="3 points, 1 seed, 1,500 requests")
    add_shared_tier_args(ap)
    ap.add_argument("--max-moves", type=int, default=SimConfig().max_moves, help="placement moves")
    args = ap.parse_args(argv)
    base = SimConfig(
        num_requests=args.requests,
        shared_tier_ms=shared_tier_from_args(args),
        max_moves=args.max_moves,
    )
    seeds = parse_seeds(args.seeds)
    points = args.points
    if args.quick:
        base = replace(base, num_requests=1500, prompt_tokens=64, output_tokens=16)
        points, seeds = 2, seeds[:1]
    policies = tuple(p for p in args.policies.split(",") if p)
    assert "affinity" in policies and PEER in policies, "the sweep judges affinity against its peer"
    jobs = sweep_configs(base, points, args.design_seed, seeds)
    if args.quick:  # keep the test to seconds: at most 8 replicas
        jobs = [(i, s, replace(c, num_replicas=min(8, c.num_replicas))) for i, s, c in jobs]
    t0 = time.perf_counter()
    runs = run_sweep(jobs, policies, args.workers)
    print(
        f"{len(jobs)} runs ({points} design points + the default, seeds {list(seeds)}), "
        f"{base.num_requests} requests each, policies {list(policies)}; ratios are affinity / "
        f"{PEER} (targets: slot {TARGETS['slot']}, cold {TARGETS['cold']}, p99 {TARGETS['p99']}"
        f", max/mean {TARGETS['max_mean']}); floor / cfloor = slot / cold load floors (per 1k; "
        "learn: the slot floor of a system that learns the shares, part of floor)"
    )
    print(
        f"raylora's shared adapter tier: {base.shared_tier_ms} ms a read (None: off); "
        f"placement moves: {base.max_moves} per plan"
    )
    print(format_runs(runs))
    print(summary(runs))
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.plot:
        from cluster.sim_plot import plot_pareto

        plot_pareto(args.plot, runs, policies)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
