"""What goes in and out of an LLMServer replica besides the engine itself: catalog entries for
adapter folders, engine outputs as ReplicaOutputs (deployments/protocol.py; what
deployments/responses.py turns into OpenAI responses), engine errors as APIError, and the
replica-side request and autoscaling metrics.

Engine imports stay inside the functions: the ingress imports this package without torch.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deployments import metrics
from deployments.protocol import APIError, CompletionDelta, ReplicaOutput, TokenLogprob
from deployments.routing_policy import PREFIX_KEY_MARK, is_prefix_key


def check_adapter_name(name: str) -> None:
    """ValueError unless `name` may name an adapter: not empty, and not beginning with the
    mark of a base request's prompt-prefix key (routing_policy.PREFIX_KEY_MARK), which the
    router would take it for: it would route the adapter's requests by hash, blind to where
    the adapter is held, and leave it out of placement."""
    if not name:
        raise ValueError("adapter name must be non-empty")
    if is_prefix_key(name):
        raise ValueError(
            f"adapter name {name!r} may not begin with {PREFIX_KEY_MARK!r}: the router keys "
            "base requests' prompt prefixes so"
        )


def adapter_entry(name: str, path: str, base_model: str) -> dict[str, Any]:
    """A catalog entry (the registry's spec) for a PEFT folder, read from adapter_config.json.

    A Hub repo id (not a local folder) gets rank 1 and no target modules until a replica
    loads it; the engine validates every adapter when it loads it anyway.
    """
    folder = Path(path).expanduser()
    rank, targets = 1, []
    cfg_file = folder / "adapter_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        rank = int(cfg.get("r", 1))
        t = cfg.get("target_modules") or []
        targets = [t] if isinstance(t, str) else list(t)
    elif folder.is_absolute() or path.startswith((".", "~")):
        raise FileNotFoundError(f"adapter {name!r}: {path} has no adapter_config.json")
    return {"source": str(path), "rank": rank, "target_modules": targets, "base_model": base_model}


def initial_adapters(adapters: dict[str, str] | None, demo_adapters: bool) -> dict[str, str]:
    """name -> path of the adapters a replica starts with: `adapters`, plus the demo adapters
    found on disk (engine.lora.demo) when demo_adapters is set."""
    found = dict(adapters or {})
    for name in found:
        check_adapter_name(name)
    if demo_adapters:
        from engine.lora.demo import DEMO_ADAPTERS, demo_adapter_dir, is_demo_adapter_present

        for name in DEMO_ADAPTERS:
            if name not in found and is_demo_adapter_present(name):
                found[name] = str(demo_adapter_dir(name))
    return found


class LoRAIds:
    """name -> the lora_int_id of its LoRARequests on one replica: held while the name is in
    the catalog or a load of it is under way, dropped when a load fails or the name is
    unloaded (so names tried and refused do not pile up); an id is never given twice."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._next = itertools.count(1)

    def get(self, name: str) -> int:
        if name not in self._ids:
            self._ids[name] = next(self._next)
        return self._ids[name]

    def forget(self, name: str) -> None:
        self._ids.pop(name, None)

    def __len__(self) -> int:
        return len(self._ids)


def to_api_error(exc: BaseException) -> BaseException:
    """Engine exception -> APIError with its HTTP status; anything else is returned as is."""
    from engine.errors import (
        ContextLengthError,
        EngineDeadError,
        InvalidRequestError,
        PromptTooLongError,
        RequestFailedError,
    )
    from engine.lora.errors import InvalidLoRAError, LoRAError, LoRANotFoundError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LoRANotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, (InvalidLoRAError, LoRAError)):
        return APIError(400, str(exc), param="model", code="invalid_adapter")
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"The engine failed this request: {exc}", code="engine_error")
    if isinstance(exc, EngineDeadError):  # check_health has told Serve to replace us
        return APIError(503, f"This replica's engine stopped: {exc}", code="engine_dead")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc))
    return exc


class RequestMetrics:
    """One request's replica-side metrics: TTFT, time per output token, outcome."""

    def __init__(self, adapter: str) -> None:
        # an adapter is named once the replica has found it (`served`): a caller's made-up
        # ids must not add time series without bound
        self.tags = {"adapter": "unknown" if adapter else "<base>"}
        self.start = time.perf_counter()
        self.first_token_time: float | None = None
        self.num_tokens = 0

    def served(self, adapter: str) -> None:
        """The request's adapter is in this replica's catalog: label its metrics with it."""
        self.tags = {"adapter": adapter}

    def on_output(self, out) -> None:
        self.num_tokens = sum(len(o.token_ids) for o in out.outputs)
        if self.first_token_time is None and self.num_tokens:
            self.first_token_time = time.perf_counter()
            metrics.TTFT.observe(self.first_token_time - self.start, tags=self.tags)

    def on_finish(self, status: str) -> None:
        if status == "ok" and self.first_token_time is not None and self.num_tokens > 1:
            tpot = (time.perf_counter() - self.first_token_time) / (self.num_tokens - 1)
            metrics.TPOT.observe(tpot, tags=self.tags)
        metrics.REPLICA_REQUESTS.inc(tags={**self.tags, "status": status})


def to_replica_output(
    out,
    deltas: list[tuple[Any, int, int, int | None]],
    first: bool,
    prompt: str | None,
    token_text: Callable[[int], str],
) -> ReplicaOutput:
    """An engine RequestOutput as a ReplicaOutput. deltas: (CompletionOutput, chars sent,
    tokens sent, text end or None for all of it) per completion that has news."""
    prompt_logprobs = None
    if first and getattr(out, "prompt_logprobs", None) is not None:
        prompt_logprobs = [
            prompt_entry(tid, top, token_text)
            for tid, top in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
        ]
    return ReplicaOutput(
        request_id=out.request_id,
        num_prompt_tokens=len(out.prompt_token_ids),
        outputs=[completion_delta(o, c, t, end, token_text) for o, c, t, end in deltas],
        finished=out.finished,
        prompt=prompt,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=int(getattr(out, "num_cached_tokens", 0) or 0),
    )


def completion_delta(
    o, num_chars: int, num_tokens: int, end: int | None, token_text: Callable[[int], str]
) -> CompletionDelta:
    """One completion from character num_chars (to end) and token num_tokens on: the new part
    of a stream, or all of it from (0, 0)."""
    new_ids = list(o.token_ids[num_tokens:])
    logprobs = None
    if o.logprobs is not None:
        logprobs = [
            token_entry(tid, top, token_text)
            for tid, top in zip(new_ids, o.logprobs[num_tokens:], strict=False)
        ]
    return CompletionDelta(
        index=o.index,
        text=o.text[num_chars:end],
        token_ids=new_ids,
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


def token_entry(
    token_id: int, top: dict[int, float], token_text: Callable[[int], str]
) -> TokenLogprob:
    """One token's logprob and the top alternatives (which include the token itself)."""
    return TokenLogprob(
        token=token_text(token_id),
        logprob=float(top.get(token_id, float("-inf"))),
        top={token_text(t): float(lp) for t, lp in top.items()},
    )


def prompt_entry(
    token_id: int, top: dict[int, float] | None, token_text: Callable[[int], str]
) -> TokenLogprob:
    """A prompt token's entry; the first prompt token has none (nothing predicts it)."""
    if top is None:
        return TokenLogprob(token=token_text(token_id), logprob=None, top={})
    return token_entry(token_id, top, token_text)


class AutoscalingSampler:
    """The custom autoscaling metrics an LLMServer reports (`record_autoscaling_stats`, for
    cluster.autoscaling.AdapterAwarePolicy); rates are since the previous sample.

    num_waiting_for_slot counts in-flight requests whose adapter is not in a slot, but only
    while more distinct adapters are in flight than there are slots (otherwise an idle slot
    can be taken at the next step and nobody is blocked on slots).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # (time, requests received, slot activations) at the last sample
        self.last: tuple[float, int, int] = (clock(), 0, 0)

    def sample(
        self,
        stats: dict[str, Any],
        num_requests: int,
        adapter_inflight: dict[str, int],
        max_loras: int,
    ) -> dict[str, float]:
        """stats: the engine's latest_stats(); adapter_inflight: adapter -> requests in flight."""
        now = self.clock()
        num_activations = int(stats.get("lora", {}).get("activations", 0))
        last_time, last_requests, last_activations = self.last
        self.last = (now, num_requests, num_activations)
        dt = max(now - last_time, 1e-3)
        blocked = 0
        if len(adapter_inflight) > max_loras:
            in_slots = set(stats["adapters_in_slots"])
            blocked = sum(n for name, n in adapter_inflight.items() if name not in in_slots)
        return {
            "num_adapters_wanted": float(len(adapter_inflight)),
            "max_loras": float(max_loras),
            "num_waiting_for_slot": float(blocked),
            "adapter_loads_per_s": (num_activations - last_activations) / dt,
            "requests_per_s": (num_requests - last_requests) / dt,
        }
