"""raylora's metrics.

Every metric is a `ray.util.metrics` metric, which Ray's metrics agent exports in Prometheus
format on each node (`ray start --metrics-export-port=8080`, names prefixed `ray_`): that
is where the replica-side metrics (TTFT, time per output token, queue lengths, adapter loads,
activations, evictions, slot hits / misses / hit ratio, prefix-cache queries / hits in
tokens) are scraped, with a `replica` tag.

The ingress-side metrics (requests per model and status, latency, TTFT and TPOT as the
client sees them, tokens out) are also kept in a process-local prometheus_client registry,
which the ingress serves at `GET /metrics` (`render_ingress_metrics()`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram
from ray.util.metrics import Counter, Gauge, Histogram

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

INGRESS_REGISTRY = CollectorRegistry()


class _Dual:
    """A Ray metric plus the same metric in INGRESS_REGISTRY; tags are keyword labels."""

    def __init__(self, ray_metric, prom_metric, tag_keys: tuple[str, ...]) -> None:
        self._ray = ray_metric
        self._prom = prom_metric
        self._tag_keys = tag_keys

    def _labels(self, tags: dict[str, str] | None):
        if not self._tag_keys:
            return self._prom
        return self._prom.labels(**{k: str((tags or {}).get(k, "")) for k in self._tag_keys})

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._ray.inc(value, tags=tags)
        self._labels(tags).inc(value)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._ray.observe(value, tags=tags)
        self._labels(tags).observe(value)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._ray.set(value, tags=tags)
        self._labels(tags).set(value)


def _counter(name: str, doc: str, tag_keys: tuple[str, ...]) -> _Dual:
    return _Dual(
        Counter(f"{name}_total", description=doc, tag_keys=tag_keys),
        PromCounter(name, doc, tag_keys, registry=INGRESS_REGISTRY),
        tag_keys,
    )


def _histogram(name: str, doc: str, buckets: list[float], tag_keys: tuple[str, ...]) -> _Dual:
    return _Dual(
        Histogram(name, description=doc, boundaries=buckets, tag_keys=tag_keys),
        PromHistogram(name, doc, tag_keys, buckets=buckets, registry=INGRESS_REGISTRY),
        tag_keys,
    )


# ---------------------------------------------------------------- ingress (Ray + /metrics)

HTTP_REQUESTS = _counter(
    "raylora_requests",
    "Requests handled by the ingress, by model (base or adapter), endpoint and HTTP status.",
    ("model", "endpoint", "status"),
)
HTTP_LATENCY = _histogram(
    "raylora_request_latency_seconds",
    "End-to-end request latency at the ingress.",
    LATENCY_BUCKETS_S,
    ("model", "endpoint"),
)
INGRESS_TTFT = _histogram(
    "raylora_ingress_time_to_first_token_seconds",
    "Time to first token as the ingress sees it.",
    LATENCY_BUCKETS_S,
    ("model",),
)
INGRESS_TPOT = _histogram(
    "raylora_ingress_time_per_output_token_seconds",
    "Time per output token after the first, as the ingress sees it.",
    TPOT_BUCKETS_S,
    ("model",),
)
TOKENS_GENERATED = _counter(
    "raylora_generation_tokens", "Completion tokens returned, by model.", ("model",)
)
ADAPTER_OPS = _counter(
    "raylora_adapter_api_calls",
    "load_lora_adapter / unload_lora_adapter calls by outcome.",
    ("op", "status"),
)

# ---------------------------------------------------------------- replica (Ray only)

_REPLICA = ("replica",)
TTFT = Histogram(
    "raylora_time_to_first_token_seconds",
    description="Time from arrival at the replica to the first generated token.",
    boundaries=LATENCY_BUCKETS_S,
    tag_keys=("adapter",),
)
TPOT = Histogram(
    "raylora_time_per_output_token_seconds",
    description="Decode time per output token after the first, per request.",
    boundaries=TPOT_BUCKETS_S,
    tag_keys=("adapter",),
)
REPLICA_REQUESTS = Counter(
    "raylora_replica_requests_total",
    description="Requests run by the replica's engine, by adapter and outcome.",
    tag_keys=("adapter", "status"),
)
NUM_RUNNING = Gauge("raylora_num_requests_running", "Requests running in the engine.", _REPLICA)
NUM_WAITING = Gauge("raylora_num_requests_waiting", "Requests waiting in the engine.", _REPLICA)
ADAPTERS_IN_SLOTS = Gauge("raylora_adapters_in_slots", "Adapters in GPU/CPU slots.", _REPLICA)
ADAPTERS_IN_CPU = Gauge("raylora_adapters_in_cpu_cache", "Adapters in the CPU cache.", _REPLICA)
SLOT_HIT_RATIO = Gauge(
    "raylora_lora_slot_hit_ratio",
    "Share of adapter activations that found the adapter already in a slot.",
    _REPLICA,
)
LORA_COUNTERS = {
    key: Counter(f"raylora_lora_{key}_total", description=doc, tag_keys=_REPLICA)
    for key, doc in {
        "loads": "Adapters loaded from disk/Hub into the CPU cache.",
        "activations": "Adapters copied into a slot.",
        "evictions": "Adapters evicted from a slot or the CPU cache.",
        "hits": "Adapter requests scheduled with the adapter already in a slot.",
        "misses": "Adapter requests that needed an activation.",
    }.items()
}


# vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: hits / queries is the hit rate
PREFIX_CACHE_COUNTERS = {
    key: Counter(f"raylora_{key}_total", description=doc, tag_keys=_REPLICA)
    for key, doc in {
        "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_hits": "Prompt tokens found in the prefix cache (not computed).",
    }.items()
}


# the engine's steps that ran something and their batches (LLMEngine.stats()["steps"]):
# rate(sequences) / rate(steps) is the mean batch, rate(adapters) / rate(steps) the LoRA
# groups a forward runs
BATCH_COUNTERS = {
    key: Counter(f"raylora_engine_{name}_total", description=doc, tag_keys=_REPLICA)
    for key, name, doc in (
        ("steps", "steps", "Engine steps that ran a batch."),
        ("seqs", "step_sequences", "Sequences in those batches, summed."),
        ("adapters", "step_adapters", "Distinct adapters in those batches, summed."),
        ("tokens", "step_tokens", "Tokens computed in those batches, summed."),
    )
}


def render_ingress_metrics() -> tuple[bytes, str]:
    """(body, content type) of the ingress process's metrics in Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return generate_latest(INGRESS_REGISTRY), CONTENT_TYPE_LATEST
