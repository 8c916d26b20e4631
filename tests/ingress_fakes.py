"""Fakes for the OpenAI HTTP layer's tests without Ray (tests/test_ingress_*.py): an LLM
backend that streams fixed words as ReplicaOutputs, and an in-memory registry. What the
engine really generates is tested through the real app (tests/test_serve_app.py)."""

from __future__ import annotations

import asyncio
import json

from deployments.protocol import (
    APIError,
    CompletionDelta,
    GenerateRequest,
    ReplicaOutput,
    TokenLogprob,
)

BASE = "tiny-base"
WORDS = ["Hello", " there", ",", " friend", "."]
PROMPT_TOKENS = ["Say", " hi"]  # what every prompt tokenizes to here


class FakeLLM:
    """Streams WORDS (one token each) as ReplicaOutput deltas; records what it got."""

    def __init__(self) -> None:
        self.requests: list[tuple[GenerateRequest, str]] = []
        self.raise_on_call: BaseException | None = None
        self.closed_early = False
        self.loaded: list[tuple[str, str]] = []

    def _outputs(self, request: GenerateRequest) -> list[ReplicaOutput]:
        spec = request.sampling
        max_tokens = spec.max_tokens or request.default_max_tokens or len(WORDS)
        words = WORDS[:max_tokens]
        items = []
        for k, w in enumerate(words):
            last = k == len(words) - 1
            reason = ("stop" if len(words) == len(WORDS) else "length") if last else None
            logprobs = None
            if spec.logprobs is not None:
                logprobs = [TokenLogprob(w, -0.5, {w: -0.5, "x": -1.5})]
            outs = [CompletionDelta(i, w, [10 + k], logprobs, reason, None) for i in range(spec.n)]
            # the replica found the first prompt token in its prefix cache
            items.append(
                ReplicaOutput(
                    request.request_id, len(PROMPT_TOKENS), outs, last, num_cached_tokens=1
                )
            )
        first = items[0]
        if request.echo:
            first.prompt = request.prompt or "".join(PROMPT_TOKENS)
        if spec.prompt_logprobs is not None:
            first.prompt_logprobs = [TokenLogprob(PROMPT_TOKENS[0], None)] + [
                TokenLogprob(t, -2.0, {t: -2.0}) for t in PROMPT_TOKENS[1:]
            ]
        return items

    async def stream(self, request: GenerateRequest, adapter: str):
        self.requests.append((request, adapter))
        if self.raise_on_call is not None:
            raise self.raise_on_call
        done = False
        try:
            for item in self._outputs(request):
                await asyncio.sleep(0)
                yield item
            done = True
        finally:
            self.closed_early = not done

    async def complete(self, request: GenerateRequest, adapter: str) -> ReplicaOutput:
        self.requests.append((request, adapter))
        if self.raise_on_call is not None:
            raise self.raise_on_call
        items = self._outputs(request)
        final = items[-1]
        final.prompt, final.prompt_logprobs = items[0].prompt, items[0].prompt_logprobs
        for o in final.outputs:
            o.text = "".join(WORDS[: len(items)])
            o.token_ids = list(range(len(items)))
            if o.logprobs is not None:
                o.logprobs = [lp for item in items for lp in item.outputs[o.index].logprobs]
        return final

    async def load_adapter(self, name: str, path: str) -> dict:
        if "missing" in path:
            raise APIError(404, f"folder {path} does not exist", code="model_not_found")
        if "broken" in path:
            raise APIError(400, "adapter_config.json is not JSON")
        self.loaded.append((name, path))
        return {"source": path, "rank": 4, "target_modules": ["q_proj"], "base_model": BASE}

    async def model_info(self) -> dict:
        return {"model_name": BASE}


class FakeRegistry:
    def __init__(self, adapters: dict[str, dict]) -> None:
        self.adapters = dict(adapters)

    async def list_adapters(self) -> dict[str, dict]:
        return dict(self.adapters)

    async def register_adapter(self, name: str, spec: dict) -> None:
        self.adapters[name] = spec

    async def unregister_adapter(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None


def assert_error(resp, status: int) -> dict:
    """An OpenAI error JSON with `status`; returns its "error" object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def sse_events(resp) -> list:
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]
