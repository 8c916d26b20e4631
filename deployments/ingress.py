"""The OpenAI-compatible HTTP ingress deployment (and the typed methods deployments.client calls).

Three layers, so the HTTP behaviour is tested without Ray:
- `OpenAIServing` (deployments/openai_serving.py): validation, model-name resolution, building
  responses and SSE chunks, adapter load/unload.
- `build_openai_app(serving)` (deployments/openai_app.py): the FastAPI routes and errors.
- `Ingress` (here): the Ray Serve deployment class (`__serve_build_asgi_app__`), with the
  LLMServer handle and the registry actor as OpenAIServing's backends.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI

from deployments.grpc_bind import bind_replica_grpc_to_node_ip
from deployments.openai_app import build_openai_app
from deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    validate_as,
)
from deployments.openai_serving import OpenAIServing
from deployments.protocol import APIError, GenerateRequest, ReplicaOutput

# A replica that dies mid-request (its node is lost, it is OOM-killed) fails the call with a
# RayActorError, which Serve's handle does not retry; one whose engine loop died answers 503
# engine_dead. Before anything reached the client the request is retried (the router drops,
# probes or routes around the dead replica), at most this many times. The router learns of a
# dead engine loop from the replica's routing stats (pushed every routing_stats_period_s, 2 s,
# through the controller), and until then prefers it (it fails fast, so its queue is the
# shortest): the retries span 0.5 + 1 + 2 + 4 = 7.5 s, over three push periods. With 3 (3.5 s)
# tests/test_faults.py once saw all four attempts go to the dead replica and a 503 reach the
# client while the other replica was healthy.
MAX_REPLICA_RETRIES = 4
REPLICA_RETRY_BACKOFF_S = 0.5  # doubled after each retry


def _replica_died(exc: BaseException) -> bool:
    """The replica is gone (RayActorError) or its engine loop died (an engine_dead 503 until
    Serve replaces it): another replica can take the request."""
    from ray.exceptions import RayActorError

    cause = getattr(exc, "cause", exc)
    return isinstance(exc, RayActorError) or (
        isinstance(cause, APIError) and cause.code == "engine_dead"
    )


def _own_request_context(request_id: str) -> None:
    """Give the handle calls made from here on (in this task) their own Serve request ids.

    Ray Serve 2.60 keys a router's pending requests by the caller's internal request id,
    which every handle call made while serving one HTTP request inherits: of two concurrent
    calls (the prompts of a batched completion) the second is taken for a retry of the first
    and is never routed. Each replica call is a request of its own, so it gets its own ids
    (the engine request id, which also shows in Serve's logs).
    """
    try:
        from ray.serve.context import _set_request_context
    except ImportError:  # Serve's private API moved: one prompt per request still works
        return
    _set_request_context(request_id=request_id, _internal_request_id=uuid.uuid4().hex)


class ServeLLMBackend:
    """LLMBackend over a DeploymentHandle to LLMServer; the adapter is the multiplexed id.

    A request whose replica dies before the first output (non-streamed: before the result)
    is retried up to MAX_REPLICA_RETRIES times; a stream that already yielded is not.
    """

    def __init__(self, handle) -> None:
        self._handle = handle

    async def stream(self, request: GenerateRequest, adapter: str) -> AsyncIterator[ReplicaOutput]:
        handle = self._handle.options(stream=True, multiplexed_model_id=adapter)
        _own_request_context(request.request_id)
        for attempt in range(MAX_REPLICA_RETRIES + 1):
            gen = handle.generate.remote(request)
            done = started = False
            try:
                async for item in gen:
                    started = True
                    yield item
                done = True
                return
            except Exception as e:
                if started or attempt == MAX_REPLICA_RETRIES or not _replica_died(e):
                    raise
            finally:
                if not done:
                    gen.cancel()  # the replica's generator is cancelled -> the engine aborts
            await asyncio.sleep(REPLICA_RETRY_BACKOFF_S * 2**attempt)

    async def complete(self, request: GenerateRequest, adapter: str) -> ReplicaOutput:
        handle = self._handle.options(multiplexed_model_id=adapter)
        _own_request_context(request.request_id)
        for attempt in range(MAX_REPLICA_RETRIES):
            try:
                return await handle.complete.remote(request)
            except Exception as e:
                if not _replica_died(e):
                    raise
            await asyncio.sleep(REPLICA_RETRY_BACKOFF_S * 2**attempt)
        return await handle.complete.remote(request)

    async def load_adapter(self, name: str, path: str) -> dict:
        # Routed like a request for `name`: the replica that validates it keeps it cached.
        return await self._handle.options(multiplexed_model_id=name).load_adapter.remote(name, path)

    async def model_info(self) -> dict:
        return await self._handle.model_info.remote()


class ActorRegistry:
    """RegistryBackend over the AdapterRegistry actor (deployments/registry.py)."""

    def __init__(self, actor) -> None:
        self._actor = actor

    async def list_adapters(self) -> dict[str, dict]:
        return await self._actor.list_adapters.remote()

    async def recovering(self) -> bool:
        return await self._actor.recovering.remote()

    async def register_adapter(self, name: str, spec: dict) -> None:
        await self._actor.register_adapter.remote(
            name, spec["source"], spec["rank"], spec["target_modules"], spec["base_model"]
        )

    async def unregister_adapter(self, name: str) -> bool:
        return await self._actor.unregister_adapter.remote(name)


class Ingress:
    """The ingress deployment: HTTP routes from `build_openai_app`, plus typed methods for
    DeploymentHandle callers (deployments.client). Typed methods raise APIError."""

    async def __init__(
        self,
        llm_handle,
        served_model_name: str | None = None,
        api_key: str | None = None,
        adapter_roots: list[str] | None = None,
        registry_state_file: str | None = None,
        dynamic_lora_loading_path: str | None = None,
        shared_tier_bytes: int | None = None,  # the registry's budget, if this creates it
    ) -> None:
        from deployments.registry import get_or_create_registry

        bind_replica_grpc_to_node_ip()
        actor = await asyncio.to_thread(
            get_or_create_registry,
            state_file=registry_state_file,
            shared_tier_bytes=shared_tier_bytes,
        )
        registry = ActorRegistry(actor)
        self.serving = OpenAIServing(
            ServeLLMBackend(llm_handle),
            registry,
            served_model_name,
            api_key,
            adapter_roots,
            dynamic_lora_loading_path,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_app(self.serving)

    async def complete(self, request: CompletionRequest | dict) -> dict:
        return (await self.serving.complete(validate_as(CompletionRequest, request))).model_dump()

    async def chat(self, request: ChatCompletionRequest | dict) -> dict:
        return (
            await self.serving.complete(validate_as(ChatCompletionRequest, request))
        ).model_dump()

    async def complete_stream(self, request: CompletionRequest | dict) -> AsyncIterator[dict]:
        async for chunk in await self.serving.stream(validate_as(CompletionRequest, request)):
            yield chunk

    async def chat_stream(self, request: ChatCompletionRequest | dict) -> AsyncIterator[dict]:
        async for chunk in await self.serving.stream(validate_as(ChatCompletionRequest, request)):
            yield chunk

    async def models(self) -> dict:
        return (await self.serving.list_models()).model_dump()

    async def load_adapter(self, name: str, path: str) -> str:
        return await self.serving.load_adapter(
            LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        )

    async def unload_adapter(self, name: str) -> str:
        return await self.serving.unload_adapter(UnloadLoRAAdapterRequest(lora_name=name))
