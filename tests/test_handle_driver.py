"""Another Ray job (a separate driver process) calls the app through Python handles."""

import subprocess
import sys
import textwrap

import pytest

from tests.serve_fixtures import REPO, free_port, make_tiny_adapter, start_ray, stop_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DRIVER = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray import serve
    from deployments.client import RayLoRAClient
    from deployments.protocol import APIError

    ray.init(address=sys.argv[1], namespace="other-job")
    client = RayLoRAClient(app_name="raylora")
    out = {}
    out["completion"] = client.complete("Hello there", adapter="ad", max_tokens=6, temperature=0)
    out["chat"] = client.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    out["stream"] = "".join(
        c["choices"][0]["text"]
        for c in client.stream("Hello there", adapter="ad", max_tokens=6, temperature=0)
        if c["choices"]
    )
    try:
        client.complete("x", adapter="missing")
    except APIError as e:
        out["missing_status"] = e.status
    from deployments.protocol import GenerateRequest, SamplingSpec

    llm = serve.get_deployment_handle("LLMServer", app_name="raylora")
    request = GenerateRequest("raw-1", SamplingSpec(max_tokens=6, temperature=0),
                              prompt="Hello there")
    raw = llm.options(multiplexed_model_id="ad").complete.remote(request).result()
    out["raw"] = raw.outputs[0].text
    print("RESULT " + json.dumps(out))
    """
)


def test_other_driver_gets_completion_with_adapter(tmp_path, tiny_model_dir):
    from ray import serve

    import serve_app

    adapter = make_tiny_adapter(tiny_model_dir, tmp_path / "ad", 4, ["q_proj", "v_proj"], 5)
    address = start_ray(free_port())["gcs_address"]
    try:
        app = serve_app.build_app(
            {
                "model": tiny_model_dir,
                "adapters": f"ad={adapter}",
                "num_replicas": "1",
                "num_kv_blocks": "64",
                "max_num_seqs": "4",
                "max_cpu_loras": "2",
                "max_loras": "1",
            }
        )
        serve.run(app, name="raylora", route_prefix="/")
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        proc = subprocess.run(
            [sys.executable, str(script), address],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        stop_ray()
    import json

    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    text = out["completion"]["choices"][0]["text"]
    assert text and out["completion"]["model"] == "ad"
    assert out["stream"] == text == out["raw"]
    assert out["chat"]["object"] == "chat.completion"
    assert out["missing_status"] == 404
