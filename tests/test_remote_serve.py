"""The app serving adapters from an S3 bucket (moto's S3 server on loopback,
tests/s3_fixtures.py): the replicas, Ray workers, read it with the credentials and endpoint
of their environment, loaded through `/v1/load_lora_adapter` under a URL adapter root and on
a first request through `dynamic_lora_loading_path`. Each answers what the offline engine
makes with the adapter's local folder."""

import httpx
import pytest

from tests.s3_fixtures import moto_s3, upload
from tests.serve_fixtures import free_port, make_tiny_adapter, start_ray, stop_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE = {"max_loras": 2, "max_cpu_loras": 4, "max_num_seqs": 8, "num_kv_blocks": 128}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_model_dir):
    from ray import serve

    import serve_app
    from engine import LLM, LoRARequest, SamplingParams

    root = tmp_path_factory.mktemp("s3-adapters")
    local = {
        "s1": make_tiny_adapter(tiny_model_dir, root / "s1", 4, ["q_proj", "v_proj"], 11),
        "s2": make_tiny_adapter(tiny_model_dir, root / "s2", 8, ["o_proj", "up_proj"], 12),
    }
    offline = LLM(tiny_model_dir, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12)
    want = {
        name: offline.generate(PROMPT, params, lora_request=LoRARequest(name, i + 1, str(p)))[0]
        .outputs[0]
        .text
        for i, (name, p) in enumerate(local.items())
    }
    want[""] = offline.generate(PROMPT, params)[0].outputs[0].text
    with moto_s3() as fs:  # the AWS environment is set before Ray starts: workers inherit it
        urls = {name: upload(fs, path, f"tenants/{name}") for name, path in local.items()}
        port = free_port()
        start_ray(port)
        try:
            args = {
                "model": tiny_model_dir,
                "num_replicas": "1",
                "num_cpus": "0.5",
                "adapter_roots": "s3://loras/tenants",
                "dynamic_lora_loading_path": "s3://loras/tenants",
                **{k: str(v) for k, v in ENGINE.items()},
            }
            serve.run(serve_app.build_app(args), name="raylora-s3", route_prefix="/")
            yield {"url": f"http://127.0.0.1:{port}", "urls": urls, "want": want}
        finally:
            stop_ray()


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    return http.post("/v1/completions", json=body)


def test_adapters_from_s3_serve_what_their_local_folders_do(app):
    want = app["want"]
    assert len(set(want.values())) == 3  # the adapters change the output
    with httpx.Client(base_url=app["url"], timeout=120) as http:
        # an explicit load under the URL root, under a name of the caller's choosing
        body = {"lora_name": "first", "lora_path": app["urls"]["s1"]}
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        r = _complete(http, "first")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["s1"]
        # outside the root: 403, and nothing was read
        body = {"lora_name": "x", "lora_path": "s3://loras/elsewhere/s1"}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 403
        # never loaded: the first request reads s3://loras/tenants/s2
        r = _complete(http, "s2")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["s2"]
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert models["s2"]["root"] == app["urls"]["s2"] and "first" in models
        r = _complete(http, "not-in-the-bucket")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = _complete(http, http.get("/v1/models").json()["data"][0]["id"])  # the base model
        assert r.json()["choices"][0]["text"] == want[""]
