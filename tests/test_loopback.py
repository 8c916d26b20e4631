"""A local Ray + Serve started the way the tests and `make serve` start it listens on loopback
only: every listening TCP socket it opens (GCS, raylet, workers, agents, the HTTP proxy) is
bound to 127.0.0.1 / ::1, read from the kernel's own socket tables.

Not covered, because it cannot pass: each Serve *replica* also starts an inter-deployment gRPC
server on "[::]:0", hard-coded in Ray Serve 2.60 (ray/serve/_private/replica.py,
`_on_initialized`) with no setting to change it. The test starts no replica."""

import socket
from pathlib import Path

import pytest

from tests.serve_fixtures import free_port, start_ray, stop_ray

TABLES = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))
LISTEN = "0A"


def _address(hex_addr: str, family: int) -> str:
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
                found.add((_address(addr, family), int(port, 16)))
    return found


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1" or addr.startswith("::ffff:127.")


def test_address_parsing():
    # 127.0.0.1:8000 and [::1]:22 as /proc/net/tcp{,6} print them
    assert _address("0100007F", socket.AF_INET) == "127.0.0.1"
    assert _address("00000000000000000000000001000000", socket.AF_INET6) == "::1"
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
