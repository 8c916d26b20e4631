"""build_openai_app: the FastAPI routes and OpenAI-shaped errors around an OpenAIServing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import metrics
from deployments.openai_serving import OpenAIServing, map_exception
from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    validate_as,
)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"Malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return validate_as(model, data)


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

    async def adapter_op(
        request: Request, op: str, model: type[BaseModel], call: Callable[[Any], Awaitable[str]]
    ) -> Response:
        serving.check_api_key(request.headers.get("authorization"))
        status = "error"
        try:
            message = await call(await _parse(request, model))
            status = "ok"
            return Response(message, media_type="text/plain")
        finally:
            metrics.ADAPTER_OPS.inc(tags={"op": op, "status": status})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await adapter_op(request, "load", LoadLoRAAdapterRequest, serving.load_adapter)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await adapter_op(request, "unload", UnloadLoRAAdapterRequest, serving.unload_adapter)

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
