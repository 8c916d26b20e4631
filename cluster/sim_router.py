"""The simulator's routing policies (cluster/sim.py): raylora's affinity rule (the same
`rank_replicas` and `PlacementPlanner` the Serve router runs) and models of the peers' routers.

Each policy returns ranked tiers like Ray's `choose_replicas`; the request goes to the least
loaded replica of the first tier with one under `max_ongoing_requests`, else to the least
loaded replica (standing in for Ray's retry with backoff).

Residency reaches the routers as it reaches Ray's: late (`SimConfig.residency_push_ms`,
`Replica.reported_view`), except for the `*_instant` variants, which see it as it is. Loads
are always current (Ray's queue-length cache is updated on every send and completion).
"""

from __future__ import annotations

import itertools
import random
from functools import partial

from cluster.sim_config import Request, SimConfig
from cluster.sim_replica import Replica
from deployments.placement import PlacementConfig, PlacementPlanner
from deployments.router_memory import InFlight, RecentRoutes
from deployments.routing_policy import (
    ReplicaView,
    power_of_two,
    rank_by_hash,
    rank_replicas,
    tail_rank,
)

POLICIES = (
    "affinity",  # adapters stay on their holders; hot ones placed on k homes by popularity
    "affinity_hash",  # the rule before issue 15: rendezvous order, spill at the load bound
    "p2c",
    "ray_multiplex",  # Ray's multiplexed routing, ids learnt as Ray learns them
    "ray_multiplex_instant",  # the same with instant knowledge of every replica's ids
    "prefix",
    "round_robin",
    "random",
)
PREFIX_MATCH_RATE_THRESHOLD = 0.1  # Ray Serve LLM PrefixCacheAffinityRouter's default


def _pick(tiers: list[list[Replica]], replicas: list[Replica], cap: int) -> Replica:
    for tier in tiers:
        best = None
        for r in tier:
            if r.load < cap and (best is None or r.load < best.load):
                best = r
        if best is not None:
            return best
    return min(replicas, key=lambda r: r.load)


class Router:
    def __init__(self, policy: str, replicas: list[Replica], cfg: SimConfig) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
        self.policy = policy
        self.replicas = replicas
        self.by_id = {r.replica_id: r for r in replicas}
        self.cfg = cfg
        self.rng = random.Random(cfg.seed + 1)
        self.rr = itertools.cycle(replicas)
        self.instant = policy.endswith("_instant")
        self.replica_ids = [r.replica_id for r in replicas]
        self.planner = PlacementPlanner(
            PlacementConfig(max_loras=cfg.max_loras, max_moves=cfg.max_moves)
        )
        self.recent = RecentRoutes()  # what this router sent, held until residency shows it
        self.inflight = InFlight()  # the adapters of its requests not finished, per replica
        # the prefix router's tree, reduced to what it decides on: which replicas it sent
        # each tenant's prefix to, and how much text it sent each replica
        self.routed_tenants: dict[str, set[str]] = {}
        self.routed_tokens: dict[str, int] = {r.replica_id: 0 for r in replicas}

    def _views(self) -> list[ReplicaView]:
        if self.instant:
            return [r.view() for r in self.replicas]
        return [r.reported_view() for r in self.replicas]

    def route(self, req: Request) -> Replica:
        reps, rng = self.replicas, self.rng
        if self.policy == "affinity":
            self.planner.record(req.adapter)  # the Serve router sees every request too
            views = self.inflight.apply(self.recent.apply(self._views(), req.arrival / 1000))
            home = self.planner.home(req.routing_key, self.replica_ids, views)
            rank = tail_rank(len(reps), self.cfg.max_loras)
            ranked = rank_replicas(
                req.routing_key,
                views,
                load_bound_c=self.cfg.load_bound_c,
                min_load_bound=self.cfg.min_load_bound,
                rng=rng,
                home=home,
                max_batch=self.cfg.max_num_seqs,  # what the replicas report (LLMServer)
                max_loras=self.cfg.max_loras,
                in_tail=partial(self.planner.popularity.in_tail, rank=rank),
            )
            tiers = [[self.by_id[v.replica_id] for v in t] for t in ranked]
        elif self.policy == "affinity_hash":
            key = req.routing_key
            if not key:
                ranked = power_of_two(self._views(), rng)
            else:
                ranked = rank_by_hash(
                    key, self._views(), self.cfg.load_bound_c, self.cfg.min_load_bound
                )
            tiers = [[self.by_id[v.replica_id] for v in t] for t in ranked]
        elif self.policy == "p2c":
            tiers = [
                [self.by_id[v.replica_id] for v in power_of_two([r.view() for r in reps], rng)[0]]
            ]
        elif self.policy.startswith("ray_multiplex"):
            tiers = self._ray_multiplex(req.adapter)
        elif self.policy == "prefix":
            tiers = self._ray_prefix(req)
        elif self.policy == "round_robin":
            tiers = [[next(self.rr)]]
        else:
            tiers = [[rng.choice(reps)]]
        target = _pick(tiers, reps, self.cfg.max_ongoing_requests)
        if self.policy == "affinity":
            self.recent.record(target.replica_id, req.adapter, req.arrival / 1000)
            self.inflight.sent(str(req.seq), target.replica_id, req.adapter, req.arrival / 1000)
        if req.tenant:
            self.routed_tenants.setdefault(req.tenant, set()).add(target.replica_id)
        self.routed_tokens[target.replica_id] += req.prompt_tokens
        return target

    def on_done(self, req: Request) -> None:
        """Ray's on_request_completed: the request finished."""
        self.inflight.done(str(req.seq))

    def _two(self, pool: list[Replica]) -> list[Replica]:
        return self.rng.sample(pool, 2) if len(pool) > 2 else list(pool)

    def _multiplex_candidates(self, adapter: str) -> list[Replica]:
        """Ray's apply_multiplex_routing: the replicas that report the model id (here: the
        adapter is in their CPU cache or being read into it), else those with the fewest."""
        reps = self.replicas
        ids = [v.adapters_in_cpu for v in self._views()]
        holders = [r for r, held in zip(reps, ids, strict=True) if adapter in held]
        if holders:
            return holders
        fewest_n = min(len(held) for held in ids)
        return [r for r, held in zip(reps, ids, strict=True) if len(held) == fewest_n]

    def _ray_multiplex(self, adapter: str) -> list[list[Replica]]:
        """Ray's PowerOfTwoChoicesRequestRouter with a multiplexed model id.

        apply_multiplex_routing: two random replicas among those that report the model id
        (here: the adapter is in their CPU cache); if none, or both are full, two random
        among the replicas with the fewest models; then two random among all.
        Base requests: two random replicas.
        """
        reps = self.replicas
        if not adapter:
            return [self._two(reps)]
        ids = [v.adapters_in_cpu for v in self._views()]
        fewest_n = min(len(held) for held in ids)
        fewest = [r for r, held in zip(reps, ids, strict=True) if len(held) == fewest_n]
        holders = [r for r, held in zip(reps, ids, strict=True) if adapter in held]
        return ([self._two(holders)] if holders else []) + [self._two(fewest), self._two(reps)]

    def _ray_prefix(self, req: Request) -> list[list[Replica]]:
        """Ray Serve LLM's PrefixCacheAffinityRouter with its defaults (imbalanced_threshold
        inf: load never overrides the prefix match; match_rate_threshold 0.1).

        Candidates: the multiplex candidates for an adapter request, else every replica.
        Among them, the replicas its prefix tree says got this prompt's prefix before, if the
        match covers >= 10% of the prompt; else the replicas that got the least text ("smallest
        tenants"). Fallback: power of two choices (with multiplexing for adapters).
        """
        cands = self._multiplex_candidates(req.adapter) if req.adapter else self.replicas
        fallback = self._ray_multiplex(req.adapter)
        sent = self.routed_tenants.get(req.tenant, set()) if req.tenant else set()
        matched = [r for r in cands if r.replica_id in sent]
        rate = req.prefix_tokens / max(1, req.prompt_tokens)
        if matched and rate >= PREFIX_MATCH_RATE_THRESHOLD:
            return [matched, *fallback]
        least = min(self.routed_tokens[r.replica_id] for r in cands)
        return [[r for r in cands if self.routed_tokens[r.replica_id] == least], *fallback]
