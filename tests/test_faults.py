"""Faults inside a running app (tiny model, 2 replicas): a failing engine step fails only
its own requests, and an engine loop that dies is reported by check_health, routed around,
and replaced by Serve. Faults are injected through LLMServer.inject_fault, which the
replicas accept because the cluster runs with RAYLORA_FAULT_INJECTION=1."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import httpx
import pytest

from tests.serve_fixtures import serve_tiny_app, stop_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "faults"
ENGINE = {"max_loras": 1, "max_cpu_loras": 2, "max_num_seqs": 8, "num_kv_blocks": 128}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    os.environ["RAYLORA_FAULT_INJECTION"] = "1"  # inherited by the replicas' processes
    try:
        args = {k: str(v) for k, v in ENGINE.items()}
        url = serve_tiny_app(
            tiny_model_dir,
            APP,
            num_replicas="2",
            num_cpus="0.5",
            routing_stats_period_s="1",
            **args,
        )
        yield url
    finally:
        stop_ray()
        os.environ.pop("RAYLORA_FAULT_INJECTION", None)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, served):
    from engine import LLM, SamplingParams

    out = LLM(tiny_model_dir, **ENGINE).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=6)
    )
    return out[0].outputs[0].text


def _llm():
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP)


def _running_ids() -> set[str]:
    """The LLMServer replicas' actor names: a replaced replica gets a new one."""
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return {
        a["name"]
        for a in names
        if a["namespace"] == "serve" and "LLMServer" in a["name"] and APP in a["name"]
    }


def _post(url: str, **fields) -> httpx.Response:
    body = {"model": _base(url), "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _base(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


def test_a_failing_step_fails_only_its_requests(served, reference):
    url = served
    replicas_before = _running_ids()
    victim = _llm().inject_fault.remote("step").result()
    statuses: list[int] = []
    with cf.ThreadPoolExecutor(8) as pool:
        # enough requests that some land on the victim's next step
        for r in pool.map(lambda _: _post(url), range(16)):
            statuses.append(r.status_code)
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == reference
            else:
                assert r.status_code == 500, r.text
                assert r.json()["error"]["code"] == "engine_error", r.text
    assert 1 <= statuses.count(500) < len(statuses), statuses
    # the victim keeps serving: the same replicas, every answer right
    for _ in range(8):
        r = _post(url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    assert _running_ids() == replicas_before
    assert any(victim in name for name in replicas_before)


def test_a_dead_engine_loop_is_replaced(served, reference):
    url = served
    before = _running_ids()
    assert len(before) == 2
    _llm().inject_fault.remote("loop").result()
    killed_at = time.monotonic()
    failures = []
    replaced_after = None
    while time.monotonic() - killed_at < 60:
        r = _post(url)  # non-streaming: retried past the dead replica, never lost
        if r.status_code != 200 or r.json()["choices"][0]["text"] != reference:
            failures.append((r.status_code, r.text[:200]))
        now = _running_ids()
        if len(now) == 2 and now != before and replaced_after is None:
            replaced_after = time.monotonic() - killed_at
            break
        time.sleep(0.2)
    assert replaced_after is not None, "Serve did not replace the replica in 60 s"
    assert replaced_after < 30, replaced_after
    assert not failures, failures[:3]
    for _ in range(4):
        assert _post(url).json()["choices"][0]["text"] == reference
    assert httpx.get(url + "/health", timeout=30).status_code == 200
