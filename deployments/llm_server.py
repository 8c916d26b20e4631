"""LLMServer: one Ray Serve replica around an AsyncLLMEngine.

Requests come in as `deployments.protocol.GenerateRequest` and go back as a stream of
`ReplicaOutput`. The adapter of a request is its multiplexed model id (`handle.options(
multiplexed_model_id=name)`); "" means the base model. The adapter is looked up in the
catalog (deployments/replica_reporter.py: the AdapterRegistry's listing, plus the adapters
the app was built with) and read into the engine's CPU cache on first use, in a worker
thread: streams on this replica go on while an adapter is read from disk or the Hub. What
stays in the CPU cache and in the slots: the adapters this replica is asked for most (its
decayed request counts, `adapter_eviction="frequency"`; "lru" is vLLM's). The reporter tells
the registry and, through `record_routing_stats`, the AdapterAffinityRouter. An adapter
another replica already downloaded is fetched from the Ray object store instead of
downloaded again, and one read from a local folder is shared with nodes without the folder
(`shared_adapter_tier`, default on; deployments/shared_adapters.py). With
`report_multiplexed_ids` (default on) the replica also reports its CPU-cache adapters to Ray
Serve as its multiplexed model ids, as a `@serve.multiplexed` replica does
(deployments/multiplexed_ids.py), so Ray's default router prefers replicas that hold the
adapter too.

Errors leave this replica as `APIError` with the HTTP status. A request the engine fails
(its step raised) is a 500 for that request only; if the engine loop itself dies,
`check_health` raises, and Serve replaces the replica.

The class is undecorated; serve_app wraps it with `serve.deployment` so options are
configurable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncGenerator
from contextlib import ExitStack
from typing import Any

from ray import serve

from deployments.dynamic_adapters import for_replica
from deployments.gc_heap import full_collections
from deployments.grpc_bind import bind_replica_grpc_to_node_ip
from deployments.multiplexed_ids import MultiplexedIdReporter, push_for_this_replica
from deployments.placement import EVICTION_HALF_LIFE, AdapterPopularity
from deployments.protocol import APIError, GenerateRequest, ReplicaOutput
from deployments.replica_io import (
    AutoscalingSampler,
    LoRAIds,
    RequestMetrics,
    adapter_entry,
    check_adapter_name,
    initial_adapters,
    to_api_error,
    to_replica_output,
)
from deployments.replica_reporter import ReplicaReporter, get_registry_or_none
from deployments.shared_adapters import RayAdapterTier

logger = logging.getLogger("ray.serve")

# Test and soak-benchmark only: lets `inject_fault` break this replica's engine on purpose.
FAULT_INJECTION_ENV = "RAYLORA_FAULT_INJECTION"


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests, a plain actor)
        return f"local-{uuid.uuid4().hex[:8]}"


class LLMServer:
    """An engine replica. See the module docstring for adapters, residency and errors."""

    async def __init__(
        self,
        engine_config: dict[str, Any],
        adapters: dict[str, str] | None = None,
        demo_adapters: bool = False,
        report_interval_s: float = 5.0,
        shutdown_timeout_s: float = 30.0,
        registry_state_file: str | None = None,
        report_multiplexed_ids: bool = True,
        adapter_eviction: str = "frequency",
        read_adapters_in_step: bool = False,
        shared_adapter_tier: bool = True,
        shared_tier_bytes: int | None = None,  # the registry's budget, if this creates it
        dynamic_lora_loading_path: str | None = None,  # names the catalog lacks: <path>/<name>
    ) -> None:
        from engine import AsyncLLMEngine, EngineConfig

        bind_replica_grpc_to_node_ip()
        config = EngineConfig(**engine_config)
        self.engine = AsyncLLMEngine(config)
        self._max_loras = int(config.max_loras)
        self._max_num_seqs = int(config.max_num_seqs)
        # Eviction of slots and CPU cache: "frequency" = the idle adapter this replica was asked
        # for least (decayed counts); "lru" = vLLM's. read_adapters_in_step: the engine reads a
        # missing adapter inside the step, as vLLM does (benchmarks/routing.py's peer arm).
        if adapter_eviction not in ("frequency", "lru"):
            raise ValueError(f"adapter_eviction must be frequency or lru, got {adapter_eviction!r}")
        self._adapter_counts: AdapterPopularity | None = None
        if adapter_eviction == "frequency":
            self._adapter_counts = AdapterPopularity(EVICTION_HALF_LIFE)
            self.engine.engine.scheduler.slots.priority = self._adapter_counts.count
            self.engine.engine.model_runner.lora_manager.priority = self._adapter_counts.count
        self._read_in_step = bool(read_adapters_in_step)
        self.engine.read_loras_off_lock = not self._read_in_step
        self._in_cpu: set[str] = set()  # the engine's CPU cache, as its listener last said
        self.engine.add_residency_listener(self._on_residency)
        self.model_name: str = self.engine.model_name
        self.replica_id = _replica_id()
        self._shutdown_timeout_s = shutdown_timeout_s
        catalog = {
            name: adapter_entry(name, path, self.model_name)
            for name, path in initial_adapters(adapters, demo_adapters).items()
        }
        self._lora_ids = LoRAIds()
        self._num_inflight = 0
        self._num_aborted = 0  # requests whose caller went away before they finished
        self._num_requests = 0  # requests received, ever
        self._adapter_inflight: dict[str, int] = {}  # adapter -> requests in flight here
        self._autoscaling = AutoscalingSampler()
        self.reporter = ReplicaReporter(
            self.engine,
            self.replica_id,
            catalog,
            report_interval_s,
            get_registry=lambda: get_registry_or_none(registry_state_file, shared_tier_bytes),
        )
        await self.reporter.start()
        self._dynamic = for_replica(dynamic_lora_loading_path, self.load_adapter, self.reporter)
        # what another replica read comes from the object store (not on the peer's in-step path)
        if shared_adapter_tier and not self._read_in_step and self.reporter.registry is not None:
            registry = self.reporter.registry
            tier = RayAdapterTier(registry, self.model_name, self.replica_id)
            tier.cached = self.engine.engine.cached_local_reads  # offered when a node joins
            tier.warm_up()  # before serving: the first put's set-up is no request's wait
            self.engine.adapter_tier = tier
        # Ray's default router reads these; outside Serve there is nobody to tell.
        push = push_for_this_replica() if report_multiplexed_ids else None
        self._multiplex: MultiplexedIdReporter | None = None
        if push is not None:
            self._multiplex = MultiplexedIdReporter(push)
            self.engine.add_residency_listener(self._multiplex.on_residency)
            self._multiplex.start()
        self._full_collections = full_collections()  # stats()["gc"]

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[ReplicaOutput, None]:
        """Stream one request: each ReplicaOutput carries only what is new (text, token ids,
        logprobs of each completion); the first one also the prompt fields it asked for."""
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
                deltas.append((o, num_chars, num_tokens, end))
            if deltas or out.finished:
                yield self._output(out, deltas, first, request)

    async def complete(self, request: GenerateRequest) -> ReplicaOutput:
        """Run one request to the end; one ReplicaOutput with the whole completions."""
        final = None
        async for out, _ in self._run(request):
            final = out
        if final is None:
            raise APIError(500, "the engine returned no output", "server_error")
        return self._output(final, [(o, 0, 0, None) for o in final.outputs], True, request)

    def _output(self, out, deltas, first: bool, request: GenerateRequest) -> ReplicaOutput:
        prompt = None
        if first and request.echo:
            prompt = out.prompt
            if prompt is None:  # the prompt came as token ids
                prompt = self.engine.tokenizer.decode(out.prompt_token_ids)
        return to_replica_output(out, deltas, first, prompt, self._token_text)

    async def _run(self, request: GenerateRequest):
        from engine import SamplingParams

        if not isinstance(request, GenerateRequest):
            raise APIError(400, "LLMServer takes a deployments.protocol.GenerateRequest")
        adapter = serve.get_multiplexed_model_id()
        gen = None
        finished = False
        timing = RequestMetrics(adapter)
        if adapter in self.reporter.catalog:  # known: labelled so even if the request is bad
            timing.served(adapter)
        reading = ExitStack()  # the adapter's "being read" report, until the first output
        self._num_inflight += 1
        self._num_requests += 1
        if adapter:
            self._adapter_inflight[adapter] = self._adapter_inflight.get(adapter, 0) + 1
        if self._adapter_counts is not None:
            self._adapter_counts.record(adapter)
        try:
            request.check()
            lora_request = None
            if adapter:
                lora_request = await self._lora_request(adapter)
                timing.served(adapter)
            prompt, num_prompt_tokens = self._engine_prompt(request)
            kwargs = request.sampling.engine_kwargs()
            if kwargs["max_tokens"] is None and request.default_max_tokens is not None:
                room = self.engine.engine.config.max_model_len - num_prompt_tokens
                kwargs["max_tokens"] = max(1, min(request.default_max_tokens, room))
            params = SamplingParams(**kwargs)
            # an adapter not in the CPU cache is read by the engine as it adds the request, off
            # the step (one read for the requests that wait for it): reported to Ray's router
            # meanwhile, as Ray's multiplexed wrapper reports a model being loaded
            if (
                adapter
                and self._multiplex
                and not self._read_in_step
                and adapter not in self._in_cpu
            ):
                reading.enter_context(self._multiplex.loading(adapter))
            gen = self.engine.generate(prompt, params, request.request_id, lora_request)
            first = True
            async for out in gen:
                reading.close()
                finished = out.finished
                timing.on_output(out)
                yield out, first
                first = False
            timing.on_finish("ok")
        except BaseException as e:
            timing.on_finish(type(e).__name__)
            err = to_api_error(e) if isinstance(e, Exception) else e
            if err is e:
                raise
            raise err from None
        finally:
            reading.close()
            self._num_inflight -= 1
            if adapter:
                left = self._adapter_inflight.pop(adapter, 1) - 1
                if left > 0:
                    self._adapter_inflight[adapter] = left
            if gen is not None and not finished:
                self._num_aborted += 1
            if gen is not None:
                await gen.aclose()  # aborts the engine request if it is still running

    def _engine_prompt(self, request: GenerateRequest) -> tuple[dict, int]:
        """(the prompt as engine.generate takes it, its number of tokens). Tokenized here,
        once, so the default max_tokens can be fitted to the context that is left."""
        processor = self.engine.engine.input_processor
        if request.messages is not None:
            text, ids = processor.process(self.engine.apply_chat_template(request.messages))
        elif request.prompt_token_ids is not None:
            text, ids = processor.process({"prompt_token_ids": list(request.prompt_token_ids)})
        else:
            text, ids = processor.process(request.prompt)
        return {"prompt_token_ids": ids, "prompt": text}, len(ids)

    def _token_text(self, token_id: int) -> str:
        """A logprob's text: HF's decode([id]) by the detokenizer's Rust decode (ids_decoder)."""
        if getattr(self.engine, "tokenizer", None) is None:
            return f"token_id:{token_id}"  # vLLM's return_tokens_as_token_ids form
        return self.engine.engine.output_processor.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ adapters

    async def _lora_request(self, name: str):
        from engine import LoRARequest

        entry = self.reporter.catalog.get(name)
        if entry is None:  # registered a moment ago? else under dynamic_lora_loading_path?
            await self.reporter.refresh_catalog()
            if name not in self.reporter.catalog and self._dynamic is not None:
                await self._dynamic.serve(name)  # loaded here (into the catalog) and registered
            entry = self.reporter.catalog.get(name)
        if entry is None:
            msg = f"The model `{name}` does not exist."
            raise APIError(404, msg, "not_found_error", "model", "model_not_found")
        return LoRARequest(name, self._lora_ids.get(name), entry["source"])

    def _on_residency(self, slots: list[str], cpu: list[str]) -> None:
        self._in_cpu = set(cpu)  # from the engine thread: one assignment, no shared mutation

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Validate an adapter by loading it into this replica's CPU cache; return its spec.

        Raises APIError 404 (not found) or 400 (cannot be served on this model).
        """
        from engine import LoRARequest

        try:
            check_adapter_name(name)  # handle callers reach this without the ingress's check
            if name in self.engine.list_loras():
                self.engine.remove_lora(name)  # a re-load with another path replaces it
            info = await self.engine.add_lora(LoRARequest(name, self._lora_ids.get(name), path))
        except Exception as e:
            if name not in self.reporter.catalog:  # a failed load leaves no id behind
                self._lora_ids.forget(name)
            raise to_api_error(e) from None
        entry = {
            "source": str(info.get("source", path)),
            "rank": int(info["rank"]),
            "target_modules": list(info["target_modules"]),
            "base_model": self.model_name,
        }
        self.reporter.catalog[name] = entry
        return entry

    async def unload_adapter(self, name: str) -> bool:
        """Forget an adapter here now (the registry's unload reaches every replica at its
        next catalog sync anyway); one with requests in flight is freed when they finish."""
        from engine.errors import InvalidRequestError

        self.reporter.catalog.pop(name, None)
        self._lora_ids.forget(name)
        try:
            return bool(self.engine.remove_lora(name))
        except InvalidRequestError:
            return False

    # ------------------------------------------------------------------ stats for routing

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by the AdapterAffinityRouter every request_routing_stats_period_s (on this
        replica's event loop: the stats of the last step, not waiting for the one running)."""
        stats = self.engine.latest_stats()
        return {
            "adapters_in_slots": list(stats["adapters_in_slots"]),
            "adapters_in_cpu": list(stats["adapters_in_cpu"]),
            "num_running": int(stats["num_running"]),
            "num_waiting": int(stats["num_waiting"]),
            "engine_dead": bool(self.engine.errored),  # the router routes around it
            "max_loras": self._max_loras,  # the placement's slot count (deployments/placement.py)
            "max_num_seqs": self._max_num_seqs,  # a full batch is over the load bound
            # a read here is a fetch from the shared tier, not a cold read (rank_replicas)
            "reads_shared": self.engine.reads_shared(),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics for cluster.autoscaling.AdapterAwarePolicy
        (replica_io.AutoscalingSampler). Ray Serve calls this every look_back_period_s x 0.2
        when the deployment autoscales and averages each metric per replica over
        look_back_period_s."""
        return self._autoscaling.sample(
            self.engine.latest_stats(), self._num_requests, self._adapter_inflight, self._max_loras
        )

    # ------------------------------------------------------------------ info + lifecycle

    def model_info(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "replica_id": self.replica_id,
            "max_model_len": self.engine.engine.config.max_model_len,
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats(),
            "replica_id": self.replica_id,
            "num_inflight": self._num_inflight,
            "num_aborted_requests": self._num_aborted,
            "gc": self._full_collections.stats(),
        }

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising marks the replica unhealthy
        and Serve replaces it. The engine raises EngineDeadError once its loop died."""
        self.engine.check_health()
        self.reporter.ensure_running()

    def inject_fault(self, kind: str) -> str:
        """Break this replica's engine on purpose ("step": the next step fails; "loop": the
        engine loop dies), for the fault tests and benchmarks/soak.py. Refused unless the
        replica runs with RAYLORA_FAULT_INJECTION=1."""
        if os.environ.get(FAULT_INJECTION_ENV) != "1":
            raise APIError(403, f"fault injection is off (set {FAULT_INJECTION_ENV}=1)")
        self.engine.inject_fault(kind)
        return self.replica_id

    async def __del__(self) -> None:
        """Graceful shutdown: Serve has stopped routing here; let in-flight requests finish
        (bounded by shutdown_timeout_s), then stop the engine and leave the registry."""
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        if getattr(self, "_multiplex", None) is not None:
            self._multiplex.stop()
        try:
            await asyncio.wait_for(
                self.engine.shutdown(self._shutdown_timeout_s), self._shutdown_timeout_s + 5
            )
        except Exception as e:
            logger.warning("raylora: engine shutdown did not finish cleanly: %s", e)
