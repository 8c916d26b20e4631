"""The ingress and the adapter registry without Ray: a request for a name the catalog lacks
waits for a restarted registry to recover, and concurrent requests share its listings."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from deployments.openai_app import build_openai_app
from deployments.openai_serving import OpenAIServing
from deployments.protocol import APIError
from tests.ingress_fakes import BASE, FakeLLM, FakeRegistry, assert_error

pytestmark = pytest.mark.timeout(60)


class RecoveringRegistry(FakeRegistry):
    """A restarted registry: empty and `recovering` until the first replica report, which
    arrives `report_after` list calls later (or never) and restores the catalog."""

    def __init__(self, catalog: dict[str, dict], report_after: int | None) -> None:
        super().__init__({})
        self.catalog, self.report_after, self.calls = catalog, report_after, 0

    async def list_adapters(self) -> dict[str, dict]:
        self.calls += 1
        if self.report_after is not None and self.calls > self.report_after:
            self.adapters.update(self.catalog)
        return await super().list_adapters()

    async def recovering(self) -> bool:
        return not self.adapters


def test_request_waits_for_a_recovering_registry(monkeypatch):
    import deployments.openai_serving as serving_mod

    monkeypatch.setattr(serving_mod, "RECOVERY_POLL_S", 0.01)
    spec = {"sql": {"source": "/adapters/sql", "rank": 8}}
    llm = FakeLLM()
    # Restored on the 4th listing: the request waits through the gap instead of a 404.
    registry = RecoveringRegistry(spec, report_after=3)
    client = TestClient(build_openai_app(OpenAIServing(llm, registry)))
    r = client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
    assert r.status_code == 200, r.text
    assert llm.requests[-1][1] == "sql" and registry.calls == 4
    # An adapter the restored catalog lacks: 404 once the registry has recovered.
    assert_error(client.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    # A registry that never recovers: 404 after RECOVERY_WAIT_S, not a hang.
    monkeypatch.setattr(serving_mod, "RECOVERY_WAIT_S", 0.2)
    stuck = RecoveringRegistry(spec, report_after=None)
    client = TestClient(build_openai_app(OpenAIServing(FakeLLM(), stuck)))
    assert_error(client.post("/v1/completions", json={"model": "sql", "prompt": "x"}), 404)
    assert stuck.calls > 3


class SlowRegistry(FakeRegistry):
    """Lists what it holds when a listing begins, 50 ms before it answers; counts listings."""

    def __init__(self, adapters: dict[str, dict]) -> None:
        super().__init__(adapters)
        self.listings = 0
        self.questions = 0  # calls of `recovering`

    async def recovering(self) -> bool:
        self.questions += 1
        await asyncio.sleep(0.05)
        return False

    async def list_adapters(self) -> dict[str, dict]:
        self.listings += 1
        snapshot = dict(self.adapters)
        await asyncio.sleep(0.05)
        return snapshot


def test_requests_naming_no_adapter_share_registry_listings():
    """Each request for a name not in the catalog has the registry listed before its 404 (the
    adapter may have been loaded through another ingress). 50 at once share three listings
    (the old catalog's, the first refresh's, the rest's), not 50: the registry is one actor,
    and a listing carries every adapter. A listing begun before a request asked is not taken
    as fresh for it. The same for asking whether the registry is recovering, before a 404."""
    registry = SlowRegistry({"sql": {"source": "/adapters/sql", "rank": 8}})
    serving = OpenAIServing(FakeLLM(), registry, served_model_name=BASE)

    async def run():
        got = await asyncio.gather(
            *(serving.resolve_model(f"m{i}") for i in range(50)), return_exceptions=True
        )
        assert all(isinstance(e, APIError) and e.status == 404 for e in got)
        assert registry.listings <= 3 and registry.questions <= 3
        assert await serving.resolve_model("sql") == "sql"
        # a listing under way when "new" is registered does not hold it: the request for
        # "new" waits for one begun after it asked
        under_way = asyncio.ensure_future(serving.catalog(refresh=True))
        await asyncio.sleep(0.01)
        registry.adapters["new"] = {"source": "/adapters/new", "rank": 8}
        assert await serving.resolve_model("new") == "new"
        assert "new" not in await under_way  # listed before it was registered

    asyncio.run(run())
