"""The OpenAI-compatible HTTP ingress (and the typed methods deployments.client calls).

Three layers, so the HTTP behaviour is tested without Ray:
- `OpenAIServing`: validation, model-name resolution, building responses and SSE chunks,
  adapter load/unload. Talks to an `LLMBackend` (the LLMServer deployment) and a registry
  (the AdapterRegistry actor) given to it.
- `build_openai_app(serving)`: the FastAPI routes and OpenAI-shaped errors.
- `Ingress`: the Ray Serve deployment class (`serve.ingress()` + `__serve_build_asgi_app__`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import metrics
from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    validation_error_to_api,
)
from deployments.responses import ChunkBuilder, build_chat_response, build_completion_response

CATALOG_TTL_S = 2.0


class LLMBackend(Protocol):
    """What the ingress needs from the engine replicas. `adapter` "" = the base model."""

    def stream(self, request: dict, adapter: str) -> AsyncIterator[dict]: ...
    async def complete(self, request: dict, adapter: str) -> dict: ...
    async def load_adapter(self, name: str, path: str) -> dict: ...
    async def model_info(self) -> dict: ...


class RegistryBackend(Protocol):
    async def list_adapters(self) -> dict[str, dict]: ...
    async def register_adapter(self, name: str, spec: dict) -> None: ...
    async def unregister_adapter(self, name: str) -> bool: ...


def _unwrap(exc: BaseException) -> BaseException:
    """The original exception of a RayTaskError (which wraps what a replica raised)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def map_exception(exc: BaseException) -> APIError:
    """Any exception from a replica or the handle -> the APIError the client gets."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    exc = _unwrap(exc)
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
        return APIError(503, f"The server is overloaded; retry later. ({exc})", code="overloaded")
    return APIError(500, f"Internal error: {type(exc).__name__}: {exc}")


class OpenAIServing:
    def __init__(
        self,
        llm: LLMBackend,
        registry: RegistryBackend | None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        adapter_roots: list[str] | None = None,
    ) -> None:
        self.llm = llm
        self.registry = registry
        self.api_key = api_key or None
        # None: load_lora_adapter may load from anywhere (vLLM's behaviour).
        self.adapter_roots = (
            None
            if adapter_roots is None
            else [Path(r).expanduser().resolve() for r in adapter_roots]
        )
        self._base_name = served_model_name
        self._catalog: dict[str, dict] = {}
        self._catalog_time = float("-inf")

    # ------------------------------------------------------------------ auth + names

    def check_api_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or token.strip() != self.api_key:
            raise APIError(
                401, "Invalid or missing API key.", "authentication_error", code="invalid_api_key"
            )

    async def base_model(self) -> str:
        if self._base_name is None:
            self._base_name = (await self.llm.model_info())["model_name"]
        return self._base_name

    async def catalog(self, refresh: bool = False) -> dict[str, dict]:
        if self.registry is None:
            return self._catalog
        if refresh or time.monotonic() - self._catalog_time > CATALOG_TTL_S:
            try:
                self._catalog = await asyncio.wait_for(self.registry.list_adapters(), 5.0)
                self._catalog_time = time.monotonic()
            except Exception:  # keep serving with the last catalog we had
                pass
        return self._catalog

    async def resolve_model(self, model: str) -> str:
        """`model` -> the adapter name, or "" for the base model; APIError 404 if unknown.

        Accepts the base model name, an adapter name (vLLM) and `<base>:<adapter>` (Ray Serve
        LLM).
        """
        base = await self.base_model()
        if model == base:
            return ""
        for refresh in (False, True):
            catalog = await self.catalog(refresh=refresh)
            if model in catalog:
                return model
            prefix, sep, adapter = model.partition(":")
            if sep and prefix == base and adapter in catalog:
                return adapter
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )

    async def list_models(self) -> ModelList:
        base = await self.base_model()
        cards = [ModelCard(id=base, root=base)]
        for name, spec in sorted((await self.catalog(refresh=True)).items()):
            cards.append(ModelCard(id=name, root=spec.get("source"), parent=base))
        return ModelList(data=cards)

    # ------------------------------------------------------------------ generation

    async def _prepare(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[dict, str]:
        adapter = await self.resolve_model(req.model)
        engine_request: dict[str, Any] = {
            "sampling_params": req.sampling_params(),
            "request_id": uuid.uuid4().hex,
        }
        if isinstance(req, ChatCompletionRequest):
            engine_request["messages"] = req.chat_messages()
        else:
            prompt = req.single_prompt()
            key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
            engine_request[key] = prompt
        if adapter:
            engine_request["adapter"] = adapter
        return engine_request, adapter

    async def complete(self, req: CompletionRequest | ChatCompletionRequest) -> BaseModel:
        """A non-streamed completion or chat completion."""
        engine_request, adapter = await self._prepare(req)
        try:
            out = await self.llm.complete(engine_request, adapter)
        except Exception as e:
            raise map_exception(e) from None
        tags = {"model": req.model}
        metrics.TOKENS_GENERATED.inc(sum(len(o["token_ids"]) for o in out["outputs"]), tags)
        if isinstance(req, ChatCompletionRequest):
            return build_chat_response(req, out)
        return build_completion_response(req, out)

    async def stream(self, req: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[dict]:
        """Chunk dicts (OpenAI's *.chunk objects). Errors before the first chunk raise
        APIError; later ones end the stream with an {"error": ...} chunk."""
        engine_request, adapter = await self._prepare(req)
        builder = ChunkBuilder(req)
        start = time.perf_counter()
        outputs = self.llm.stream(engine_request, adapter)
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException as e:
            await outputs.aclose()
            if isinstance(e, Exception):
                raise map_exception(e) from None
            raise
        return self._stream_rest(builder, outputs, first, {"model": req.model}, start)

    async def _stream_rest(self, builder, outputs, first, tags, start) -> AsyncIterator[dict]:
        first_token_time = None
        num_tokens = 0
        try:
            item = first
            while item is not None:
                new_tokens = sum(len(o["token_ids"]) for o in item["outputs"])
                if new_tokens and first_token_time is None:
                    first_token_time = time.perf_counter()
                    metrics.INGRESS_TTFT.observe(first_token_time - start, tags)
                num_tokens += new_tokens
                for chunk in builder.chunks(item):
                    yield chunk
                try:
                    item = await outputs.__anext__()
                except StopAsyncIteration:
                    item = None
            usage = builder.usage_chunk()
            if usage is not None:
                yield usage
            if first_token_time is not None and num_tokens > 1:
                tpot = (time.perf_counter() - first_token_time) / (num_tokens - 1)
                metrics.INGRESS_TPOT.observe(tpot, tags)
        except Exception as e:
            yield map_exception(e).to_dict()
        finally:
            metrics.TOKENS_GENERATED.inc(num_tokens, tags)
            await outputs.aclose()  # a client that went away: cancels the replica's request

    # ------------------------------------------------------------------ adapters

    def check_adapter_path(self, lora_path: str) -> None:
        """403 unless lora_path resolves (symlinks, `..`) inside an adapter root."""
        if self.adapter_roots is None:
            return
        resolved = Path(lora_path).expanduser().resolve()
        if not any(
            resolved == root or resolved.is_relative_to(root) for root in self.adapter_roots
        ):
            raise APIError(
                403,
                f"lora_path {lora_path!r} is outside the allowed adapter roots.",
                "permission_error",
                "lora_path",
                "forbidden_path",
            )

    async def load_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        base = await self.base_model()
        name = req.lora_name
        if name == base or name.startswith(f"{base}:"):
            raise APIError(
                400, f"lora_name {name!r} clashes with the base model name", param="lora_name"
            )
        self.check_adapter_path(req.lora_path)
        existing = (await self.catalog(refresh=True)).get(name)
        if existing is not None and existing.get("source") != req.lora_path:
            raise APIError(
                400,
                f"The lora adapter '{name}' has already been loaded.",
                param="lora_name",
                code="adapter_exists",
            )
        try:
            spec = await self.llm.load_adapter(name, req.lora_path)
        except Exception as e:
            raise map_exception(e) from None
        if self.registry is not None:
            await self.registry.register_adapter(name, spec)
        self._catalog[name] = spec
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        removed = self.registry is not None and await self.registry.unregister_adapter(
            req.lora_name
        )
        if not removed and self._catalog.pop(req.lora_name, None) is None:
            raise APIError(
                404,
                f"The lora adapter '{req.lora_name}' cannot be found.",
                param="lora_name",
                code="model_not_found",
            )
        self._catalog.pop(req.lora_name, None)
        # Replicas drop it from memory at their next catalog sync (report_interval_s).
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


# ---------------------------------------------------------------------- HTTP


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"Malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e) from None


def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async def gen() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return gen()


def build_openai_app(serving: OpenAIServing) -> FastAPI:
    """The FastAPI app of the OpenAI surface around `serving` (no Ray in here)."""
    app = FastAPI(title="raylora", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc)).to_dict(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.to_dict(), status_code=exc.status_code)

    async def generate(request: Request, model_cls: type, endpoint: str) -> Response:
        start = time.perf_counter()
        model_name, status = "", 500
        try:
            serving.check_api_key(request.headers.get("authorization"))
            req = await _parse(request, model_cls)
            model_name = req.model
            if req.stream:
                chunks = await serving.stream(req)
                status = 200
                return StreamingResponse(_sse(chunks), media_type="text/event-stream")
            response = await serving.complete(req)
            status = 200
            return JSONResponse(response.model_dump())
        except APIError as e:
            status = e.status
            raise
        except Exception as e:
            err = map_exception(e)
            status = err.status
            raise err from None
        finally:
            tags = {"model": model_name, "endpoint": endpoint}
            metrics.HTTP_REQUESTS.inc(tags={**tags, "status": str(status)})
            metrics.HTTP_LATENCY.observe(time.perf_counter() - start, tags)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        serving.check_api_key(request.headers.get("authorization"))
        return JSONResponse((await serving.list_models()).model_dump())

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        serving.check_api_key(request.headers.get("authorization"))
        status = "error"
        try:
            message = await serving.load_adapter(await _parse(request, LoadLoRAAdapterRequest))
            status = "ok"
            return Response(message, media_type="text/plain")
        finally:
            metrics.ADAPTER_OPS.inc(tags={"op": "load", "status": status})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        serving.check_api_key(request.headers.get("authorization"))
        status = "error"
        try:
            message = await serving.unload_adapter(await _parse(request, UnloadLoRAAdapterRequest))
            status = "ok"
            return Response(message, media_type="text/plain")
        finally:
            metrics.ADAPTER_OPS.inc(tags={"op": "unload", "status": status})

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(serving.base_model(), 10.0)
        except Exception as e:
            raise APIError(503, f"No engine replica answered: {e}", code="unavailable") from None
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render_ingress_metrics()
        return Response(body, media_type=content_type)

    return app


# ---------------------------------------------------------------------- Ray Serve


# A replica that dies mid-request (its node is lost, it is OOM-killed) fails the call with a
# RayActorError, which Serve's handle does not retry. Before anything reached the client the
# request is retried (the router drops or probes the dead replica), at most this many times.
MAX_REPLICA_RETRIES = 3
REPLICA_RETRY_BACKOFF_S = 0.5  # doubled after each retry


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


class ServeLLMBackend:
    """LLMBackend over a DeploymentHandle to LLMServer; the adapter is the multiplexed id.

    A request whose replica dies before the first output (non-streamed: before the result)
    is retried up to MAX_REPLICA_RETRIES times; a stream that already yielded is not.
    """

    def __init__(self, handle) -> None:
        self._handle = handle

    async def stream(self, request: dict, adapter: str) -> AsyncIterator[dict]:
        handle = self._handle.options(stream=True, multiplexed_model_id=adapter)
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

    async def complete(self, request: dict, adapter: str) -> dict:
        handle = self._handle.options(multiplexed_model_id=adapter)
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

    async def register_adapter(self, name: str, spec: dict) -> None:
        await self._actor.register_adapter.remote(
            name, spec["source"], spec["rank"], spec["target_modules"], spec["base_model"]
        )

    async def unregister_adapter(self, name: str) -> bool:
        return await self._actor.unregister_adapter.remote(name)


def _as(model: type[BaseModel], value: Any) -> Any:
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_error_to_api(e) from None


class Ingress:
    """The ingress deployment: HTTP routes from `build_openai_app`, plus typed methods for
    DeploymentHandle callers (deployments.client). Typed methods raise APIError."""

    async def __init__(
        self,
        llm_handle,
        served_model_name: str | None = None,
        api_key: str | None = None,
        adapter_roots: list[str] | None = None,
    ) -> None:
        from deployments.registry import get_or_create_registry

        registry = ActorRegistry(await asyncio.to_thread(get_or_create_registry))
        self.serving = OpenAIServing(
            ServeLLMBackend(llm_handle), registry, served_model_name, api_key, adapter_roots
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_app(self.serving)

    async def complete(self, request: CompletionRequest | dict) -> dict:
        return (await self.serving.complete(_as(CompletionRequest, request))).model_dump()

    async def chat(self, request: ChatCompletionRequest | dict) -> dict:
        return (await self.serving.complete(_as(ChatCompletionRequest, request))).model_dump()

    async def complete_stream(self, request: CompletionRequest | dict) -> AsyncIterator[dict]:
        async for chunk in await self.serving.stream(_as(CompletionRequest, request)):
            yield chunk

    async def chat_stream(self, request: ChatCompletionRequest | dict) -> AsyncIterator[dict]:
        async for chunk in await self.serving.stream(_as(ChatCompletionRequest, request)):
            yield chunk

    async def models(self) -> dict:
        return (await self.serving.list_models()).model_dump()

    async def load_adapter(self, name: str, path: str) -> str:
        return await self.serving.load_adapter(
            LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        )

    async def unload_adapter(self, name: str) -> str:
        return await self.serving.unload_adapter(UnloadLoRAAdapterRequest(lora_name=name))
