"""Bind a Serve replica's inter-deployment gRPC server to the node's IP, not every interface.

Ray Serve 2.60 starts one gRPC server per replica on "[::]:0", hard-coded
(ray/serve/_private/replica.py, `_on_initialized`, with no setting to change it), so each
replica listens on every interface of its machine, whatever address Ray itself was told to
use. Callers reach that server at f"{node_ip}:{port}" only
(ray/serve/_private/request_router/replica_wrapper.py), so binding the node's own IP serves
them all: on a real cluster the pod or host IP, as before; on a local cluster started on
127.0.0.1 (tests, `make serve`), loopback only.

`bind_replica_grpc_to_node_ip()` is called first thing in each deployment's `__init__`, which
Serve runs in the replica's process before `_on_initialized` starts that server. Where Ray's
code has changed shape (no such function, or no "[::]" address), it changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ray.serve")

ALL_INTERFACES = "[::]:"


def node_address(ip: str) -> str:
    """The host part of a gRPC address for this IP: IPv6 in brackets."""
    return f"[{ip}]" if ":" in ip else ip


def rebind(add_port: Callable[[Any, str], int], ip: str) -> Callable[[Any, str], int]:
    """`add_port` with "[::]:PORT" addresses rewritten to "IP:PORT" (others untouched)."""

    def add_port_on_node_ip(server: Any, address: str) -> int:
        if address.startswith(ALL_INTERFACES):
            address = node_address(ip) + ":" + address[len(ALL_INTERFACES) :]
        return add_port(server, address)

    add_port_on_node_ip.raylora_rebound = True  # type: ignore[attr-defined]
    return add_port_on_node_ip


def bind_replica_grpc_to_node_ip() -> bool:
    """In a Serve replica's process: make its gRPC server bind the node IP. True if patched
    (now or by an earlier call)."""
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:
        return False
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None:
        logger.warning("raylora: this Ray has no add_port_to_grpc_server; replica gRPC unchanged")
        return False
    if getattr(add_port, "raylora_rebound", False):
        return True
    ip = ray.util.get_node_ip_address()
    replica.add_port_to_grpc_server = rebind(add_port, ip)
    return True
