"""Shared set-up for the Ray Serve tests: a tiny model, tiny PEFT adapters, a local cluster."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_adapter(
    model_dir: str | Path, out: str | Path, rank: int, targets: list[str], seed: int
) -> Path:
    """A PEFT LoRA adapter for the tiny model with random (non-zero) A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in peft_model.named_parameters():
            if "lora_" in name:
                w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out)
    return Path(out)


def make_tiny_adapters(model_dir: str | Path, root: Path, names) -> dict[str, Path]:
    """One rank-4 q/v adapter per name under root, each with its own seed."""
    return {
        name: make_tiny_adapter(model_dir, root / name, 4, ["q_proj", "v_proj"], i)
        for i, name in enumerate(names)
    }


def make_broken_adapter(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"r": "x", "peft_type": "LORA"}))
    (out / "adapter_model.safetensors").write_bytes(b"not safetensors")
    return out


def start_ray(port: int | None = None, namespace: str = "raylora-tests") -> dict:
    """A local 2-CPU cluster on loopback whose workers import this repo, with Serve started:
    HTTP on 127.0.0.1:port, or no HTTP proxy at all when port is None (handle-only tests)."""
    import ray
    from ray import serve

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p
    )
    # Loopback only: conftest.py sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, without which Ray
    # resolves _node_ip_address="127.0.0.1" to the host's IP (tests/test_loopback.py checks).
    ctx = ray.init(
        num_cpus=2, include_dashboard=False, namespace=namespace, _node_ip_address="127.0.0.1"
    )
    if port is None:
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    return ctx.address_info


def stop_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def replica_stats(app_name: str, want: int, timeout_s: float = 30.0) -> dict[str, dict]:
    """stats() of `want` distinct LLMServer replicas (base-model calls land at random)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=app_name)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        s = handle.stats.remote().result()
        seen[s["replica_id"]] = s
    return seen


# Listening TCP sockets, read from the kernel's tables (tests/test_loopback.py)
TABLES = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))
LISTEN = "0A"


def proc_address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc prints each 32-bit word of the address in host (little-endian) byte order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def listening() -> set[tuple[str, int]]:
    found = set()
    for path, family in TABLES:
        try:
            rows = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN:
                addr, port = fields[1].split(":")
                found.add((proc_address(addr, family), int(port, 16)))
    return found


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1" or addr.startswith("::ffff:127.")


def serve_tiny_app(model_dir: str, app: str, **args) -> str:
    """Start a local cluster on loopback and run serve_app.build_app over the tiny model
    (`args` are build_app arguments) as `app` at route "/"; -> its base URL. Stop it with
    stop_ray()."""
    from ray import serve

    import serve_app

    port = free_port()
    start_ray(port)
    try:
        serve.run(serve_app.build_app({"model": model_dir, **args}), name=app, route_prefix="/")
    except BaseException:
        stop_ray()
        raise
    return f"http://127.0.0.1:{port}"
