"""Adapter-aware autoscaling policy for the LLMServer deployment (Ray Serve >= 2.50 custom policies).

Ray's default policy scales on ongoing requests only. With many adapters a replica can be
idle-looking yet stuck: its requests wait for one of `max_loras` GPU slots, and adapters
thrash between slots. This policy takes the largest of four replica counts:

    by_requests = total ongoing requests / target_ongoing_requests         (Ray's default rule)
    by_slots    = sum(num_adapters_wanted) / (sum(max_loras) * slot_target) * n
                  (the adapter working set should fit in `slot_target` of the fleet's slots)
    by_blocked  = n + sum(num_waiting_for_slot) / target_ongoing_requests     (if any blocked)
    by_misses   = n * miss_ratio / max_miss_ratio                     (if miss_ratio above it)
                  where miss_ratio = sum(adapter_loads_per_s) / sum(requests_per_s)

Ray wraps the result with min/max_replicas, up/downscaling factors and delays.

Inputs are custom metrics that each LLMServer replica returns from
`record_autoscaling_stats(self) -> dict[str, float]`, averaged by Ray over
`look_back_period_s` (missing metrics count as 0, so without them this is Ray's default):
    num_adapters_wanted   distinct adapters among the replica's running + waiting requests
    max_loras             the replica's GPU adapter slots
    num_waiting_for_slot  waiting requests whose adapter cannot get a slot now
    adapter_loads_per_s   adapters loaded into slots per second (CPU or disk)
    requests_per_s        requests admitted per second

Config (serve_config.yaml):
    autoscaling_config:
      policy: {policy_function: cluster.autoscaling:adapter_aware_policy}
or, with knobs: {policy_function: cluster.autoscaling:AdapterAwarePolicy,
                 policy_kwargs: {slot_target: 0.9, max_miss_ratio: 0.5}}
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

METRICS = (
    "num_adapters_wanted",
    "max_loras",
    "num_waiting_for_slot",
    "adapter_loads_per_s",
    "requests_per_s",
)


class AdapterAwarePolicy:
    """Class form so `policy_kwargs` reach it (Ray instantiates a class policy once)."""

    def __init__(self, slot_target: float = 0.9, max_miss_ratio: float = 0.5) -> None:
        if not 0 < slot_target <= 1:
            raise ValueError(f"slot_target must be in (0, 1], got {slot_target}")
        if max_miss_ratio <= 0:
            raise ValueError(f"max_miss_ratio must be > 0, got {max_miss_ratio}")
        self.slot_target = slot_target
        self.max_miss_ratio = max_miss_ratio

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        n = ctx.current_num_replicas
        if n == 0:  # scale from zero: Ray's cold-start path handles it
            return ctx.target_num_replicas, {}
        target = ctx.config.get_target_ongoing_requests()
        metrics = ctx.aggregated_metrics or {}

        def total(name: str) -> float:
            return float(sum(metrics.get(name, {}).values()))

        by_requests = ctx.total_num_requests / target
        wanted, slots = total("num_adapters_wanted"), total("max_loras")
        by_slots = n * wanted / (slots * self.slot_target) if slots > 0 else 0.0
        blocked = total("num_waiting_for_slot")
        by_blocked = n + blocked / target if blocked > 0 else 0.0
        rate = total("requests_per_s")
        miss_ratio = total("adapter_loads_per_s") / rate if rate > 0 else 0.0
        by_misses = (
            n * miss_ratio / self.max_miss_ratio if miss_ratio > self.max_miss_ratio else 0.0
        )

        parts = {
            "by_requests": by_requests,
            "by_slots": by_slots,
            "by_blocked": by_blocked,
            "by_misses": by_misses,
        }
        desired = max(parts.values())
        state = dict(ctx.policy_state)
        state["adapter_aware"] = {**parts, "miss_ratio": miss_ratio, "desired": desired}
        return desired, state


def adapter_aware_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Function form with the default knobs."""
    return AdapterAwarePolicy()(ctx)
