"""serve_app's arguments (`serve run serve_app:app key=value ...`, `build_app`): what each
parses to, the router's kwargs they imply, and that every EngineConfig field is one."""

import pytest

pytestmark = pytest.mark.timeout(60)


def test_build_app_args():
    import serve_app

    engine, opts = serve_app.parse_args(
        {
            "model": "/m",
            "max_loras": "3",
            "num_replicas": "4",
            "num_cpus": "0.25",
            "adapters": "a=hub/a,b=org/b",
            "adapter_roots": "/x,/y",
            "demo_adapters": "true",
            "shared_adapter_tier": "false",
        }
    )
    assert engine == {"model": "/m", "max_loras": 3}
    assert opts["shared_adapter_tier"] is False
    assert serve_app.parse_args({})[1]["shared_adapter_tier"] is True  # on unless turned off
    assert opts["num_replicas"] == 4 and opts["num_cpus"] == 0.25
    assert opts["adapters"] == {"a": "hub/a", "b": "org/b"}
    assert opts["adapter_roots"] == ["/x", "/y"] and opts["demo_adapters"] is True
    with pytest.raises(ValueError, match="unknown build_app argument"):
        serve_app.parse_args({"max_lora": "2"})
    assert serve_app.parse_args({"shared_tier_mb": "512"})[1]["shared_tier_mb"] == 512
    with pytest.raises(ValueError, match="shared_tier_mb"):
        serve_app.parse_args({"shared_tier_mb": "-1"})
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        serve_app.parse_args({"adapters": "a=/does/not/exist"})
    with pytest.raises(ValueError, match="may not begin with 'prefix:'"):
        serve_app.parse_args({"adapters": "prefix:a=hub/a"})
    assert serve_app.build_app({"num_replicas": "1"}) is not None


def test_object_storage_urls_in_paths_and_adapters():
    """A URL is one root (not split at its ':' as folders are at os.pathsep) and an adapter
    at a URL is not checked as a local folder at build time (its replica reads it)."""
    import serve_app

    _, opts = serve_app.parse_args(
        {
            "adapter_roots": "s3://bucket/loras/,/x:/y,gs://b/l",
            "adapters": "a=s3://bucket/loras/a",
            "dynamic_lora_loading_path": "s3://bucket/loras",
        }
    )
    assert opts["adapter_roots"] == ["s3://bucket/loras/", "/x", "/y", "gs://b/l"]
    assert opts["adapters"] == {"a": "s3://bucket/loras/a"}
    assert opts["dynamic_lora_loading_path"] == "s3://bucket/loras"
    assert serve_app.parse_args({})[1]["dynamic_lora_loading_path"] is None


def test_router_kwargs_bound_a_replica_by_its_batch():
    import dataclasses

    import serve_app
    from engine.config import EngineConfig

    default = {f.name: f.default for f in dataclasses.fields(EngineConfig)}["max_num_seqs"]
    engine, opts = serve_app.parse_args({"max_loras": "3", "max_num_seqs": "12"})
    assert serve_app.router_kwargs(engine, opts) == {"max_loras": 3, "max_batch": 12}
    engine, opts = serve_app.parse_args({"min_load_bound": "2"})
    assert serve_app.router_kwargs(engine, opts) == {
        "min_load_bound": 2,
        "max_batch": default,  # serve_app's copy of EngineConfig's default holds
    }


def test_build_app_takes_every_engine_config_field():
    import dataclasses

    import serve_app
    from engine.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    assert set(serve_app.ENGINE_ARGS) == fields
    engine, _ = serve_app.parse_args(
        {"lora_dtype": "bfloat16", "enable_lora": "false", "lora_starvation_steps": "8"}
    )
    assert engine == {
        "model": "default",
        "lora_dtype": "bfloat16",
        "enable_lora": False,
        "lora_starvation_steps": 8,
    }
    EngineConfig(**engine)  # the parsed values are what EngineConfig takes
