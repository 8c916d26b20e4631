"""The OpenAI HTTP layer without Ray: parsing, validation, model names, errors, SSE.

The LLMServer and the registry are replaced by small fakes (below); what the engine itself
generates is tested through the real app in tests/test_serve_app.py.
"""

import asyncio
import os

import pytest
from fastapi.testclient import TestClient

from deployments.openai_app import build_openai_app
from deployments.openai_serving import OpenAIServing
from deployments.protocol import APIError, SamplingSpec
from tests.ingress_fakes import BASE, WORDS, FakeLLM, FakeRegistry, assert_error, sse_events

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def env(tmp_path):
    llm = FakeLLM()
    registry = FakeRegistry({"sql": {"source": "/adapters/sql", "rank": 8}})
    root = tmp_path / "adapters"
    (root / "good").mkdir(parents=True)
    serving = OpenAIServing(llm, registry, adapter_roots=[str(root)])
    client = TestClient(build_openai_app(serving))
    return client, llm, registry, serving, root


def test_model_names_resolve_to_base_or_adapter(env):
    client, llm, *_ = env
    for model, adapter in [(BASE, ""), ("sql", "sql"), (f"{BASE}:sql", "sql")]:
        r = client.post("/v1/completions", json={"model": model, "prompt": "hi"})
        assert r.status_code == 200, r.text
        assert llm.requests[-1][1] == adapter
        assert r.json()["model"] == model
    for model in ["nope", f"{BASE}:nope", "other:sql"]:
        err = assert_error(
            client.post("/v1/completions", json={"model": model, "prompt": "x"}), 404
        )
        assert err["code"] == "model_not_found" and err["param"] == "model"


def test_models_list_base_and_adapters_with_parent(env):
    client, *_ = env
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    ids = {m["id"]: m for m in data["data"]}
    assert ids[BASE]["parent"] is None and ids[BASE]["object"] == "model"
    assert ids["sql"]["parent"] == BASE and ids["sql"]["root"] == "/adapters/sql"


def test_completion_response_shape_and_request(env):
    client, llm, *_ = env
    r = client.post(
        "/v1/completions",
        json={
            "model": BASE,
            "prompt": "Say hi",
            "max_tokens": 5,
            "temperature": 0,
            "n": 2,
            "stop": ["\n"],
            "seed": 3,
            "echo": True,
            "unknown_field": 1,
        },
    )
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == "Say hi" + "".join(WORDS)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 10,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    request, _ = llm.requests[-1]
    assert request.prompt == "Say hi" and request.echo
    assert body["id"] == f"cmpl-{request.request_id}"  # the request id is minted once
    assert request.default_max_tokens == 16
    assert request.sampling == SamplingSpec(
        n=2, temperature=0.0, top_p=1.0, max_tokens=5, stop=["\n"], seed=3
    )


def test_token_id_prompt_and_single_item_batch(env):
    client, llm, *_ = env
    client.post("/v1/completions", json={"model": BASE, "prompt": [5, 6, 7]})
    assert llm.requests[-1][0].prompt_token_ids == [5, 6, 7]
    assert llm.requests[-1][0].prompt is None
    client.post("/v1/completions", json={"model": BASE, "prompt": ["only one"]})
    assert llm.requests[-1][0].prompt == "only one"


@pytest.mark.parametrize(
    "body",
    [
        {"model": BASE, "prompt": ""},
        {"model": BASE, "prompt": "x", "presence_penalty": 0.5},
        {"model": BASE, "prompt": "x", "logit_bias": {"1": 2}},
        {"model": BASE, "prompt": "x", "best_of": 3},
        {"model": BASE, "prompt": "x", "max_tokens": "many"},
        {"model": BASE},
        {"prompt": "x"},
    ],
)
def test_invalid_completion_requests_are_400(env, body):
    client, *_ = env
    assert_error(client.post("/v1/completions", json=body), 400)


def test_malformed_json_is_400(env):
    client, *_ = env
    for raw in [b"{not json", b"[1, 2]", b"\xff\xfe"]:
        r = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert_error(r, 400)


def test_replica_errors_keep_their_status(env):
    from ray.serve.exceptions import BackPressureError

    client, llm, *_ = env
    cases = [
        (APIError(400, "temperature must be >= 0"), 400),
        (APIError(400, "prompt too long", param="prompt", code="context_length_exceeded"), 400),
        (BackPressureError(num_queued_requests=5, max_queued_requests=4), 503),
        (RuntimeError("boom"), 500),
    ]
    for exc, status in cases:
        llm.raise_on_call = exc
        for stream in (False, True):
            body = {"model": BASE, "prompt": "x", "stream": stream}
            assert_error(client.post("/v1/completions", json=body), status)
    llm.raise_on_call = None
    assert client.post("/v1/completions", json={"model": BASE, "prompt": "x"}).status_code == 200


def test_wrapped_ray_task_error_is_unwrapped(env):
    class Wrapped(Exception):  # what a RayTaskError looks like: the replica's error in .cause
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    client, llm, *_ = env
    llm.raise_on_call = Wrapped(
        APIError(404, "The model `x` does not exist.", code="model_not_found")
    )
    err = assert_error(client.post("/v1/completions", json={"model": "sql", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"


def test_streamed_completion(env):
    client, *_ = env
    r = client.post(
        "/v1/completions",
        json={
            "model": "sql",
            "prompt": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(r)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "".join(WORDS)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_streamed_chat(env):
    client, llm, *_ = env
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": f"{BASE}:sql",
            "stream": True,
            "max_tokens": 3,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        },
    )
    chunks = sse_events(r)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "".join(WORDS[:3])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    request, adapter = llm.requests[-1]
    assert adapter == "sql"
    assert request.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_chat_non_streamed(env):
    client, *_ = env
    r = client.post(
        "/v1/chat/completions",
        json={"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    )
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "".join(WORDS)}
    for bad in [
        {"model": BASE, "messages": []},
        {"model": BASE, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
    ]:
        assert_error(client.post("/v1/chat/completions", json=bad), 400)


def test_consumer_that_stops_closes_the_replica_stream(env):
    _, llm, _, serving, _ = env
    from deployments.openai_protocol import CompletionRequest

    async def run():
        chunks = await serving.stream(CompletionRequest(model=BASE, prompt="x", stream=True))
        await chunks.__anext__()
        await chunks.aclose()  # what Starlette does when the client disconnects

    asyncio.run(run())
    assert llm.closed_early


def test_api_key(env):
    _, llm, registry, _, _ = env
    serving = OpenAIServing(llm, registry, api_key="s3cret")
    client = TestClient(build_openai_app(serving))
    body = {"model": BASE, "prompt": "x"}
    err = assert_error(client.post("/v1/completions", json=body), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(
        client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_error(client.get("/v1/models"), 401)
    ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200  # health and metrics need no key
    assert client.get("/metrics").status_code == 200


def test_load_and_unload_adapter(env):
    client, llm, registry, _, root = env
    path = str(root / "good")
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": path})
    assert r.status_code == 200, r.text
    assert registry.adapters["good"]["source"] == path
    assert client.post("/v1/completions", json={"model": "good", "prompt": "x"}).status_code == 200
    # same name, other path -> 400; same name, same path -> idempotent
    (root / "other").mkdir()
    assert_error(
        client.post(
            "/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(root / "other")}
        ),
        400,
    )
    assert (
        client.post(
            "/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": path}
        ).status_code
        == 200
    )
    assert_error(
        client.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": path}), 400
    )
    # a name the router would take for a base request's prompt-prefix key: refused, unregistered
    err = assert_error(
        client.post("/v1/load_lora_adapter", json={"lora_name": "prefix:good", "lora_path": path}),
        400,
    )
    assert err["param"] == "lora_name" and "prefix:" in err["message"]
    assert "prefix:good" not in registry.adapters
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "good"})
    assert r.status_code == 200
    assert "good" not in registry.adapters
    assert_error(client.post("/v1/completions", json={"model": "good", "prompt": "x"}), 404)
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "good"}), 404)


def test_load_adapter_errors(env, tmp_path):
    client, _, _, _, root = env
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, root / "link")
    for path in [str(outside), str(root / ".." / "elsewhere"), str(root / "link"), "/etc"]:
        err = assert_error(
            client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}), 403
        )
        assert err["type"] == "permission_error"
    assert_error(
        client.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "missing")}
        ),
        404,
    )
    assert_error(
        client.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "broken")}
        ),
        400,
    )
    assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)


def test_unknown_route_is_openai_shaped(env):
    client, *_ = env
    assert_error(client.get("/v1/nothing"), 404)


def test_metrics_text(env):
    client, *_ = env
    client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
    r = client.get("/metrics")
    assert r.status_code == 200
    assert 'raylora_requests_total{endpoint="completions",model="sql",status="200"}' in r.text
    assert "raylora_request_latency_seconds_bucket" in r.text


def test_metrics_label_only_served_models(env):
    """A client's made-up model names (404s, or 400s naming no served model) share one
    "unknown" label: each would otherwise add time series to the ingress for good."""
    client, *_ = env

    def unknown_404s() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(
                'raylora_requests_total{endpoint="completions",model="unknown",status="404"}'
            ):
                return float(line.split()[-1])
        return 0.0

    before = unknown_404s()  # the registry is the process's: other tests count too
    for i in range(20):
        assert_error(client.post("/v1/completions", json={"model": f"m{i}", "prompt": "x"}), 404)
    bad = {"model": "nope", "prompt": "x", "temperature": -1}
    assert client.post("/v1/completions", json=bad).status_code == 400
    assert (
        client.post("/v1/completions", json={"model": f"{BASE}:sql", "prompt": "x"}).status_code
        == 200
    )
    assert client.post("/v1/completions", json={"model": BASE, "prompt": "x"}).status_code == 200
    text = client.get("/metrics").text
    assert unknown_404s() == before + 20
    assert 'model="unknown",status="400"' in text
    assert f'model="{BASE}:sql",status="200"' in text and f'model="{BASE}",status="200"' in text
    assert 'model="m1"' not in text and 'model="nope"' not in text
