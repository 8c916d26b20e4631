"""Lower bounds no router can beat, from the workload's law alone (and, for the learner's
floor, the run's own trace of it), not from the simulator's routing or engines: what
cluster/sim_sweep.py uses to tell a target that a router missed from one no router can
meet. All per 1,000 requests of a run of `cfg.num_requests` requests.

Notation: n replicas, S = max_loras slots each, C = max_cpu_loras; adapter a gets a share
p_a of the adapter requests (Zipf), lam_a = arrival rate x (1 - base share) x p_a; H = the
shortest mean time a request holds its adapter's slot, its decode at batch size 1
(output_tokens x decode_ms_per_token: steps only get longer with more running, and loads
only add to it).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from cluster.sim_config import SimConfig
from cluster.sim_workload import zipf_shares


def first_touch_per_1k(cfg: SimConfig) -> float:
    """Expected distinct adapters in the trace, per 1k requests: each needs at least one
    cold read and one slot load (before any prefetch of what nobody asked for yet)."""
    m = cfg.num_requests * (1 - cfg.base_fraction)  # adapter requests
    distinct = sum(1 - (1 - p) ** m for p in zipf_shares(cfg))
    return 1000 * distinct / cfg.num_requests


def steady_slot_floor_per_1k(cfg: SimConfig) -> float:
    """Fewest slot loads per 1k requests in steady state, for any router and eviction.

    Let U_a be the time-average number of replicas with a in a slot (sum_a U_a <= n S) and
    m_a its rate of slot loads. A request finds a in some slot with probability at most
    min(1, U_a) (Poisson arrivals see time averages), so m_a >= lam_a (1 - min(1, U_a)). Each
    load starts a stay of a in that slot for at least its request's H, and two loads of a on
    one replica cannot overlap, so U_a >= m_a H. Hence U_a >= lam_a H / (1 + lam_a H) for
    every adapter (the slots its own loads keep busy: the tail's share of the slots), and
    minimising sum_a lam_a (1 - U_a) over the rest of the n S budget gives it to the most
    requested adapters first (a fractional knapsack). The old floor (the n S most popular
    always in slots) is this with H = 0.
    """
    rate = cfg.arrival_rate_per_ms() * (1 - cfg.base_fraction)
    hold = cfg.output_tokens * cfg.decode_ms_per_token
    lams = [rate * p for p in zipf_shares(cfg)]
    u = [lam * hold / (1 + lam * hold) for lam in lams]
    budget = cfg.num_replicas * cfg.max_loras - sum(u)
    for i in range(len(u)):  # most requested first
        if budget <= 0:
            break
        more = min(1 - u[i], budget)
        u[i] += more
        budget -= more
    misses = sum(lam * (1 - ui) for lam, ui in zip(lams, u, strict=True))
    return 1000 * misses / cfg.arrival_rate_per_ms()


def learner_slot_floor_per_1k(cfg: SimConfig, ranks: Sequence[int]) -> float:
    """Fewest expected slot loads per 1k requests, over the trace whose adapter requests have
    these popularity ranks (0 = most requested), for any system that is not told which
    adapter has which share and must learn it from the requests.

    Model: requests are independent draws of the law (`zipf_shares`), the shares dealt to
    the adapter names in an order the system does not know; as in the steady-state floor, a
    request that finds its adapter in no slot (nor being loaded into one) costs a load of its
    own (no request is held back to share a later one's load). The fleet's slots hold at
    most n S adapters at once. Given the history, which adapter holds which share has the
    posterior P(order) ~ prod_a p_order(a) ^ n_a: it depends on the counts n_a alone, an
    adapter asked for more often has the larger posterior mean share (pair each order with
    the one that swaps two adapters' shares), and equal counts give equal means. So the
    chance that request m finds its adapter in a slot is at most the posterior share of the
    n S adapters asked for most so far, and the loads are at least:
      every adapter's first load (distinct adapters in the trace)
      + sum over requests m of the posterior share of the adapters already asked for that
        are not among the n S asked for most (ties: the tied group's mean),
    each such miss being a reload (the adapter was loaded for its earlier request). The
    posterior shares are summed as the true shares of the same adapters, which has the same
    expectation. LFU on one pool of all the slots (cluster/sim_pooled.py) keeps nearly the
    adapters asked for most and lands on this floor; a rule told the shares (`oracle` there)
    can make fewer."""
    if not ranks:
        return 0.0
    shares = zipf_shares(cfg)
    room = cfg.num_replicas * cfg.max_loras
    count: dict[int, int] = {}  # rank -> requests so far
    group_n: dict[int, int] = {}  # requests so far -> adapters with that many
    group_mass: dict[int, float] = {}  # requests so far -> their summed shares
    levels: list[int] = []  # the counts some adapter has, ascending
    missed = 0.0

    def move(c: int, rank: int, sign: int) -> None:
        if sign > 0 and not group_n.get(c):
            bisect.insort(levels, c)
        group_n[c] = group_n.get(c, 0) + sign
        group_mass[c] = group_mass.get(c, 0.0) + sign * shares[rank]
        if not group_n[c]:
            levels.pop(bisect.bisect_left(levels, c))

    for rank in ranks:
        over = len(count) - room  # adapters asked for that cannot all be in a slot
        for c in levels:  # the least asked for first
            if over <= 0:
                break
            take = min(over, group_n[c])
            missed += group_mass[c] * take / group_n[c]
            over -= take
        c = count.get(rank, 0)
        if c:
            move(c, rank, -1)
        move(c + 1, rank, +1)
        count[rank] = c + 1
    return 1000 * (len(count) + missed) / cfg.num_requests


def slot_load_floor(cfg: SimConfig, learner: float | None = None) -> float:
    """Fewest slot loads per 1k requests for any router and eviction: the larger of the
    steady-state bound and the first loads of the adapters in the trace; with `learner`
    (`learner_slot_floor_per_1k` on the run's trace, computed once by the caller, which
    also prints it), also the floor for a system that must learn the shares."""
    law = max(steady_slot_floor_per_1k(cfg), first_touch_per_1k(cfg))
    return law if learner is None else max(law, learner)


def cold_load_floor(cfg: SimConfig, max_over_mean: float | None = None) -> float:
    """Fewest cold reads per 1k requests: every adapter in the trace is read once; in steady
    state, a request whose adapter is in none of the fleet's n (C + S) CPU entries and slots
    is read again (the bound counts a slot copy as a held one).

    max_over_mean: the fewest for a router that also keeps every replica's served requests
    under max_over_mean x the mean. A replica serves at most that x N / n requests, so an
    adapter with N_a requests sits on at least ceil(N_a n / (max_over_mean N)) replicas, each
    of which reads it once: sum_a ceil(s_a n / max_over_mean), s_a its share of all requests.
    """
    shares = zipf_shares(cfg)
    first = first_touch_per_1k(cfg)
    held = cfg.num_replicas * (cfg.max_cpu_loras + cfg.max_loras)
    steady = 1000 * (1 - cfg.base_fraction) * sum(shares[held:])
    if max_over_mean is None:
        return max(first, steady)
    m = cfg.num_requests * (1 - cfg.base_fraction)
    n = cfg.num_replicas
    extra = 0.0  # replicas past the first, for the adapters that need more than one
    for p in shares:
        k = math.ceil(p * (1 - cfg.base_fraction) * n / max_over_mean - 1e-9)
        if k <= 1:
            break  # shares fall with rank: no later adapter needs two either
        extra += (k - 1) * (1 - (1 - p) ** m)
    return max(first, steady) + 1000 * extra / cfg.num_requests
