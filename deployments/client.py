"""A typed Python API to a running raylora app, for other Ray jobs (no HTTP in between).

    import ray
    from deployments.client import RayLoRAClient

    ray.init(address="auto")                       # the cluster the app runs on
    client = RayLoRAClient(app_name="raylora")     # `serve run --name raylora ...`
    out = client.complete("Hello", adapter="caps", max_tokens=16, temperature=0)
    print(out["choices"][0]["text"])
    reply = client.chat([{"role": "user", "content": "Hi"}], adapter="signoff")
    for chunk in client.stream("Once upon a time", max_tokens=32):
        print(chunk["choices"][0]["text"], end="")

Results are the OpenAI JSON objects as dicts (the same as the HTTP API returns). Errors are
raised as `deployments.protocol.APIError` with the HTTP status the HTTP API would give
(404 unknown model, 400 invalid request, 503 overloaded).

The calls go to the ingress deployment's typed methods (`Ingress.complete`, `.chat`,
`.complete_stream`, `.chat_stream`, `.models`, `.load_adapter`, `.unload_adapter`) through
`serve.get_app_handle(app_name)`, so model-name resolution and validation are the HTTP
API's. To skip the ingress, call the LLMServer deployment directly:

    from deployments.protocol import GenerateRequest, SamplingSpec

    llm = serve.get_deployment_handle("LLMServer", app_name="raylora")
    request = GenerateRequest(uuid.uuid4().hex, SamplingSpec(max_tokens=16, temperature=0),
                              prompt="Hello")
    out = await llm.options(multiplexed_model_id="caps").complete.remote(request)
    # -> ReplicaOutput(request_id, num_prompt_tokens, outputs=[CompletionDelta(index, text,
    #    token_ids, ...)], finished, ...); .generate streams ReplicaOutputs of new tokens

Sync methods must not be called from inside an event loop (use the `a*` methods there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from deployments.protocol import ERROR_TYPES, APIError

DEFAULT_APP_NAME = "raylora"
_STATUS_OF_TYPE = {t: s for s, t in ERROR_TYPES.items()}


def _check(chunk: dict) -> dict:
    """A stream's error chunk ({"error": {...}}, sent after the first chunk) -> APIError."""
    if "error" in chunk:
        e = chunk["error"]
        status = _STATUS_OF_TYPE.get(e.get("type"), 500)
        raise APIError(status, e.get("message", ""), e.get("type"), e.get("param"), e.get("code"))
    return chunk


def _reraise(exc: BaseException) -> None:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, APIError):
        raise cause from None
    raise exc


class RayLoRAClient:
    """Handle-based client of a raylora app. `adapter=None` is the base model; otherwise an
    adapter name (or `<base>:<adapter>`). `**sampling` are OpenAI request fields
    (max_tokens, temperature, top_p, n, stop, seed, logprobs, top_k, ...)."""

    def __init__(self, app_name: str = DEFAULT_APP_NAME, base_model: str | None = None) -> None:
        from ray import serve

        self.app_name = app_name
        self._handle = serve.get_app_handle(app_name)
        self._base_model = base_model

    # ------------------------------------------------------------------ helpers

    def _model(self, adapter: str | None) -> str:
        if adapter:
            return adapter
        if self._base_model is None:
            self._base_model = self.models()["data"][0]["id"]
        return self._base_model

    async def _amodel(self, adapter: str | None) -> str:
        if adapter:
            return adapter
        if self._base_model is None:
            self._base_model = (await self.amodels())["data"][0]["id"]
        return self._base_model

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._handle, method).remote(*args).result()
        except Exception as e:
            _reraise(e)

    async def _acall(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle, method).remote(*args)
        except Exception as e:
            _reraise(e)

    # ------------------------------------------------------------------ sync

    def complete(self, prompt: str | list[int], adapter: str | None = None, **sampling) -> dict:
        """A text completion (OpenAI `text_completion` object)."""
        request = {"model": self._model(adapter), "prompt": prompt, **sampling}
        return self._call("complete", request)

    def chat(self, messages: list[dict], adapter: str | None = None, **sampling) -> dict:
        """A chat completion (OpenAI `chat.completion` object)."""
        request = {"model": self._model(adapter), "messages": messages, **sampling}
        return self._call("chat", request)

    def stream(
        self, prompt: str | list[int], adapter: str | None = None, **sampling
    ) -> Iterator[dict]:
        """Completion chunks (OpenAI `text_completion` chunk objects) as they are generated."""
        request = {"model": self._model(adapter), "prompt": prompt, "stream": True, **sampling}
        gen = self._handle.options(stream=True).complete_stream.remote(request)
        try:
            for chunk in gen:
                yield _check(chunk)
        except APIError:
            raise
        except Exception as e:
            _reraise(e)
        finally:
            gen.cancel()

    def models(self) -> dict:
        return self._call("models")

    def load_adapter(self, name: str, path: str) -> str:
        return self._call("load_adapter", name, path)

    def unload_adapter(self, name: str) -> str:
        return self._call("unload_adapter", name)

    # ------------------------------------------------------------------ async

    async def acomplete(
        self, prompt: str | list[int], adapter: str | None = None, **sampling
    ) -> dict:
        request = {"model": await self._amodel(adapter), "prompt": prompt, **sampling}
        return await self._acall("complete", request)

    async def achat(self, messages: list[dict], adapter: str | None = None, **sampling) -> dict:
        request = {"model": await self._amodel(adapter), "messages": messages, **sampling}
        return await self._acall("chat", request)

    async def astream(
        self, prompt: str | list[int], adapter: str | None = None, **sampling
    ) -> AsyncIterator[dict]:
        request = {
            "model": await self._amodel(adapter),
            "prompt": prompt,
            "stream": True,
            **sampling,
        }
        gen = self._handle.options(stream=True).complete_stream.remote(request)
        try:
            async for chunk in gen:
                yield _check(chunk)
        except APIError:
            raise
        except Exception as e:
            _reraise(e)
        finally:
            gen.cancel()

    async def amodels(self) -> dict:
        return await self._acall("models")
