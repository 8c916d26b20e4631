"""LLMServer: one Ray Serve replica around an AsyncLLMEngine.

The adapter of a request is its multiplexed model id (`handle.options(multiplexed_model_id=
name)`); "" means the base model. The adapter is looked up in the catalog (the
AdapterRegistry's `list_adapters`, cached here, plus the adapters the app was built with)
and loaded into the engine's CPU cache on first use. The engine's own LRU decides what stays
in the CPU cache and in the slots; this replica reports every change of that residency, and
the full state every `report_interval_s`, to the registry (so a restarted registry recovers)
and, through `record_routing_stats`, to the AdapterAffinityRouter. `record_autoscaling_stats`
feeds the adapter-aware autoscaling policy (cluster/autoscaling.py).

Errors leave this replica as `deployments.protocol.APIError` with the HTTP status, so
callers never unpickle engine classes (and never import torch for it).

The class is undecorated; serve_app wraps it with `serve.deployment` so options are
configurable.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from deployments import metrics
from deployments.grpc_bind import bind_replica_grpc_to_node_ip
from deployments.protocol import APIError
from deployments.replica_io import (
    adapter_entry,
    completion_dict,
    initial_adapters,
    output_dict,
    to_api_error,
)

logger = logging.getLogger("ray.serve")

REGISTRY_CALL_TIMEOUT_S = 5.0


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests, a plain actor)
        return f"local-{uuid.uuid4().hex[:8]}"


def _get_registry():
    try:
        from deployments.registry import get_or_create_registry

        return get_or_create_registry()
    except Exception as e:  # serving works without a registry; routing is just less sticky
        logger.warning("raylora: no adapter registry (%s); continuing without it", e)
        return None


class LLMServer:
    """An engine replica. See the module docstring for adapters, residency and errors."""

    async def __init__(
        self,
        engine_config: dict[str, Any],
        adapters: dict[str, str] | None = None,
        demo_adapters: bool = False,
        report_interval_s: float = 5.0,
        shutdown_timeout_s: float = 30.0,
    ) -> None:
        from engine import AsyncLLMEngine, EngineConfig

        bind_replica_grpc_to_node_ip()
        config = EngineConfig(**engine_config)
        self.engine = AsyncLLMEngine(config)
        self._max_loras = int(config.max_loras)
        self.model_name: str = self.engine.model_name
        self.replica_id = _replica_id()
        self._report_interval_s = report_interval_s
        self._shutdown_timeout_s = shutdown_timeout_s
        # name -> registry spec: the adapters the app was built with until the registry answers
        self._catalog: dict[str, dict] = {
            name: adapter_entry(name, path, self.model_name)
            for name, path in initial_adapters(adapters, demo_adapters).items()
        }
        self._lora_ids: dict[str, int] = {}  # name -> lora_int_id (stable per replica)
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._num_inflight = 0
        self._num_aborted = 0  # requests whose caller went away before they finished
        self._num_requests = 0  # requests received, ever
        self._adapter_inflight: dict[str, int] = {}  # adapter -> requests in flight here
        # (monotonic time, num_requests, slot activations) at the last autoscaling sample
        self._autoscaling_sample = (time.monotonic(), 0, 0)
        self._last_lora_stats: dict[str, int] = {}
        self._registry = _get_registry()
        self._loop = asyncio.get_running_loop()
        self._residency_changed = asyncio.Event()
        self.engine.add_residency_listener(self._on_residency)
        try:  # registers the initial adapters; a registry that is down must not stop serving
            await self._report(sync_catalog=True)
        except Exception as e:
            logger.warning("raylora: first residency report failed: %s", e)
        self._reporter = asyncio.create_task(self._report_loop())

    # ------------------------------------------------------------------ requests

    async def generate(self, request: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Stream one request: yields {"request_id", "prompt", "num_prompt_tokens",
        "outputs": [{"index", "text", "token_ids", "logprobs", "finish_reason",
        "stop_reason"}], "finished"} where text/token_ids/logprobs are the new part only.

        request: {"prompt": str} | {"prompt_token_ids": [...]} | {"messages": [...]},
        "sampling_params": SamplingParams kwargs, optional "request_id", optional "adapter"
        (used only when no multiplexed model id is set).
        """
        seen: dict[int, tuple[int, int]] = {}  # index -> (len(text), len(token_ids)) sent
        async for out, first in self._run(request):
            deltas = []
            for o in out.outputs:
                num_chars, num_tokens = seen.get(o.index, (0, 0))
                if len(o.token_ids) == num_tokens and o.finish_reason is None:
                    continue
                # Hold back a trailing partial UTF-8 character ("\ufffd") until it completes.
                end = len(o.text) if o.finish_reason else len(o.text.rstrip("\ufffd"))
                end = max(end, num_chars)
                seen[o.index] = (end, len(o.token_ids))
                deltas.append(completion_dict(o, num_chars, num_tokens, end, self._token_text))
            if deltas or out.finished:
                yield output_dict(out, deltas, first)

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request to the end; same dict as `generate` with the full texts."""
        final = None
        async for out, _ in self._run(request):
            final = out
        if final is None:
            raise APIError(500, "the engine returned no output", "server_error")
        return output_dict(
            final, [completion_dict(o, 0, 0, None, self._token_text) for o in final.outputs], True
        )

    async def _run(self, request: dict[str, Any]):
        from engine import SamplingParams

        adapter = serve.get_multiplexed_model_id() or request.get("adapter") or ""
        req_id = request.get("request_id") or uuid.uuid4().hex
        tags = {"adapter": adapter or "<base>"}
        start = time.perf_counter()
        first_token_time = None
        num_tokens = 0
        gen = None
        finished = False
        self._num_inflight += 1
        self._num_requests += 1
        if adapter:
            self._adapter_inflight[adapter] = self._adapter_inflight.get(adapter, 0) + 1
        try:
            lora_request = await self._lora_request(adapter) if adapter else None
            params = SamplingParams(**request.get("sampling_params", {}))
            gen = self.engine.generate(self._prompt(request), params, req_id, lora_request)
            first = True
            async for out in gen:
                finished = out.finished
                num_tokens = sum(len(o.token_ids) for o in out.outputs)
                if first_token_time is None and num_tokens:
                    first_token_time = time.perf_counter()
                    metrics.TTFT.observe(first_token_time - start, tags=tags)
                yield out, first
                first = False
            if first_token_time is not None and num_tokens > 1:
                tpot = (time.perf_counter() - first_token_time) / (num_tokens - 1)
                metrics.TPOT.observe(tpot, tags=tags)
            metrics.REPLICA_REQUESTS.inc(tags={**tags, "status": "ok"})
        except BaseException as e:
            metrics.REPLICA_REQUESTS.inc(tags={**tags, "status": type(e).__name__})
            err = to_api_error(e) if isinstance(e, Exception) else e
            if err is e:
                raise
            raise err from None
        finally:
            self._num_inflight -= 1
            if adapter:
                left = self._adapter_inflight.pop(adapter, 1) - 1
                if left > 0:
                    self._adapter_inflight[adapter] = left
            if gen is not None and not finished:
                self._num_aborted += 1
            if gen is not None:
                await gen.aclose()  # aborts the engine request if it is still running

    def _prompt(self, request: dict[str, Any]) -> str | dict[str, list[int]]:
        if "messages" in request:
            return self.engine.apply_chat_template(request["messages"])
        if "prompt_token_ids" in request:
            return {"prompt_token_ids": list(request["prompt_token_ids"])}
        if "prompt" in request:
            return request["prompt"]
        raise APIError(400, "request has no prompt, prompt_token_ids or messages")

    def _token_text(self, token_id: int) -> str:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's return_tokens_as_token_ids form
        return tokenizer.decode([token_id])

    # ------------------------------------------------------------------ adapters

    async def _lora_request(self, name: str):
        from engine import LoRARequest

        entry = self._catalog.get(name)
        if entry is None:
            await self._refresh_catalog()
            entry = self._catalog.get(name)
        if entry is None:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                "not_found_error",
                "model",
                "model_not_found",
            )
        lora_request = LoRARequest(name, self._lora_int_id(name), entry["source"])
        if name not in self.engine.list_loras():
            lock = self._load_locks.setdefault(name, asyncio.Lock())
            async with lock:  # one load per adapter, however many requests wait for it
                if name not in self.engine.list_loras():
                    self.engine.add_lora(lora_request)
        return lora_request

    def _lora_int_id(self, name: str) -> int:
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Validate an adapter by loading it into this replica's CPU cache; return its spec.

        Raises APIError 404 (not found) or 400 (cannot be served on this model).
        """
        from engine import LoRARequest

        try:
            if name in self.engine.list_loras():
                self.engine.remove_lora(name)  # a re-load with another path replaces it
            info = self.engine.add_lora(LoRARequest(name, self._lora_int_id(name), path))
        except Exception as e:
            raise to_api_error(e) from None
        entry = {
            "source": str(info.get("source", path)),
            "rank": int(info["rank"]),
            "target_modules": list(info["target_modules"]),
            "base_model": self.model_name,
        }
        self._catalog[name] = entry
        return entry

    async def unload_adapter(self, name: str) -> bool:
        self._catalog.pop(name, None)
        return bool(self.engine.remove_lora(name))

    # ------------------------------------------------------------------ residency + registry

    def _on_residency(self, adapters_in_slots: list[str], adapters_in_cpu: list[str]) -> None:
        # Called from the engine thread: hand over to our loop, and never raise into it.
        try:
            self._loop.call_soon_threadsafe(self._residency_changed.set)
        except RuntimeError:  # our loop is closed (replica shutting down)
            pass

    async def _report_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._residency_changed.wait(), self._report_interval_s)
                periodic = False
            except asyncio.TimeoutError:
                periodic = True
            self._residency_changed.clear()
            try:
                await self._report(sync_catalog=periodic)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("raylora: residency report failed: %s", e)

    async def _report(self, sync_catalog: bool) -> None:
        """Push residency to the registry (+ the catalog this replica knows); on a periodic
        report also refresh the catalog and drop adapters that were unregistered."""
        stats = self.engine.stats()
        self._update_metrics(stats)
        if self._registry is None:
            self._registry = _get_registry()
            if self._registry is None:
                return
        await asyncio.wait_for(
            self._registry.report_residency.remote(
                self.replica_id,
                list(stats["adapters_in_slots"]),
                list(stats["adapters_in_cpu"]),
                self._catalog,
            ),
            REGISTRY_CALL_TIMEOUT_S,
        )
        if sync_catalog:
            await self._refresh_catalog()
            for name in self.engine.list_loras():
                if name not in self._catalog:  # unloaded through the API: free its memory
                    self.engine.remove_lora(name)

    async def _refresh_catalog(self) -> None:
        if self._registry is None:
            return
        try:
            listed = await asyncio.wait_for(
                self._registry.list_adapters.remote(), REGISTRY_CALL_TIMEOUT_S
            )
        except Exception as e:
            logger.warning("raylora: registry list_adapters failed: %s", e)
            return
        self._catalog = listed

    def _update_metrics(self, stats: dict[str, Any]) -> None:
        tags = {"replica": self.replica_id}
        metrics.NUM_RUNNING.set(stats.get("num_running", 0), tags=tags)
        metrics.NUM_WAITING.set(stats.get("num_waiting", 0), tags=tags)
        metrics.ADAPTERS_IN_SLOTS.set(len(stats.get("adapters_in_slots", [])), tags=tags)
        metrics.ADAPTERS_IN_CPU.set(len(stats.get("adapters_in_cpu", [])), tags=tags)
        lora = stats.get("lora", {})
        for key, counter in metrics.LORA_COUNTERS.items():
            value = int(lora.get(key, 0))
            delta = value - self._last_lora_stats.get(key, 0)
            if delta > 0:
                counter.inc(delta, tags=tags)
            self._last_lora_stats[key] = value
        hits, misses = lora.get("hits", 0), lora.get("misses", 0)
        if hits + misses:
            metrics.SLOT_HIT_RATIO.set(hits / (hits + misses), tags=tags)

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by the AdapterAffinityRouter every request_routing_stats_period_s."""
        stats = self.engine.stats()
        return {
            "adapters_in_slots": list(stats["adapters_in_slots"]),
            "adapters_in_cpu": list(stats["adapters_in_cpu"]),
            "num_running": int(stats["num_running"]),
            "num_waiting": int(stats["num_waiting"]),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics for cluster.autoscaling.AdapterAwarePolicy. Ray Serve
        calls this every look_back_period_s x 0.2 when the deployment autoscales and averages
        each metric per replica over look_back_period_s.

        num_waiting_for_slot counts in-flight requests whose adapter is not in a slot, but
        only while more distinct adapters are in flight than there are slots (otherwise an
        idle slot can be taken at the next step and nobody is blocked on slots).
        """
        stats = self.engine.stats()
        now = time.monotonic()
        num_activations = int(stats.get("lora", {}).get("activations", 0))
        last_time, last_requests, last_activations = self._autoscaling_sample
        self._autoscaling_sample = (now, self._num_requests, num_activations)
        dt = max(now - last_time, 1e-3)
        wanted = self._adapter_inflight
        blocked = 0
        if len(wanted) > self._max_loras:
            in_slots = set(stats["adapters_in_slots"])
            blocked = sum(n for name, n in wanted.items() if name not in in_slots)
        return {
            "num_adapters_wanted": float(len(wanted)),
            "max_loras": float(self._max_loras),
            "num_waiting_for_slot": float(blocked),
            "adapter_loads_per_s": (num_activations - last_activations) / dt,
            "requests_per_s": (self._num_requests - last_requests) / dt,
        }

    # ------------------------------------------------------------------ info + lifecycle

    def model_info(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "replica_id": self.replica_id}

    def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats(),
            "replica_id": self.replica_id,
            "num_inflight": self._num_inflight,
            "num_aborted_requests": self._num_aborted,
        }

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising marks the replica unhealthy."""
        if getattr(self.engine, "errored", False):
            raise RuntimeError(f"engine loop died: {getattr(self.engine, 'error', '?')}")
        self.engine.stats()
        if self._reporter.done() and not self._reporter.cancelled():
            logger.warning("raylora: reporter stopped (%s); restarting", self._reporter.exception())
            self._reporter = asyncio.create_task(self._report_loop())

    async def __del__(self) -> None:
        """Graceful shutdown: Serve has stopped routing here; let in-flight requests finish
        (bounded by shutdown_timeout_s), then stop the engine and leave the registry."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        if self._registry is not None:
            self._registry.remove_replica.remote(self.replica_id)
        try:
            await asyncio.wait_for(
                self.engine.shutdown(self._shutdown_timeout_s), self._shutdown_timeout_s + 5
            )
        except Exception as e:
            logger.warning("raylora: engine shutdown did not finish cleanly: %s", e)
