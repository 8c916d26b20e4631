"""At the ingress, without Ray: `dynamic_lora_loading_path` (Ray Serve LLM's name; vLLM's
filesystem LoRA resolver does the same), where a model naming no adapter in the catalog loads
`<path>/<name>` on a replica and registers it, and `adapter_roots` that are object-storage
URLs. What the real engine serves that way is tested through the app in
tests/test_serve_app.py, and reads from object storage in tests/test_remote_adapters.py."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from deployments.openai_app import build_openai_app
from deployments.openai_serving import OpenAIServing
from deployments.protocol import APIError
from tests.ingress_fakes import BASE, FakeLLM, FakeRegistry, assert_error

pytestmark = pytest.mark.timeout(60)

DYNAMIC = "s3://bucket/loras"


class SlowLoadLLM(FakeLLM):
    """Loads take 50 ms (a download), so requests at once overlap one."""

    async def load_adapter(self, name: str, path: str) -> dict:
        await asyncio.sleep(0.05)
        return await super().load_adapter(name, path)


def _app(dynamic: str | None = DYNAMIC, llm: FakeLLM | None = None):
    llm = llm or FakeLLM()
    registry = FakeRegistry({"sql": {"source": "/adapters/sql", "rank": 8}})
    serving = OpenAIServing(llm, registry, dynamic_lora_loading_path=dynamic)
    return TestClient(build_openai_app(serving)), llm, registry, serving


def test_unknown_model_loads_from_the_dynamic_path_and_is_then_served():
    client, llm, registry, _ = _app()
    for model in ["tenant-7", f"{BASE}:tenant.8"]:
        r = client.post("/v1/completions", json={"model": model, "prompt": "hi"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
    assert llm.loaded == [("tenant-7", f"{DYNAMIC}/tenant-7"), ("tenant.8", f"{DYNAMIC}/tenant.8")]
    assert [adapter for _, adapter in llm.requests] == ["tenant-7", "tenant.8"]
    assert registry.adapters["tenant-7"]["source"] == f"{DYNAMIC}/tenant-7"
    # registered: the next request is served without another load, and /v1/models lists it
    assert client.post("/v1/completions", json={"model": "tenant-7", "prompt": "x"}).is_success
    assert len(llm.loaded) == 2
    assert "tenant-7" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    # a catalog adapter is never looked up there
    assert client.post("/v1/completions", json={"model": "sql", "prompt": "x"}).is_success
    assert len(llm.loaded) == 2


def test_names_no_folder_can_have_are_404_without_a_load():
    client, llm, *_ = _app()
    for model in [
        "../etc",
        "a/b",
        ".hidden",
        "x" * 200,
        "prefix:sql",
        f"{BASE}:",
        "a b",
        BASE + "x:",
    ]:
        err = assert_error(
            client.post("/v1/completions", json={"model": model, "prompt": "x"}), 404
        )
        assert err["code"] == "model_not_found" and err["param"] == "model"
    assert llm.loaded == []


def test_what_the_load_says_reaches_the_caller():
    client, llm, registry, _ = _app()
    # nothing there: the model does not exist (404), and nothing is registered
    err = assert_error(
        client.post("/v1/completions", json={"model": "missing", "prompt": "x"}), 404
    )
    assert err["code"] == "model_not_found" and "missing" in err["message"]
    # something there the base model cannot serve: the replica's 400, as a load would get
    err = assert_error(client.post("/v1/completions", json={"model": "broken", "prompt": "x"}), 400)
    assert "adapter_config.json" in err["message"]
    assert "missing" not in registry.adapters and "broken" not in registry.adapters


def test_without_the_path_an_unknown_model_is_404():
    client, llm, *_ = _app(dynamic=None)
    assert_error(client.post("/v1/completions", json={"model": "tenant-7", "prompt": "x"}), 404)
    assert llm.loaded == []


def test_requests_at_once_for_one_new_adapter_share_one_load():
    llm = SlowLoadLLM()
    _, _, registry, serving = _app(llm=llm)

    async def run():
        got = await asyncio.gather(*(serving.resolve_model("burst") for _ in range(20)))
        assert got == ["burst"] * 20
        missing = await asyncio.gather(
            *(serving.resolve_model("missing") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(e, APIError) and e.status == 404 for e in missing)

    asyncio.run(run())
    assert llm.loaded == [("burst", f"{DYNAMIC}/burst")]
    assert "burst" in registry.adapters


def test_url_adapter_roots_allow_loads_under_them_only():
    llm = FakeLLM()
    serving = OpenAIServing(llm, FakeRegistry({}), adapter_roots=["s3://bucket/loras", "/srv/a"])
    client = TestClient(build_openai_app(serving))

    def load(path: str):
        return client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})

    assert load("s3://bucket/loras/x").status_code == 200
    for path in [
        "s3://bucket/other/x",
        "s3://bucket/loras-x/y",
        "s3://bucket/loras/../x",
        "gs://bucket/loras/x",
    ]:
        err = assert_error(load(path), 403)
        assert err["param"] == "lora_path"
    assert llm.loaded == [("x", "s3://bucket/loras/x")]
