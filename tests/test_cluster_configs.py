"""Cluster configs through Ray's own schemas (a typo fails here), and the autoscaling policy."""

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext, RequestRouterConfig
from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

from cluster.autoscaling import AdapterAwarePolicy, adapter_aware_policy

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def rayservice_serve_config() -> dict:
    return yaml.safe_load(load("rayservice.yaml")["spec"]["serveConfigV2"])


def _known(model) -> set[str]:
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def check_serve_config(raw: dict) -> ServeDeploySchema:
    """Ray's schema, plus unknown keys (DeploymentSchema ignores them silently), plus the
    nested configs built the way Serve builds them (which imports the router and policy)."""
    schema = ServeDeploySchema.model_validate(raw)
    for app in raw["applications"]:
        assert set(app) <= _known(ServeApplicationSchema), set(app) - _known(ServeApplicationSchema)
        for dep in app.get("deployments", []):
            assert set(dep) <= _known(DeploymentSchema), set(dep) - _known(DeploymentSchema)
            if "autoscaling_config" in dep:
                AutoscalingConfig(**dep["autoscaling_config"]).policy.get_policy()
            if "request_router_config" in dep:
                rc = RequestRouterConfig(**dep["request_router_config"])
                cls = importlib.import_module(rc.request_router_class.split(":")[0])
                router_cls = getattr(cls, rc.request_router_class.split(":")[1])
                router = router_cls(
                    deployment_id=DeploymentID(name=dep["name"], app_name=app["name"]),
                    handle_source=DeploymentHandleSource.UNKNOWN,
                )
                router.initialize_state(**rc.request_router_kwargs)  # kwargs typos raise
    return schema


def test_serve_config_validates():
    schema = check_serve_config(load("serve_config.yaml"))
    (app,) = schema.applications
    assert app.import_path == "serve_app:build_app"
    (dep,) = app.deployments
    assert dep.name == "LLMServer"
    assert dep.autoscaling_config["min_replicas"] == 1
    assert dep.autoscaling_config["max_replicas"] > 1


def test_rayservice_embeds_the_same_app_on_gpu_workers():
    rs = load("rayservice.yaml")
    assert rs["apiVersion"] == "ray.io/v1" and rs["kind"] == "RayService"
    inner = rayservice_serve_config()
    check_serve_config(inner)
    outer = load("serve_config.yaml")
    for app in outer["applications"]:
        app.pop("runtime_env", None)
    assert inner["applications"] == outer["applications"]
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] >= 1 and group["maxReplicas"] >= group["minReplicas"]
    res = group["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "1"


def test_ray_cluster_yaml_validates_against_autoscaler_schema():
    from ray.autoscaler._private.util import validate_config

    cfg = load("ray_cluster.yaml")
    validate_config(cfg)  # jsonschema against ray/autoscaler/ray-schema.json
    gpu = [t for t in cfg["available_node_types"].values() if t["resources"].get("GPU")]
    assert gpu and gpu[0]["max_workers"] >= gpu[0]["min_workers"] >= 1
    bad = {**cfg, "max_worker": 3}
    with pytest.raises(Exception, match="max_worker"):
        validate_config(bad)


def test_import_paths():
    from ray.serve.request_router import RequestRouter

    from deployments.router import AdapterAffinityRouter

    assert issubclass(AdapterAffinityRouter, RequestRouter)
    assert callable(importlib.import_module("cluster.autoscaling").adapter_aware_policy)
    if not (ROOT / "serve_app.py").exists():
        pytest.skip("serve_app.py has not landed yet")
    assert callable(importlib.import_module("serve_app").build_app)


# -- autoscaling policy ----------------------------------------------------------------------


def ctx(n: int, ongoing: float, metrics: dict[str, list[float]] | None = None, target=8.0):
    cfg = AutoscalingConfig(min_replicas=1, max_replicas=32, target_ongoing_requests=target)
    ids = [f"r{i}" for i in range(n)]
    agg = {name: dict(zip(ids, vals, strict=True)) for name, vals in (metrics or {}).items()}
    return AutoscalingContext(
        deployment_id=DeploymentID(name="LLMServer", app_name="raylora"),
        deployment_name="LLMServer",
        app_name="raylora",
        current_num_replicas=n,
        target_num_replicas=n,
        running_replicas=ids,
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics=agg,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=32,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=cfg,
    )


def test_policy_without_custom_metrics_is_rays_default_rule():
    desired, state = adapter_aware_policy(ctx(4, ongoing=64))
    assert desired == pytest.approx(64 / 8)  # 4 replicas * (64 / (8 * 4))
    assert state["adapter_aware"]["by_requests"] == pytest.approx(8)


def test_working_set_larger_than_slots_adds_replicas():
    # 4 replicas, light load, but 16 distinct adapters wanted per replica and 8 slots each.
    m = {"num_adapters_wanted": [16] * 4, "max_loras": [8] * 4}
    desired, _ = adapter_aware_policy(ctx(4, ongoing=8, metrics=m))
    assert desired == pytest.approx(4 * 64 / (32 * 0.9))
    # A working set that fits in fewer replicas lets the fleet shrink to that many.
    m = {"num_adapters_wanted": [4] * 4, "max_loras": [8] * 4}
    assert adapter_aware_policy(ctx(4, ongoing=8, metrics=m))[0] == pytest.approx(16 / 28.8 * 4)


def test_blocked_requests_and_misses_add_replicas():
    m = {"num_waiting_for_slot": [8, 8, 0, 0]}  # 16 waiting on slots = 2 x target
    assert adapter_aware_policy(ctx(4, ongoing=8, metrics=m))[0] == pytest.approx(6.0)
    m = {"adapter_loads_per_s": [8] * 4, "requests_per_s": [10] * 4}  # miss ratio 0.8
    assert adapter_aware_policy(ctx(4, ongoing=8, metrics=m))[0] == pytest.approx(4 * 0.8 / 0.5)
    m = {"adapter_loads_per_s": [2] * 4, "requests_per_s": [10] * 4}  # 0.2: fine
    assert adapter_aware_policy(ctx(4, ongoing=8, metrics=m))[0] == pytest.approx(1.0)


def test_policy_knobs_and_scale_to_zero_passthrough():
    m = {"num_adapters_wanted": [9] * 2, "max_loras": [8] * 2}
    strict = AdapterAwarePolicy(slot_target=0.5)
    assert strict(ctx(2, ongoing=1, metrics=m))[0] == pytest.approx(2 * 18 / 8)
    with pytest.raises(ValueError):
        AdapterAwarePolicy(slot_target=0)
    assert adapter_aware_policy(ctx(0, ongoing=0))[0] == 0
