"""OpenAIServing: the OpenAI-compatible API's logic, without HTTP or Ray.

Validation, model-name resolution, building responses and SSE chunks, adapter load/unload.
It talks to an `LLMBackend` (the LLMServer deployment) and a `RegistryBackend` (the
AdapterRegistry actor) given to it; deployments/openai_app.py puts HTTP routes around it and
deployments/ingress.py is the Ray Serve deployment that wires both.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel

from deployments import metrics
from deployments.dynamic_adapters import DynamicAdapters
from deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from deployments.protocol import APIError, GenerateRequest, ReplicaOutput
from deployments.replica_io import check_adapter_name
from deployments.responses import ChunkBuilder, build_chat_response, build_completion_response
from deployments.single_flight import SingleFlight
from deployments.streams import gather_cancelling, merge_streams
from engine.remote import is_url

CATALOG_TTL_S = 2.0
RECOVERY_WAIT_S = 30.0  # longest a request waits on a restarted registry for its adapter
RECOVERY_POLL_S = 0.5


class LLMBackend(Protocol):
    """What the ingress needs from the engine replicas. `adapter` "" = the base model."""

    def stream(self, request: GenerateRequest, adapter: str) -> AsyncIterator[ReplicaOutput]: ...
    async def complete(self, request: GenerateRequest, adapter: str) -> ReplicaOutput: ...
    async def load_adapter(self, name: str, path: str) -> dict: ...
    async def model_info(self) -> dict: ...


class RegistryBackend(Protocol):
    async def list_adapters(self) -> dict[str, dict]: ...
    async def register_adapter(self, name: str, spec: dict) -> None: ...
    async def unregister_adapter(self, name: str) -> bool: ...
    async def recovering(self) -> bool: ...  # restarted, catalog not yet rebuilt by reports


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


def _requested_adapter(model: str, base: str | None) -> str:
    """The adapter name `model` asks for: what follows `<base>:` (Ray Serve LLM), else
    `model` itself (vLLM)."""
    prefix, sep, adapter = model.partition(":")
    return adapter if sep and prefix == base else model


def _adapter_named(model: str, base: str | None, catalog: dict[str, dict]) -> str | None:
    """The catalog's adapter that `model` names, as itself or as `<base>:<adapter>`; None if
    neither."""
    if model in catalog:
        return model
    name = _requested_adapter(model, base)
    return name if name in catalog else None


class OpenAIServing:
    def __init__(
        self,
        llm: LLMBackend,
        registry: RegistryBackend | None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        adapter_roots: list[str] | None = None,
        dynamic_lora_loading_path: str | None = None,
    ) -> None:
        self.llm = llm
        self.registry = registry
        self.api_key = api_key or None
        # None: load_lora_adapter may load from anywhere (vLLM's behaviour). Folders are
        # compared resolved (symlinks, `..`), object-storage URLs by prefix.
        roots = adapter_roots or []
        self.adapter_roots = (
            None
            if adapter_roots is None
            else [Path(r).expanduser().resolve() for r in roots if not is_url(r)]
        )
        self.adapter_url_roots = [r.rstrip("/") + "/" for r in roots if is_url(r)]
        self.dynamic = None
        if dynamic_lora_loading_path:
            self.dynamic = DynamicAdapters(
                dynamic_lora_loading_path, llm.load_adapter, self._register, map_exception
            )
        self._base_name = served_model_name
        self._catalog: dict[str, dict] = {}
        self._catalog_time = float("-inf")
        self._listing = SingleFlight(self._list_catalog)  # callers at once share a listing
        self._recovering = False  # the registry's last answer to `recovering`
        self._recovering_flight = SingleFlight(self._ask_recovering)

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

    def model_label(self, model: object) -> str:
        """`model` as a metrics label: a name this app serves (the base model, an adapter in the
        catalog, `<base>:<adapter>`) as it is, anything else "unknown": a client's made-up
        names must not grow the ingress's time series without bound."""
        if not isinstance(model, str):
            return "unknown"
        base = self._base_name
        served = model == base or _adapter_named(model, base, self._catalog) is not None
        return model if served else "unknown"

    async def catalog(self, refresh: bool = False) -> dict[str, dict]:
        """The registry's adapters, at most CATALOG_TTL_S old; `refresh`: as listed by a call
        that began after this one. Callers at once share one listing: a flood of requests
        naming no adapter (each refreshes before its 404) costs the registry a listing or
        three, not one each."""
        if self.registry is None:
            return self._catalog
        if refresh or time.monotonic() - self._catalog_time > CATALOG_TTL_S:
            await self._listing.run(fresh=refresh)
        return self._catalog

    async def _list_catalog(self) -> None:
        try:
            self._catalog = await asyncio.wait_for(self.registry.list_adapters(), 5.0)
            self._catalog_time = time.monotonic()
        except Exception:  # keep serving with the last catalog we had
            pass

    async def resolve_model(self, model: str) -> str:
        """`model` -> the adapter name, or "" for the base model; APIError 404 if unknown.

        Accepts the base model name, an adapter name (vLLM) and `<base>:<adapter>` (Ray Serve
        LLM).
        """
        base = await self.base_model()
        if model == base:
            return ""
        refresh, deadline = False, time.monotonic() + RECOVERY_WAIT_S
        while True:
            adapter = _adapter_named(model, base, await self.catalog(refresh=refresh))
            if adapter is not None:
                return adapter
            if refresh:  # a fresh listing without it: 404, unless the registry is recovering
                if time.monotonic() > deadline or not await self._registry_recovering():
                    break
                await asyncio.sleep(RECOVERY_POLL_S)
            refresh = True
        name = _requested_adapter(model, base)
        if self.dynamic is not None and await self.dynamic.serve(name):
            return name  # loaded from dynamic_lora_loading_path and registered
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )

    async def _registry_recovering(self) -> bool:
        """Whether the registry restarted and has not heard from a replica yet: its empty or
        partial catalog then says nothing about what the replicas serve (see
        AdapterRegistry.recovering), so a request waits for the first report, not a 404."""
        if getattr(self.registry, "recovering", None) is None:
            return False
        await self._recovering_flight.run()  # requests at once share one question
        return self._recovering

    async def _ask_recovering(self) -> None:
        try:
            self._recovering = bool(await asyncio.wait_for(self.registry.recovering(), 5.0))
        except Exception:
            self._recovering = False

    async def list_models(self) -> ModelList:
        base = await self.base_model()
        cards = [ModelCard(id=base, root=base)]
        for name, spec in sorted((await self.catalog(refresh=True)).items()):
            cards.append(ModelCard(id=name, root=spec.get("source"), parent=base))
        return ModelList(data=cards)

    # ------------------------------------------------------------------ generation

    async def _prepare(
        self, req: CompletionRequest | ChatCompletionRequest
    ) -> tuple[list[GenerateRequest], str, str]:
        """(one GenerateRequest per prompt, the adapter, the request id). The request id is
        minted here, once; a batch's prompts get `<id>-<prompt index>` (vLLM's scheme)."""
        adapter = await self.resolve_model(req.model)
        spec = req.sampling_spec()
        request_id = uuid.uuid4().hex
        default = req.default_max_tokens()
        if isinstance(req, ChatCompletionRequest):
            gen = GenerateRequest(
                request_id, spec, messages=req.chat_messages(), default_max_tokens=default
            )
            return [gen], adapter, request_id
        prompts = req.prompts()
        gens = [
            GenerateRequest(
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                spec,
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=None if isinstance(p, str) else list(p),
                default_max_tokens=default,
                echo=req.echo,
            )
            for i, p in enumerate(prompts)
        ]
        return gens, adapter, request_id

    @staticmethod
    def _response_id(req: CompletionRequest | ChatCompletionRequest, request_id: str) -> str:
        return f"{'chatcmpl' if isinstance(req, ChatCompletionRequest) else 'cmpl'}-{request_id}"

    async def complete(self, req: CompletionRequest | ChatCompletionRequest) -> BaseModel:
        """A non-streamed completion (of every prompt of a batch) or chat completion."""
        gens, adapter, request_id = await self._prepare(req)
        try:
            outs = await gather_cancelling([self.llm.complete(g, adapter) for g in gens])
        except Exception as e:
            raise map_exception(e) from None
        metrics.TOKENS_GENERATED.inc(sum(o.num_new_tokens for o in outs), {"model": req.model})
        response_id = self._response_id(req, request_id)
        if isinstance(req, ChatCompletionRequest):
            return build_chat_response(req, outs[0], response_id)
        return build_completion_response(req, outs, response_id)

    async def stream(self, req: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[dict]:
        """Chunk dicts (OpenAI's *.chunk objects). Errors before the first chunk raise
        APIError; later ones end the stream with an {"error": ...} chunk."""
        gens, adapter, request_id = await self._prepare(req)
        builder = ChunkBuilder(req, self._response_id(req, request_id))
        start = time.perf_counter()
        outputs = merge_streams([self.llm.stream(g, adapter) for g in gens])
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
                prompt_index, out = item
                if out.num_new_tokens and first_token_time is None:
                    first_token_time = time.perf_counter()
                    metrics.INGRESS_TTFT.observe(first_token_time - start, tags)
                num_tokens += out.num_new_tokens
                for chunk in builder.chunks(out, prompt_index):
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
            await outputs.aclose()  # a client that went away: cancels the replicas' requests

    # ------------------------------------------------------------------ adapters

    def check_adapter_path(self, lora_path: str) -> None:
        """403 unless lora_path resolves (symlinks, `..`) inside an adapter root, or is a URL
        under a URL root with no `..` segment."""
        if self.adapter_roots is None:
            return
        if is_url(lora_path):
            allowed = ".." not in lora_path.split("/") and any(
                (lora_path.rstrip("/") + "/").startswith(root) for root in self.adapter_url_roots
            )
        else:
            resolved = Path(lora_path).expanduser().resolve()
            allowed = any(
                resolved == root or resolved.is_relative_to(root) for root in self.adapter_roots
            )
        if not allowed:
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
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from None
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
        await self._register(name, spec)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _register(self, name: str, spec: dict) -> None:
        if self.registry is not None:
            await self.registry.register_adapter(name, spec)
        self._catalog[name] = spec

    async def unload_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        # The registry is the catalog: its durable unload (a tombstone) is what keeps the
        # adapter unloaded across restarts, so without it there is nothing to unload.
        if self.registry is not None:
            removed = await self.registry.unregister_adapter(req.lora_name)
        else:
            removed = req.lora_name in self._catalog
        self._catalog.pop(req.lora_name, None)
        if not removed:
            raise APIError(
                404,
                f"The lora adapter '{req.lora_name}' cannot be found.",
                param="lora_name",
                code="model_not_found",
            )
        # Replicas drop it from memory at their next catalog sync (report_interval_s).
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
