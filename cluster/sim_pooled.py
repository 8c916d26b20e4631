"""One pooled adapter cache of the fleet's n x max_loras slots, run over a sweep run's trace:
how many slot loads the eviction rule alone costs when nothing else does.

The pool is a relaxation of every fleet: all replicas' slots together hold at most n x S
adapters, and a request whose adapter is in none of them costs a load wherever it goes. It
leaves out what only adds loads (the copies a balanced fleet keeps of its hot adapters, the
split of the slots into replicas, slots kept by running requests) and it takes requests in
arrival order (a system that held requests back to serve several of one adapter after one
load could do better). The rules:

- `belady`: evict the adapter asked for again last (clairvoyant; the fewest loads any rule
  makes on this order: Belady 1966);
- `oracle`: evict the adapter with the smallest share of the workload's law. Requests are
  independent draws (the simulator's workload), and for those this rule has the fewest
  expected loads of any rule that does not see the future (Aho, Denning and Ullman 1971), so
  no online rule can expect fewer, even one that learns the shares;
- `lfu`: the fewest requests seen so far, the least recently used among equals (raylora's
  engine, by its own counts); `lfu-mru`: the same, the most recently used among equals;
  `lru`: vLLM's engine.

The gap between `oracle` and the learning rules is what not knowing the shares costs, and
no rule that learns them can close it: LFU on the pool lands on the floor of any system that
must learn the shares (cluster/sim_floors.py `learner_slot_floor_per_1k`, on the ranks
`adapter_ranks` gives; its mean -0.00 +- 0.03 loads/1k from it over 200 traces of sweep
point 18), and the sweep counts that floor in each run's slot floor.

`--per-replica` replays, after a run of a policy, each replica's adapters in the order its
engine admitted them through that replica's own max_loras slots, by every rule, with no
slot held by a running request (`replica_replay`). The engine loads on exactly those
sequences, so Belady there is its floor; the gap from the engine's loads to the learning
rules is what running requests holding slots cost (it also prints how many evictions could
not take the adapter the rule ranks last), and the gap from the pool is what the split into
replicas costs. It then runs the run's requests through the one pool again, each holding its
adapter's slot while it ran in the run (`pinned_pool_loads`): what running requests cost
without the split.

    python -m cluster.sim_pooled --point 18          # both seeds, 20,000 requests each
    python -m cluster.sim_pooled --point 23 --per-replica affinity,ray_multiplex@raylora
"""

from __future__ import annotations

import argparse
import heapq
import statistics
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from cluster.sim import SimResult, simulate
from cluster.sim_config import SimConfig
from cluster.sim_floors import learner_slot_floor_per_1k
from cluster.sim_sweep import DESIGN_POINTS, DESIGN_SEED, PEER, TARGETS, parse_seeds, sweep_configs
from cluster.sim_workload import adapter_ranks, adapter_shares, adapter_trace

RULES = ("belady", "oracle", "lfu", "lfu-mru", "lru")


PINNED_RULES = ("belady", "oracle", "lfu")  # pinned_pool_loads' rules


def next_uses(seq: Sequence[str]) -> list[int]:
    """For each position of `seq`, the position where its item comes again (len(seq): never)."""
    never = len(seq)
    nxt = [never] * len(seq)
    seen: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = seen.get(seq[i], never)
        seen[seq[i]] = i
    return nxt


def belady_loads(seq: Sequence[str], slots: int) -> int:
    """Loads of a `slots`-entry cache over `seq` evicting the entry asked for again last."""
    nxt = next_uses(seq)
    cache: dict[str, int] = {}  # adapter -> its next request
    heap: list[tuple[int, str]] = []  # (-next request, adapter); stale entries skipped
    loads = 0
    for i, a in enumerate(seq):
        if a not in cache:
            loads += 1
            if len(cache) >= slots:
                while True:
                    neg, b = heapq.heappop(heap)
                    if cache.get(b) == -neg:
                        del cache[b]
                        break
        cache[a] = nxt[i]
        heapq.heappush(heap, (-nxt[i], a))
    return loads


def keyed_loads(seq: Sequence[str], slots: int, key: Callable[[str, Counter, int], object]) -> int:
    """Loads of a `slots`-entry cache over `seq` evicting the entry with the smallest
    key(adapter, requests seen so far, its last use); among equal keys, the least recently
    used (the cache is kept in recency order)."""
    cache: OrderedDict[str, int] = OrderedDict()  # adapter -> last use, least recent first
    counts: Counter = Counter()
    loads = 0
    for t, a in enumerate(seq):
        counts[a] += 1
        if a in cache:
            cache.move_to_end(a)
        else:
            loads += 1
            if len(cache) >= slots:
                del cache[min(cache, key=lambda b: key(b, counts, cache[b]))]
        cache[a] = t
    return loads


def pooled_loads(cfg: SimConfig, rule: str, seq: Sequence[str] | None = None) -> int:
    """Slot loads of one pool of n x max_loras slots over the adapter requests of `cfg`'s
    trace (the simulator's own workload; `seq`: that trace's adapters, made once by the
    caller that asks for several rules), evicting by `rule` (RULES)."""
    if seq is None:
        seq = adapter_trace(cfg)
    return rule_loads(cfg, rule, seq, cfg.num_replicas * cfg.max_loras)


def rule_loads(cfg: SimConfig, rule: str, seq: Sequence[str], slots: int) -> int:
    """Loads of a `slots`-entry cache over `seq` evicting by `rule` (RULES; `oracle` takes
    the shares of `cfg`'s workload)."""
    if rule == "belady":
        return belady_loads(seq, slots)
    if rule == "oracle":
        share = adapter_shares(cfg)
        return keyed_loads(seq, slots, lambda a, _c, _t: share[a])
    if rule == "lfu":
        return keyed_loads(seq, slots, lambda a, c, _t: c[a])
    if rule == "lfu-mru":
        return keyed_loads(seq, slots, lambda a, c, t: (c[a], -t))
    if rule == "lru":
        return keyed_loads(seq, slots, lambda _a, _c, t: t)
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def pinned_pool_loads(cfg: SimConfig, holds: Sequence[tuple[float, float, str]], rule: str) -> int:
    """Loads of one pool of the fleet's n x max_loras slots over a run's adapter requests
    (`SimResult.holds`) in the order they were admitted, each holding its adapter's slot from
    its admission to its finish as in the run: an adapter with a request running is not
    evicted (with every slot held, the load is counted and the pool runs over until one is
    idle). At a miss the idle adapter `rule` ranks last goes (the least recently admitted
    among equals): `belady` the one admitted again last, `oracle` the smallest share of the
    workload's law, `lfu` the fewest admissions so far. What running requests cost one pool,
    against `pooled_loads` (no slot ever held) and `replica_replay` (the split without them)."""
    if rule not in PINNED_RULES:
        raise ValueError(f"rule must be belady, oracle or lfu, got {rule!r}")
    # at equal times a finish frees its slot before an admission takes one
    events = sorted([(t1, 0, a) for _, t1, a in holds] + [(t0, 1, a) for t0, _, a in holds])
    nxt = next_uses([a for _, kind, a in events if kind])  # each admission's next, by index
    share = adapter_shares(cfg)
    counts: Counter = Counter()
    running: Counter = Counter()
    next_admit: dict[str, int] = {}
    key = {
        "belady": lambda b: -next_admit[b],
        "oracle": lambda b: share.get(b, 0.0),
        "lfu": lambda b: counts[b],
    }[rule]
    cache: OrderedDict[str, None] = OrderedDict()  # least recently admitted first
    slots = cfg.num_replicas * cfg.max_loras
    loads = i = 0
    for _, kind, a in events:
        if not kind:
            running[a] -= 1
            continue
        counts[a] += 1
        next_admit[a] = nxt[i]
        i += 1
        if a in cache:
            cache.move_to_end(a)
        else:
            loads += 1
            idle = [b for b in cache if not running[b]]
            while len(cache) >= slots and idle:
                victim = min(idle, key=key)
                idle.remove(victim)
                del cache[victim]
            cache[a] = None
        running[a] += 1
    return loads


def replica_replay(cfg: SimConfig, policy: str = "affinity") -> tuple[SimResult, dict[str, int]]:
    """Run `policy`, then replay each replica's adapters, in the order its engine admitted
    them, offline through a cache of its max_loras slots by every rule (no slot ever held by
    a running request). The engine loads on exactly that sequence with that many slots, so
    it makes at least the `belady` figure. Returns (the run, rule -> loads summed over the
    replicas)."""
    result = simulate(policy, cfg, record_admissions=True)
    loads = {
        rule: sum(rule_loads(cfg, rule, seq, cfg.max_loras) for seq in result.admitted)
        for rule in RULES
    }
    return result, loads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", type=int, required=True, help="a point of the sweep's design")
    ap.add_argument("--seeds", default="0,1", help="workload seeds: 0,1 or a range, 0-23")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument(
        "--per-replica",
        default="",
        metavar="POLICIES",
        help="also replay, for each of these policies (comma-separated, e.g. "
        "affinity,ray_multiplex@raylora), each replica's admitted sequence offline",
    )
    ap.add_argument(
        "--policies",
        default="",
        help="also run these policies (e.g. affinity@clairvoyant: raylora's engine evicting by "
        "the trace's future; affinity@shares: by the true rates) and print their loads "
        "against the peer's",
    )
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    base = SimConfig(num_requests=args.requests)
    extra = [p for p in args.policies.split(",") if p]
    ratios: dict[str, list[float]] = {p: [] for p in ["affinity", *extra]}
    for point, seed, cfg in sweep_configs(base, DESIGN_POINTS, DESIGN_SEED, seeds):
        if point != args.point:
            continue
        per_1k = 1000 / cfg.num_requests
        replays = {p: replica_replay(cfg, p) for p in filter(None, args.per_replica.split(","))}
        runs = {p: run for p, (run, _) in replays.items()}  # a replayed run is not rerun
        peer = (runs.get(PEER) or simulate(PEER, cfg)).slot_loads_per_1k
        ours = (runs.get("affinity") or simulate("affinity", cfg)).slot_loads_per_1k
        others = {p: simulate(p, cfg).slot_loads_per_1k for p in extra}
        for p, loads in (("affinity", ours), *others.items()):
            ratios[p].append(loads / peer)
        seq = adapter_trace(cfg)
        pooled = "  ".join(f"{r} {pooled_loads(cfg, r, seq) * per_1k:.1f}" for r in RULES)
        print(
            f"point {point} seed {seed} ({cfg.num_replicas} x {cfg.max_loras} slots, "
            f"{cfg.num_adapters} adapters, zipf {cfg.zipf_s:.2f}): slot loads per 1k, "
            f"affinity {ours:.1f}, {PEER} {peer:.1f}, target {TARGETS['slot'] * peer:.1f}; "
            f"one pool of {cfg.num_replicas * cfg.max_loras} slots: {pooled}; the floor of a "
            f"system that learns the shares {learner_slot_floor_per_1k(cfg, adapter_ranks(cfg, seq)):.1f}"
            + "".join(f"; {p} {loads:.1f}" for p, loads in others.items())
        )
        for policy, (run, replayed) in replays.items():
            offline = "  ".join(f"{r} {n * per_1k:.1f}" for r, n in replayed.items())
            print(
                f"  {policy} ({run.slot_loads_per_1k:.1f}), each replica's admitted sequence "
                f"offline with {cfg.max_loras} slots, none busy: {offline}; "
                f"{run.forced_eviction_share:.0%} of its engine's evictions could not take "
                "the adapter its rule ranks last (running)"
            )
            pinned = "  ".join(
                f"{r} {pinned_pool_loads(cfg, run.holds, r) * per_1k:.1f}" for r in PINNED_RULES
            )
            print(
                f"    its requests in one pool of {cfg.num_replicas * cfg.max_loras} slots, "
                f"each holding its slot while it ran as in the run: {pinned}"
            )
    if len(seeds) > 1 and ratios["affinity"]:
        print(f"over {len(ratios['affinity'])} seeds, slot loads / {PEER}'s:")
        for p, rs in ratios.items():
            se = statistics.stdev(rs) / len(rs) ** 0.5
            met = sum(r <= TARGETS["slot"] for r in rs)
            print(
                f"  {p}: mean {statistics.mean(rs):.3f} (standard error {se:.3f}), "
                f"{min(rs):.3f}-{max(rs):.3f}, met on {met} of {len(rs)}"
            )


if __name__ == "__main__":
    main()
