"""The arms of benchmarks/routing.py: what each policy deploys (a router, whether the
replicas report multiplexed ids, an engine's adapter-cache behaviour) and the LLMServer
deployment it runs on (`build_llm_app`), and the model and adapters it serves
(`build_assets`). The module docstring of benchmarks/routing.py says
what each arm stands for.
"""

from __future__ import annotations

import json
from pathlib import Path

# policy -> (router, replicas report multiplexed ids, adapter-cache behaviour of the engine)
POLICIES: dict[str, tuple[str, bool, str]] = {
    "affinity": ("affinity", True, "raylora"),
    "ray_multiplex": ("pow2", True, "vllm"),
    "ray_multiplex_raylora_engine": ("pow2", True, "raylora"),
    "pow2_no_multiplex": ("pow2", False, "vllm"),
    "affinity_moves": ("affinity", True, "raylora"),
    "affinity_no_tier": ("affinity", True, "raylora_no_tier"),
    "affinity_spread": ("affinity", True, "raylora"),
    "affinity_bound2": ("affinity", True, "raylora"),
    "affinity_no_idle": ("affinity", True, "raylora"),
    "affinity_no_placement": ("affinity", True, "raylora"),
    "affinity_always_placed": ("affinity", True, "raylora"),
}
# policy -> router kwargs it sets (over --router-kwargs)
POLICY_ROUTER_KWARGS: dict[str, dict] = {
    "affinity_moves": {"max_moves": 1},
    # a replica with a request in flight is "full" at light load: spread rather than batch
    "affinity_spread": {"min_load_bound": 1},
    # between the two: a second request in flight on a replica is where spreading starts
    "affinity_bound2": {"min_load_bound": 2},
    # without the idle-CPU-holder rule (rank_replicas' idle_first): a slot holder first
    "affinity_no_idle": {"idle_first": False},
    # no hot adapter placed on k homes (deployments/placement.py): where it stays is where
    # it is held, and it spreads only past the load bound
    "affinity_no_placement": {"use_placement": False},
    # placement whatever the fleet's load (placement.FleetLoad off): as shipped before
    "affinity_always_placed": {"placement_min_load": 0},
}
# the arms run by default: the router as it ships and Ray's, not the option variants
OPTION_ARMS = {*POLICY_ROUTER_KWARGS, "affinity_no_tier"}
DEFAULT_POLICIES = tuple(p for p in POLICIES if p not in OPTION_ARMS)
# engine -> LLMServer kwargs: raylora's (slots and CPU cache keep what this replica is asked
# for most, the read in a worker thread) or vLLM's (LRU, the read under the engine lock)
ENGINES: dict[str, dict] = {
    "raylora": {"adapter_eviction": "frequency", "read_adapters_in_step": False},
    # raylora without its shared adapter tier: every replica reads from disk itself
    "raylora_no_tier": {
        "adapter_eviction": "frequency",
        "read_adapters_in_step": False,
        "shared_adapter_tier": False,
    },
    "vllm": {
        "adapter_eviction": "lru",
        "read_adapters_in_step": True,
        "shared_adapter_tier": False,
    },
}


def build_llm_app(policy: str, args, model: str, adapters: dict[str, str]):
    """The LLMServer deployment alone (the benchmark calls it through a handle), with
    serve_app's engine arguments and deployment options."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    import serve_app
    from benchmarks.routing_timing import TimedLLMServer

    router, report_ids, engine_kind = POLICIES[policy]
    engine, app_options = serve_app.parse_args(
        {
            "model": model,
            "max_loras": args.max_loras,
            "max_cpu_loras": args.max_cpu_loras,
            "max_num_seqs": args.max_num_seqs,
            "num_kv_blocks": 256,
        }
    )
    options: dict = {
        "name": "LLMServer",
        "num_replicas": args.replicas,
        "ray_actor_options": {"num_cpus": 0.5},
        "max_ongoing_requests": 2 * args.max_num_seqs,
        "health_check_timeout_s": 60.0,
    }
    if router == "affinity":
        kwargs = {"max_loras": args.max_loras}
        if args.load_bound_c is not None:
            kwargs["load_bound_c"] = args.load_bound_c
        kwargs.update(json.loads(args.router_kwargs))
        kwargs.update(POLICY_ROUTER_KWARGS.get(policy, {}))
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="deployments.router:AdapterAffinityRouter",
            request_router_kwargs=kwargs,
            # as it ships (serve_app's routing_stats_period_s)
            request_routing_stats_period_s=app_options["routing_stats_period_s"],
        )
    return serve.deployment(TimedLLMServer, **options).bind(
        engine_config=engine,
        adapters=adapters,
        report_interval_s=1.0,
        report_multiplexed_ids=report_ids,
        **ENGINES[engine_kind],
    )


TINY_ADAPTER = (4, ("q_proj", "v_proj"))  # rank, target modules: the tiny model's adapters


def build_assets(
    workdir: Path,
    num_adapters: int,
    model_name: str = "tiny",
    rank: int = TINY_ADAPTER[0],
    targets: tuple[str, ...] = TINY_ADAPTER[1],
) -> tuple[str, dict[str, str]]:
    """The model and `num_adapters` random PEFT adapters of `rank` on `targets` for it (built
    once under `workdir`, reused). model_name: "tiny" (the tests' tiny random Llama, built
    here), or what `resolve_model` takes ("default": SmolLM2-135M-Instruct, as `make serve`
    runs it; a model folder)."""
    from tests.serve_fixtures import make_tiny_adapter

    if model_name == "tiny":
        from tests.model_fixtures import make_tiny_llama

        model = workdir / "tiny-llama"
        if not (model / "config.json").is_file():
            make_tiny_llama(model)
    else:
        from engine.models.loader import resolve_model

        model = resolve_model(model_name)
    folder = (
        "adapters"  # the tiny model's, where earlier runs built them
        if model_name == "tiny" and (rank, tuple(targets)) == TINY_ADAPTER
        else f"adapters-{model.name}-r{rank}-{'+'.join(targets)}"
    )
    adapters = {}
    for k in range(num_adapters):
        name = f"ad{k:02d}"
        path = workdir / folder / name
        if not (path / "adapter_config.json").is_file():
            make_tiny_adapter(model, path, rank, list(targets), seed=k)
        adapters[name] = str(path)
    return str(model), adapters
