"""The raylora Ray Serve application.

    serve run serve_app:app                      # default model, demo adapters, 2 replicas
    serve run serve_app:build_app model=/models/llama adapters=sql=/a/sql,chat=/a/chat \\
        num_replicas=4 max_loras=4 num_gpus=1

`build_app(args)` takes string arguments (as `serve run` passes them; a Serve config file
may pass typed values). Engine arguments (EngineConfig fields): model, max_loras,
max_lora_rank, max_cpu_loras, max_num_seqs, max_num_batched_tokens, max_model_len,
block_size, num_kv_blocks, kv_cache_memory_gb, lora_backend, lora_dtype, lora_starvation_steps,
enable_lora, max_n, tokenizer, dtype, device, seed (every EngineConfig field).
Application arguments: see APP_ARGS below and docs/serving.md.

Importing this module is cheap: no model, no adapter and no Ray cluster is touched until
the replicas start.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from deployments.replica_io import check_adapter_name
from engine import hub, paths, remote

API_KEY_ENV = "RAYLORA_API_KEY"
DEFAULT_MAX_NUM_SEQS = 64  # EngineConfig's (no engine, so no torch, imported here)


def _bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def _adapters(value: str | dict) -> dict[str, str]:
    """ "name=path,name2=path2" (or a dict) -> {name: path}."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    out = {}
    for item in filter(None, (s.strip() for s in str(value).split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"adapters: expected name=path, got {item!r}")
        out[name.strip()] = path.strip()
    return out


def _paths(value: str | list) -> list[str]:
    """A list as it is; a string: comma- (or, between folders, os.pathsep-) separated
    folders and URLs (a URL is not split at its ':')."""
    if isinstance(value, list):
        return [str(p).strip() for p in value if str(p).strip()]
    out = []
    for item in (p.strip() for p in str(value).split(",")):
        out += [item] if remote.is_url(item) else [p.strip() for p in item.split(os.pathsep)]
    return [p for p in out if p]


def _replicas(value: str | int) -> int | str:
    return "auto" if str(value) == "auto" else int(value)


ENGINE_ARGS: dict[str, Any] = {
    "model": str,
    "max_loras": int,
    "max_lora_rank": int,
    "max_cpu_loras": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "block_size": int,
    "num_kv_blocks": int,
    "kv_cache_memory_gb": float,
    "gpu_memory_utilization": float,
    "enforce_eager": _bool,
    "warm_up": _bool,  # unset: on CUDA only (engine/warmup.py)
    "lora_backend": str,
    "lora_dtype": str,
    "lora_starvation_steps": int,
    "enable_lora": _bool,
    "enable_prefix_caching": _bool,
    "max_n": int,
    "tokenizer": str,
    "dtype": str,
    "device": str,
    "seed": int,
}

# name -> (parser, default, what it is)
APP_ARGS: dict[str, tuple[Any, Any, str]] = {
    "adapters": (_adapters, {}, "name=path,... adapters registered at start"),
    "demo_adapters": (_bool, False, "also register the demo adapters that exist on disk"),
    "num_replicas": (_replicas, 2, "LLMServer replicas (an int, or auto)"),
    "num_cpus": (float, 0.5, "CPUs reserved per LLMServer replica"),
    "num_gpus": (float, 0.0, "GPUs per LLMServer replica"),
    "ingress_replicas": (int, 1, "ingress replicas"),
    "max_ongoing_requests": (int, None, "per LLMServer replica (default 2 x max_num_seqs)"),
    "max_queued_requests": (int, 256, "queued per caller before 503 (-1: unbounded)"),
    "api_key": (str, None, f"Bearer key for /v1/* (default: ${API_KEY_ENV})"),
    "adapter_roots": (
        _paths,
        None,
        "folders and URL prefixes load_lora_adapter may load from (unset: any)",
    ),
    "dynamic_lora_loading_path": (
        str,
        None,
        "a folder or object-storage URL: a request for an adapter the catalog lacks loads "
        "<path>/<name> and registers it (Ray Serve LLM's LoraConfig name)",
    ),
    "served_model_name": (str, None, "the base model's name in the API"),
    "router": (str, "affinity", "affinity (AdapterAffinityRouter) or pow2 (Serve's default)"),
    "load_bound_c": (float, None, "AdapterAffinityRouter's load bound c"),
    "min_load_bound": (int, None, "AdapterAffinityRouter's floor on the load bound (requests)"),
    "routing_stats_period_s": (float, 2.0, "how often routers read replica residency"),
    "report_multiplexed_ids": (
        _bool,
        True,
        "replicas report their CPU-cache adapters as Serve multiplexed model ids "
        "(what @serve.multiplexed does; Ray's default router then prefers holders)",
    ),
    "shared_adapter_tier": (
        _bool,
        True,
        "the first replica to download an adapter shares it through the Ray object store; "
        "the others fetch it instead of downloading it (local folders are read where they "
        "are, and shared with nodes without them; deployments/shared_adapters.py)",
    ),
    "shared_tier_mb": (
        int,
        None,
        "object-store MiB the registry keeps shared adapters in (default 2048; set where the "
        "registry is first created: a running one keeps its budget)",
    ),
    "report_interval_s": (float, 5.0, "how often replicas re-report to the registry"),
    "shutdown_timeout_s": (float, 30.0, "graceful shutdown: wait for in-flight requests"),
    "health_check_period_s": (
        float,
        3.0,
        "how often Serve checks each LLMServer replica (a dead engine or actor is replaced "
        "after the next check)",
    ),
    "registry_state_file": (
        str,
        None,
        "absolute path of the adapter catalog's durable record on the head node "
        "(default: Ray's GCS KV)",
    ),
}


def parse_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> (engine config kwargs, app options). Raises ValueError naming unknown arguments."""
    unknown = sorted(set(args) - set(ENGINE_ARGS) - set(APP_ARGS))
    if unknown:
        known = ", ".join(sorted(ENGINE_ARGS) + sorted(APP_ARGS))
        raise ValueError(f"unknown build_app argument(s) {unknown}; known: {known}")
    engine = {"model": "default"}
    for name, parse in ENGINE_ARGS.items():
        if name in args and args[name] is not None:
            engine[name] = parse(args[name])
    opts = {name: default for name, (_, default, _) in APP_ARGS.items()}
    for name, (parse, _, _) in APP_ARGS.items():
        if name in args and args[name] is not None:
            opts[name] = parse(args[name])
    opts["api_key"] = opts["api_key"] or os.environ.get(API_KEY_ENV) or None
    if opts["router"] not in ("affinity", "pow2"):
        raise ValueError(f"router must be affinity or pow2, got {opts['router']!r}")
    state_file = opts["registry_state_file"]
    if state_file is not None and not os.path.isabs(state_file):
        raise ValueError(f"registry_state_file must be an absolute path, got {state_file!r}")
    if opts["shared_tier_mb"] is not None and opts["shared_tier_mb"] < 0:
        raise ValueError(f"shared_tier_mb must be >= 0, got {opts['shared_tier_mb']}")
    for name, path in opts["adapters"].items():
        check_adapter_name(name)
        local = not remote.is_url(path) and (
            Path(path).expanduser().exists() or hub.looks_like_local_path(path)
        )
        if local and not (Path(path).expanduser() / "adapter_config.json").is_file():
            raise ValueError(f"adapter {name!r}: {path} is not a PEFT adapter folder")
    return engine, opts


def router_kwargs(engine: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """The AdapterAffinityRouter's request_router_kwargs for these engine arguments."""
    kwargs = {k: opts[k] for k in ("load_bound_c", "min_load_bound") if opts[k] is not None}
    if "max_loras" in engine:  # else the placement learns it from the routing stats
        kwargs["max_loras"] = engine["max_loras"]
    # a full batch is over the load bound (routing_policy.load_bound)
    kwargs["max_batch"] = engine.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    return kwargs


def build_app(args: dict[str, Any]) -> serve.Application:
    """The raylora app: OpenAI ingress -> LLMServer replicas (see the module docstring)."""
    engine, opts = parse_args(args)
    router_config = None
    max_num_seqs = engine.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    mb = opts["shared_tier_mb"]
    shared_tier_bytes = None if mb is None else mb << 20
    if opts["router"] == "affinity" and importlib.util.find_spec("deployments.router"):
        router_config = RequestRouterConfig(
            request_router_class="deployments.router:AdapterAffinityRouter",
            request_router_kwargs=router_kwargs(engine, opts),
            request_routing_stats_period_s=opts["routing_stats_period_s"],
        )
    llm_options: dict[str, Any] = {
        "name": "LLMServer",
        "num_replicas": opts["num_replicas"],
        "ray_actor_options": {"num_cpus": opts["num_cpus"], "num_gpus": opts["num_gpus"]},
        "max_ongoing_requests": opts["max_ongoing_requests"] or 2 * max_num_seqs,
        "max_queued_requests": opts["max_queued_requests"],
        "graceful_shutdown_timeout_s": opts["shutdown_timeout_s"] + 5,
        "health_check_period_s": opts["health_check_period_s"],
        "health_check_timeout_s": 60.0,
    }
    if router_config is not None:
        llm_options["request_router_config"] = router_config
    llm = serve.deployment(LLMServer, **llm_options).bind(
        engine_config=engine,
        adapters=opts["adapters"],
        demo_adapters=opts["demo_adapters"],
        report_interval_s=opts["report_interval_s"],
        shutdown_timeout_s=opts["shutdown_timeout_s"],
        registry_state_file=opts["registry_state_file"],
        report_multiplexed_ids=opts["report_multiplexed_ids"],
        shared_adapter_tier=opts["shared_adapter_tier"],
        shared_tier_bytes=shared_tier_bytes,
        dynamic_lora_loading_path=opts["dynamic_lora_loading_path"],
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="OpenAIIngress",
        num_replicas=opts["ingress_replicas"],
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000,
    )
    return ingress.bind(
        llm,
        served_model_name=opts["served_model_name"],
        api_key=opts["api_key"],
        adapter_roots=opts["adapter_roots"],
        registry_state_file=opts["registry_state_file"],
        dynamic_lora_loading_path=opts["dynamic_lora_loading_path"],
        shared_tier_bytes=shared_tier_bytes,
    )


def _default_args() -> dict[str, Any]:
    """The laptop app: default model, the demo adapters, 2 replicas on half a core each."""
    return {
        "demo_adapters": True,
        "adapter_roots": [str(paths.adapters_dir())],
        "max_loras": 2,
        "max_cpu_loras": 8,
        "max_num_seqs": 32,
    }


app = build_app(_default_args())
