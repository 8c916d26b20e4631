"""Adapters loaded on their first request from a folder or bucket: `dynamic_lora_loading_path`.

Ray Serve LLM's `LoraConfig(dynamic_lora_loading_path="s3://bucket/loras")` serves model id
`<base>:<name>` from `<path>/<name>` with no load call first; vLLM's filesystem LoRA resolver
does the same for a bare name. The ingress does it here: a model naming no adapter in the
catalog (after a fresh listing) is looked up as `<path>/<name>`; a replica loads it (reading
it, from object storage too, and validating it against the base model, as
`/v1/load_lora_adapter` does) and it is registered, so every replica and ingress then serves
it like any loaded adapter. A replica does the same for a handle caller that names an
adapter by its multiplexed model id without the ingress (`for_replica`), as Ray Serve LLM's
multiplexed loader does. The path is the operator's, so it needs no `adapter_roots`; a
name is used only if it is one folder name (no `/`, no leading `.`, no `:`), so a request
cannot reach outside the path.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.protocol import APIError
from engine.remote import join

logger = logging.getLogger("ray.serve")

# one path component, as a folder or object name: no "/", no leading "." (so not ".."), no
# ":" (`<base>:<name>` is split before; "prefix:" is the router's mark of a prefix key)
DYNAMIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

Load = Callable[[str, str], Awaitable[dict]]  # (name, path) -> the adapter's catalog entry
Register = Callable[[str, dict], Awaitable[None]]


class DynamicAdapters:
    """Loads `<path>/<name>` for names the catalog lacks; requests at once share one load."""

    def __init__(self, path: str, load: Load, register: Register, to_api_error: Callable) -> None:
        self.path = path
        self._load, self._register, self._to_api_error = load, register, to_api_error
        self._flights: dict[str, asyncio.Future] = {}  # name -> its load under way

    async def serve(self, name: str) -> bool:
        """Load and register `name` from the path. False: not a folder name, or nothing
        there (the caller's 404). Any other failure (an adapter the base model cannot serve:
        400; a replica down: 503) raises its APIError."""
        if not DYNAMIC_NAME.fullmatch(name):
            return False
        flight = self._flights.get(name)
        if flight is None:
            flight = self._flights[name] = asyncio.ensure_future(self._load_and_register(name))
            flight.add_done_callback(lambda done: self._landed(name, done))
        return await asyncio.shield(flight)  # a caller going away leaves the load to the rest

    def _landed(self, name: str, flight: asyncio.Future) -> None:
        self._flights.pop(name, None)
        if not flight.cancelled():
            flight.exception()  # seen: a failure whose callers all went away is not "lost"

    async def _load_and_register(self, name: str) -> bool:
        try:
            spec = await self._load(name, join(self.path, name))
        except Exception as e:
            error: APIError = self._to_api_error(e)
            if error.status == 404:
                return False
            raise error from None
        await self._register(name, spec)
        return True


def for_replica(path: str | None, load: Load, reporter: Any) -> DynamicAdapters | None:
    """An LLMServer's: `load` is its own (which puts the adapter in its catalog), and the
    adapter is registered with the registry its `reporter` holds. A registry that is down
    does not fail the request: the replica's reports teach it the adapter later."""
    if not path:
        return None

    async def register(name: str, spec: dict) -> None:
        from deployments.ingress import ActorRegistry

        if reporter.registry is None:
            return
        try:
            await asyncio.wait_for(
                ActorRegistry(reporter.registry).register_adapter(name, spec), 10
            )
        except Exception as e:
            logger.warning("raylora: registering %r with the registry failed: %s", name, e)

    def as_api_error(e: BaseException) -> APIError:
        return e if isinstance(e, APIError) else APIError(500, f"{type(e).__name__}: {e}")

    return DynamicAdapters(path, load, register, as_api_error)
