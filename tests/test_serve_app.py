"""The whole app on a local Ray cluster: tiny model, 2 replicas, 2 tiny PEFT adapters.

Talks to it with the official `openai` client and raw httpx; compares greedy outputs with
the engine's offline `LLM.generate` (the same engine code, no Ray, no HTTP).
"""

import json
import time
import uuid

import httpx
import pytest

from tests.serve_fixtures import (
    free_port,
    is_loopback,
    listening,
    make_broken_adapter,
    make_tiny_adapter,
    replica_stats,
    start_ray,
    stop_ray,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "raylora"
ENGINE = {"max_loras": 2, "max_cpu_loras": 4, "max_num_seqs": 8, "num_kv_blocks": 128}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    from ray import serve

    import serve_app

    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "a1": make_tiny_adapter(tiny_model_dir, root / "a1", 4, ["q_proj", "v_proj"], 1),
        "a2": make_tiny_adapter(tiny_model_dir, root / "a2", 8, ["gate_proj", "down_proj"], 2),
    }
    extra = make_tiny_adapter(tiny_model_dir, root / "a3", 4, ["k_proj", "o_proj"], 3)
    broken = make_broken_adapter(root / "broken")
    # dynamic_lora_loading_path: adapters no one loaded, served on their first request
    dynamic = tmp_path_factory.mktemp("dynamic")
    make_tiny_adapter(tiny_model_dir, dynamic / "d1", 4, ["q_proj", "o_proj"], 5)
    make_tiny_adapter(tiny_model_dir, dynamic / "d2", 8, ["v_proj", "gate_proj"], 6)
    make_broken_adapter(dynamic / "dbroken")
    port = free_port()
    listening_before = listening()
    start_ray(port)
    try:
        args = {
            "model": tiny_model_dir,
            "adapters": ",".join(f"{n}={p}" for n, p in adapters.items()),
            "num_replicas": "2",
            "num_cpus": "0.5",
            "adapter_roots": str(root),
            "dynamic_lora_loading_path": str(dynamic),
            "report_interval_s": "1",
            "routing_stats_period_s": "1",
            **{k: str(v) for k, v in ENGINE.items()},
        }
        serve.run(serve_app.build_app(args), name=APP, route_prefix="/")
        yield {
            "url": f"http://127.0.0.1:{port}",
            "adapters": {k: str(v) for k, v in adapters.items()},
            "extra": str(extra),
            "broken": str(broken),
            "dynamic": dynamic,
            "root": root,
            "listening_before": listening_before,
        }
    finally:
        stop_ray()


@pytest.fixture(scope="module")
def offline(tiny_model_dir, served):
    """Greedy reference outputs from the offline engine: {(adapter, kind): text}."""
    from engine import LLM, LoRARequest, SamplingParams

    llm = LLM(tiny_model_dir, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12)
    refs = {}
    paths = {**served["adapters"], **{d: str(served["dynamic"] / d) for d in ("d1", "d2")}}
    for i, name in enumerate([None, "a1", "a2", "d1", "d2"]):
        lora = None if name is None else LoRARequest(name, i, paths[name])
        refs[(name, "completion")] = llm.generate(PROMPT, params, lora_request=lora)[0]
        refs[(name, "chat")] = llm.chat(CHAT, params, lora_request=lora)[0]
    return {k: v.outputs[0].text for k, v in refs.items()}


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_app_listens_on_loopback_only(served):
    """Every socket the running app opened (Ray, the HTTP proxy, and each replica's
    inter-deployment gRPC server, which Ray binds to "[::]" unless deployments.grpc_bind
    rebinds it) is on loopback."""
    opened = listening() - served["listening_before"]
    assert len(opened) >= 8  # GCS, raylet, agents, workers, the proxy, 3 replicas' gRPC
    exposed = sorted(a for a in opened if not is_loopback(a[0]))
    assert not exposed, f"the app listens beyond loopback on {exposed}"


def test_models(client, tiny_model_dir):
    from pathlib import Path

    models = {m.id: m for m in client.models.list().data}
    base = Path(tiny_model_dir).name
    assert set(models) == {base, "a1", "a2"}
    assert models["a1"].parent == base and models["a2"].parent == base


def test_completions_match_offline_engine(client, offline):
    base = client.models.list().data[0].id
    for name, model in [(None, base), ("a1", "a1"), ("a2", f"{base}:a2")]:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == offline[(name, "completion")], name
        assert r.usage.completion_tokens > 0
    # the adapters change the output (else the comparison above proves little)
    assert len({offline[(n, "completion")] for n in (None, "a1", "a2")}) == 3


def test_streamed_chat_matches_offline_engine(client, offline):
    base = client.models.list().data[0].id
    for name, model in [(None, base), ("a1", "a1"), ("a2", "a2")]:
        stream = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == offline[(name, "chat")], name
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_and_n(client, offline):
    stream = client.completions.create(
        model="a1", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == offline[("a1", "completion")]
    r = client.completions.create(
        model="a2", prompt=PROMPT, max_tokens=5, n=2, temperature=0.8, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1]


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_bad_inputs_get_openai_errors_and_server_keeps_serving(served, client):
    url = served["url"]
    root = served["root"]
    with httpx.Client(base_url=url, timeout=120) as http:
        post = http.post
        _error(post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
        _error(
            post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"}),
            400,
        )
        for bad in [{"temperature": -1}, {"n": 0}, {"max_tokens": 0}, {"top_p": 0}, {"top_p": 2}]:
            _error(post("/v1/completions", json={"model": "a1", "prompt": "x", **bad}), 400)
        too_long = "hello " * 2000
        err = _error(post("/v1/completions", json={"model": "a1", "prompt": too_long}), 400)
        assert err["param"] == "prompt"
        _error(post("/v1/chat/completions", json={"model": "a1", "messages": "hi"}), 400)
        load = "/v1/load_lora_adapter"
        _error(post(load, json={"lora_name": "m", "lora_path": str(root / "missing")}), 404)
        _error(post(load, json={"lora_name": "b", "lora_path": served["broken"]}), 400)
        _error(post(load, json={"lora_name": "o", "lora_path": str(root / ".." / "x")}), 403)
        _error(post(load, json={"lora_name": "o", "lora_path": "/tmp"}), 403)
        _error(post("/v1/unload_lora_adapter", json={"lora_name": "never"}), 404)
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        assert 'status="404"' in metrics and "raylora_request_latency_seconds" in metrics
    r = client.completions.create(model="a1", prompt=PROMPT, max_tokens=3)
    assert r.choices[0].text


def test_load_use_unload_adapter(served, client):
    with httpx.Client(base_url=served["url"], timeout=120) as http:
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": served["extra"]}
        )
        assert r.status_code == 200, r.text
        assert "a3" in {m.id for m in client.models.list().data}
        out = client.completions.create(model="a3", prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.choices[0].text
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert r.status_code == 200, r.text
        assert "a3" not in {m.id for m in client.models.list().data}
        _error(http.post("/v1/completions", json={"model": "a3", "prompt": "x"}), 404)


def test_client_disconnect_aborts_the_engine_request(served):
    before = replica_stats(APP, want=2)
    aborted_before = sum(s["num_aborted_requests"] for s in before.values())
    body = {"model": "a1", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served["url"], timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    break  # got generated text: now hang up
    deadline = time.monotonic() + 30
    while True:
        stats = replica_stats(APP, want=2)
        aborted = sum(s["num_aborted_requests"] for s in stats.values())
        running = sum(s["num_running"] + s["num_waiting"] for s in stats.values())
        if (aborted > aborted_before and running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert aborted == aborted_before + 1
    assert running == 0


def test_residency_reaches_registry_and_router_stats(served):
    import ray

    from deployments.registry import get_registry

    snap = ray.get(get_registry().snapshot.remote())
    assert {"a1", "a2"} <= set(snap["adapters"])
    holders = {r for r, e in snap["residency"].items() if "a1" in e["cpu"] or "a1" in e["slots"]}
    assert holders, snap


def test_malformed_requests_leave_the_app_serving(served, client, offline):
    """Every malformed request of tests/malformed_requests.py gets its 4xx with OpenAI's
    error JSON from the running app (the engine's own checks included), and afterwards both
    replicas still answer exactly as the offline engine does."""
    from pathlib import Path

    from deployments.openai_app import MAX_BODY_BYTES
    from tests.malformed_requests import cases

    base = client.models.list().data[0].id
    all_cases = cases(base, "a1", str(served["root"]), MAX_BODY_BYTES)
    assert len(all_cases) >= 40
    with httpx.Client(base_url=served["url"], timeout=120) as http:
        for case in all_cases:
            headers = {"content-type": "application/json"}
            r = http.request(case.method, case.path, content=case.content(), headers=headers)
            try:
                _error(r, case.status)
            except AssertionError as e:
                raise AssertionError(f"{case.name}: {e}") from None
        err = _error(
            http.post("/v1/completions", json={"model": "a1", "prompt": "x", "max_tokens": 8192}),
            400,
        )
        assert "8192" in err["message"] and err["code"] == "context_length_exceeded"
        assert http.get("/health").status_code == 200
    assert Path(base)  # the base model's name is a folder name here
    for _ in range(4):  # base requests land on both replicas
        test_completions_match_offline_engine(client, offline)
    stats = replica_stats(APP, want=2)
    assert len(stats) == 2
    # stats()["gc"] (deployments/gc_heap.py) shows the heap Ray Serve froze at the end of
    # the replica's start-up (RAY_SERVE_FREEZE_GC_ON_STARTUP): torch, Ray, the engine
    assert all(s["gc"]["frozen_objects"] > 100_000 for s in stats.values()), stats


def test_nan_sampling_values_through_a_handle_are_refused(served, client, offline):
    """A handle caller skips the ingress's validation: the engine itself refuses non-finite
    values (a 400), so NaN cannot kill a replica's engine loop as it once did."""
    from ray import serve

    from deployments.protocol import APIError, GenerateRequest, SamplingSpec

    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    for bad in [
        SamplingSpec(temperature=float("nan")),
        SamplingSpec(temperature=float("inf")),
        SamplingSpec(top_p=float("nan")),
        SamplingSpec(seed=2**70),
        SamplingSpec(max_tokens=10**9),
    ]:
        for _ in range(2):  # both replicas
            request = GenerateRequest(uuid.uuid4().hex, bad, prompt=PROMPT)
            with pytest.raises(APIError) as e:
                handle.options(multiplexed_model_id="a1").complete.remote(request).result()
            assert e.value.status == 400, e.value.message
    for _ in range(4):
        test_completions_match_offline_engine(client, offline)


def test_unload_is_not_undone_by_a_registry_restart(served, client):
    """Unload an adapter and kill the registry before the replicas' next catalog sync: the
    restarted registry must not take the unloaded adapter back from a replica's stale
    report, and a runtime-loaded adapter must be listed and served throughout."""
    import ray

    from deployments.registry import get_registry

    with httpx.Client(base_url=served["url"], timeout=120) as http:
        load = "/v1/load_lora_adapter"
        for name in ("keep", "drop"):
            r = http.post(load, json={"lora_name": name, "lora_path": served["extra"]})
            assert r.status_code == 200, r.text
            # served once, so every replica that ran it knows it in its catalog
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
            assert out.choices[0].text is not None
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "drop"})
        assert r.status_code == 200, r.text
        ray.kill(get_registry(), no_restart=False)
        deadline = time.monotonic() + 6.0  # > report_interval_s: the stale reports arrive
        while time.monotonic() < deadline:
            ids = {m.id for m in client.models.list().data}
            assert "keep" in ids and "a1" in ids, ids
            assert "drop" not in ids, ids
            time.sleep(0.2)
        out = client.completions.create(model="keep", prompt=PROMPT, max_tokens=2)
        assert out.choices[0].text is not None
        _error(http.post("/v1/completions", json={"model": "drop", "prompt": "x"}), 404)
        http.post("/v1/unload_lora_adapter", json={"lora_name": "keep"})


def test_prefix_cache_hits_reach_usage_and_stats(served, client):
    """A long prompt sent again, base or adapter, reads its full KV blocks from the replica's
    prefix cache (the router keeps the prompt's prefix, or the adapter, on one replica):
    usage.prompt_tokens_details.cached_tokens says how many, on both endpoints, streamed or
    not, and the output is the same as the uncached first one."""
    block = ENGINE.get("block_size", 16)
    system = f"You are a careful assistant, request {uuid.uuid4().hex}. " * 5  # > 256 chars
    base = client.models.list().data[0].id
    for model in (base, "a1"):
        runs = [
            client.completions.create(
                model=model, prompt=system + PROMPT, max_tokens=8, temperature=0
            )
            for _ in range(3)
        ]
        first, *again = runs
        # a1's first run finds nothing: the base's blocks are not the adapter's
        assert first.usage.prompt_tokens_details.cached_tokens == 0, model
        for r in again:
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert 0 < cached < r.usage.prompt_tokens and cached % block == 0, (model, cached)
            assert r.choices[0].text == first.choices[0].text, model
        messages = [{"role": "system", "content": system}, *CHAT]
        chats = [
            list(
                client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            for _ in range(2)
        ]
        usage = [c[-1].usage for c in chats]
        assert usage[0].prompt_tokens_details.cached_tokens == 0, model
        assert usage[1].prompt_tokens_details.cached_tokens >= block, model
    stats = replica_stats(APP, want=2)
    hits = sum(s["prefix_cache_hits"] for s in stats.values())
    queries = sum(s["prefix_cache_queries"] for s in stats.values())
    assert 0 < hits < queries
    assert all(0 <= s["prefix_cache_hit_rate"] <= 1 for s in stats.values())


def test_dynamic_loading_path_serves_an_adapter_on_its_first_request(served, client, offline):
    """`d1` was never loaded: its first request has a replica load <dynamic path>/d1 and the
    ingress register it, and it answers what the offline engine makes with that folder."""
    assert "d1" not in {m.id for m in client.models.list().data}
    base = client.models.list().data[0].id
    out = client.completions.create(model=f"{base}:d1", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == offline[("d1", "completion")]
    assert offline[("d1", "completion")] != offline[(None, "completion")]
    assert "d1" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="d1", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == offline[("d1", "completion")]
    with httpx.Client(base_url=served["url"], timeout=120) as http:
        for model, status in [("d-nothing", 404), ("dbroken", 400), ("../root/a1", 404)]:
            _error(http.post("/v1/completions", json={"model": model, "prompt": "x"}), status)
    assert {"d-nothing", "dbroken"}.isdisjoint(m.id for m in client.models.list().data)


def test_dynamic_loading_path_serves_a_handle_caller_without_the_ingress(served, client, offline):
    """A handle call to LLMServer naming `d2` (never loaded) by its multiplexed model id, as
    Ray Serve LLM's multiplexed loader takes one: the replica loads <dynamic path>/d2 and
    registers it (the ingress then lists it); an id with nothing there is a 404."""
    from ray import serve

    from deployments.protocol import APIError, GenerateRequest, SamplingSpec

    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    spec = SamplingSpec(max_tokens=12, temperature=0)
    request = GenerateRequest(uuid.uuid4().hex, spec, prompt=PROMPT)
    out = handle.options(multiplexed_model_id="d2").complete.remote(request).result()
    assert out.outputs[0].text == offline[("d2", "completion")]
    assert offline[("d2", "completion")] not in {offline[(n, "completion")] for n in (None, "d1")}
    assert "d2" in {m.id for m in client.models.list().data}
    with pytest.raises(APIError) as e:
        request = GenerateRequest(uuid.uuid4().hex, spec, prompt=PROMPT)
        handle.options(multiplexed_model_id="d-nothing").complete.remote(request).result()
    assert e.value.status == 404
