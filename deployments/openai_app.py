"""build_openai_app: the FastAPI routes and OpenAI-shaped errors around an OpenAIServing."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import metrics
from deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    validate_as,
)
from deployments.openai_serving import OpenAIServing, map_exception
from deployments.protocol import APIError

MAX_BODY_BYTES = 8 * 2**20  # a 4k-token prompt is ~20 KB; 256 batched ones stay well under
MAX_JSON_DEPTH = 64  # nesting of arrays and objects (a chat request needs 4)
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays/objects in a JSON text, without parsing it (json.loads
    recurses, so a deep enough body ends in RecursionError). Vectorised: a wide 8 MB body
    takes milliseconds."""
    brackets = _STRINGS.sub(b"", body).translate(None, delete=_NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")  # Python's json accepts NaN and Infinity


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, or APIError 413 as soon as it is known to exceed `limit` bytes."""
    too_big = APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON (RFC 8259: no NaN/Infinity) nested at most max_depth deep; APIError 400."""
    # only a body with more brackets than the cap can be nested deeper than it
    if body.count(b"[") + body.count(b"{") > max_depth and json_depth(body) > max_depth:
        raise APIError(
            400, f"The JSON body is nested deeper than {max_depth} levels.", code="invalid_json"
        )
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"Malformed JSON body: {e}", code="invalid_json") from None


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    return validate_as(model, parse_json(await read_body(request)))


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
            tags = {"model": serving.model_label(model_name), "endpoint": endpoint}
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
