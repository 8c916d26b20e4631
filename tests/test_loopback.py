"""A local Ray + Serve started the way the tests and `make serve` start it listens on loopback
only: every listening TCP socket it opens (GCS, raylet, workers, agents, the HTTP proxy) is
bound to 127.0.0.1 / ::1, read from the kernel's own socket tables.

This test starts no replica. Each Serve replica also starts an inter-deployment gRPC server,
which Ray Serve 2.60 binds to "[::]:0" (every interface; ray/serve/_private/replica.py,
`_on_initialized`); raylora's deployments rebind it to the node's IP (deployments/grpc_bind.py).
tests/test_serve_app.py checks the whole running app, replicas included; the rewrite itself is
tested below."""

import socket
from pathlib import Path

import pytest

from tests.serve_fixtures import (
    free_port,
    is_loopback,
    listening,
    proc_address,
    start_ray,
    stop_ray,
)


def test_address_parsing():
    # 127.0.0.1:8000 and [::1]:22 as /proc/net/tcp{,6} print them
    assert proc_address("0100007F", socket.AF_INET) == "127.0.0.1"
    assert proc_address("00000000000000000000000001000000", socket.AF_INET6) == "::1"
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and is_loopback("::1")


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net/tcp")
def test_ray_and_serve_listen_on_loopback_only():
    before = listening()
    port = free_port()
    start_ray(port=port)
    try:
        opened = listening() - before
        assert ("127.0.0.1", port) in opened  # the Serve HTTP proxy is up: this sees Ray's sockets
        assert len(opened) >= 5  # GCS, raylet, agents, driver and actor workers
        exposed = sorted(a for a in opened if not is_loopback(a[0]))
        assert not exposed, f"Ray/Serve listen beyond loopback on {exposed}"
    finally:
        stop_ray()


def test_replica_grpc_address_rewrite():
    from deployments.grpc_bind import rebind

    seen = []

    def add_port(server, address):
        seen.append(address)
        return 4242

    assert rebind(add_port, "127.0.0.1")(None, "[::]:0") == 4242
    rebind(add_port, "10.1.2.3")(None, "[::]:50051")
    rebind(add_port, "fd00::7")(None, "[::]:0")
    rebind(add_port, "127.0.0.1")(None, "0.0.0.0:9000")  # not Ray's "[::]" form: untouched
    assert seen == ["127.0.0.1:0", "10.1.2.3:50051", "[fd00::7]:0", "0.0.0.0:9000"]
