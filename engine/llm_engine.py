"""LLMEngine: vLLM's synchronous engine API over one model replica."""

import json
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import ContextLengthError, InvalidRequestError
from engine.input_processor import InputProcessor
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import AdapterTier, LoRAManager
from engine.lora.request import LoRARequest
from engine.model_runner import ModelRunner, ModelRunnerOutput
from engine.models.loader import resolve_model
from engine.output_processor import IncrementalDetokenizer, OutputProcessor, RequestState
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.structured import StructuredOutputManager
from engine.warmup import warm_up

logger = logging.getLogger(__name__)


def load_tokenizer(source: str | Path):
    """The model's tokenizer. A local folder with a tokenizer.json loads it as the fast
    tokenizer directly (what AutoTokenizer resolves such a folder to), skipping AutoTokenizer's
    detour through the model's config class: 1-2 s of transformers imports at every start-up.
    Anything else (a Hub id, a folder with only a slow tokenizer) goes through AutoTokenizer."""
    if (Path(source) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_name = _model_name(config.model, self.model_path)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.model_runner = ModelRunner(config, self.model_path)
        self.faults = self.model_runner.faults  # test-only fault injection (engine/faults.py)
        args = self.model_runner.args
        config.finalize(args.max_position_embeddings, self.model_runner.num_kv_blocks)
        # A sequence can never outgrow the whole KV cache.
        max_len = min(config.max_model_len, self.model_runner.num_kv_blocks * config.block_size)
        config.max_model_len = config.scheduler.max_model_len = max_len
        self.model_runner.init_decode(max_len)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.input_processor = InputProcessor(self.tokenizer, args.vocab_size, max_len)
        eos_token_ids = _eos_token_ids(self.tokenizer, self.model_path)
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids, max_len)
        # grammars of structured outputs; the sampler masks constrained rows with them
        self.structured = StructuredOutputManager(self.tokenizer, args.vocab_size, eos_token_ids)
        self.model_runner.sampler.structured = self.structured
        self.warm_up_seconds = 0.0
        if config.warm_up or (config.warm_up is None and self.model_runner.device.type == "cuda"):
            self.warm_up_seconds = warm_up(self)

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate everything first; on any error nothing in the engine has changed."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        params.verify(max_n=self.config.max_n)
        text, prompt_ids = self.input_processor.process(prompt)
        max_len = self.config.max_model_len
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_len:
            raise ContextLengthError(max_len, len(prompt_ids), params.max_tokens)
        identity = None  # the adapter as loaded, in its blocks' hashes (prefix caching)
        if lora_request is not None:
            if not self.config.enable_lora:
                raise InvalidRequestError("this engine was started with enable_lora=False")
            identity = self._lora_manager().add_lora(lora_request).identity
        grammar = None  # cached unless the caller compiled it elsewhere first (AsyncLLMEngine)
        if params.structured_outputs is not None:
            grammar = self.structured.compile(params.structured_outputs)
        step = self.scheduler.step_count
        first = Sequence(request_id, 0, prompt_ids, params, lora_request, step, None, identity)
        seqs = [first] + [
            Sequence(request_id, i, prompt_ids, params, lora_request, step, first, identity)
            for i in range(1, params.n)
        ]
        if grammar is not None:
            self.structured.add_sequences(seqs, grammar)
        decode, skip = self.output_processor.decode, params.skip_special_tokens
        detoks = [IncrementalDetokenizer(self.tokenizer, skip, decode) for _ in seqs]
        self.output_processor.add(
            RequestState(request_id, text, prompt_ids, params, lora_request, seqs, detoks)
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            self.output_processor.abort(rid, self.scheduler)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward + sampling round; RequestOutputs that changed. A failure in
        the step fails only the requests it ran (finish_reason "error"), never the engine."""
        out = self.scheduler.schedule()
        result = self._execute(out)
        self.scheduler.update_from_output(out, result.failed)
        return self.output_processor.process(out, result, self.scheduler)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.is_empty:
            return ModelRunnerOutput()
        try:
            return self.model_runner.execute(out)
        except Exception as e:  # the forward or a slot activation: every request it ran fails
            logger.exception("step %d failed; failing its requests", self.scheduler.step_count)
            manager = self.model_runner.lora_manager
            for slot, lora in out.lora_loads:  # a slot whose copy did not finish holds nothing
                if manager is None or manager.slot_names[slot] != lora.lora_name:
                    self.scheduler.slots.evict(lora.lora_name)
            reason = f"{type(e).__name__}: {e}"
            return ModelRunnerOutput(failed={s.seq.seq_id: reason for s in out.scheduled})

    # -- adapters ---------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> dict:
        """Validate and load an adapter into the CPU cache; raises engine.lora.errors.LoRAError.
        Reads from disk/Hub in the caller's thread (AsyncLLMEngine.add_lora reads off-lock)."""
        return _lora_info(self._lora_manager().add_lora(lora_request))

    def lora_to_read(self, lora_request: LoRARequest) -> LoRARequest | None:
        """The request read_lora must read, or None if the CPU cache holds the adapter."""
        return self._lora_manager().lora_to_read(lora_request)

    def read_lora(self, lora_request: LoRARequest, tier: AdapterTier | None = None) -> LoRAAdapter:
        """Read and validate an adapter from disk/Hub, or fetch it from `tier` (raises
        LoRAError). Touches no engine state: safe in a worker thread, without the engine's
        lock, while steps run."""
        return self._lora_manager().read_lora(lora_request, tier)

    def quick_read(self, lora_request: LoRARequest, tier: AdapterTier | None = None) -> bool:
        """Cached, or a local read quick enough to make under the lock (LoRAManager.quick_read)."""
        return self._lora_manager().quick_read(lora_request, tier)

    def reads_shared(self, tier: AdapterTier | None) -> bool:
        """Would this replica fetch a local-folder adapter it lacks from `tier` (a copy) rather
        than read it from disk (LoRAManager.tier_first)? The router weighs it before sending
        here an adapter this replica does not hold. False without LoRA."""
        manager = self.model_runner.lora_manager
        return tier is not None and manager is not None and manager.tier_first(True)

    def insert_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> dict:
        """Put an adapter read by read_lora into the CPU cache; quick."""
        return _lora_info(self._lora_manager().insert_lora(lora_request, adapter))

    def remove_lora(self, lora_name: str) -> bool:
        in_use = self.scheduler.adapters_in_use() | {s.lora_name for s in self.scheduler.waiting}
        if lora_name in in_use:
            raise InvalidRequestError(f"adapter {lora_name!r} has unfinished requests")
        self.scheduler.slots.evict(lora_name)
        return self._lora_manager().remove_lora(lora_name)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block hash (vLLM's name); the number dropped."""
        return self.block_manager.reset_prefix_cache()

    def pin_lora(self, lora_name: str) -> None:
        self._lora_manager().pin_lora(lora_name)

    def list_loras(self) -> list[str]:
        return list(self._lora_manager().known) if self.config.enable_lora else []

    def cached_local_reads(self) -> list[tuple[LoRARequest, LoRAAdapter]]:
        """The CPU cache's adapters read from local folders (LoRAManager.cached_local_reads);
        any thread."""
        return self._lora_manager().cached_local_reads()

    def _lora_manager(self) -> LoRAManager:
        if self.model_runner.lora_manager is None:
            raise InvalidRequestError("this engine was started with enable_lora=False")
        return self.model_runner.lora_manager

    def residency(self) -> tuple[list[str], list[str]]:
        """(adapters in slots, adapters in the CPU cache), as the scheduler and manager see them."""
        cpu = self.model_runner.lora_manager.residency()[1] if self.config.enable_lora else []
        return list(self.scheduler.slots.slot_of), cpu

    def stats(self) -> dict:
        sched, slots = self.scheduler, self.scheduler.slots
        lora = {
            "activations": slots.num_activations,
            "evictions": slots.num_evictions,
            "hits": slots.num_hits,
            "misses": slots.num_activations,
        }
        manager = self.model_runner.lora_manager
        if manager is not None:
            lora["loads"] = manager.num_loads
            lora["shared_reads"] = manager.num_shared_reads
            lora.update(manager.read_costs_ms())
        in_slots, in_cpu = self.residency()
        cache = self.block_manager.stats
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "num_preemptions": sched.num_preemptions,
            # the steps that ran something, and their batches summed
            "steps": {
                "steps": sched.num_batches,
                "seqs": sched.num_batch_seqs,
                "adapters": sched.num_batch_adapters,
                "tokens": sched.num_batch_tokens,
            },
            "adapters_in_slots": in_slots,
            "adapters_in_cpu": in_cpu,
            "lora": lora,
            # prefix caching, in tokens (vLLM's counters): looked up, found; hits / queries
            "prefix_cache_queries": cache.num_queries,
            "prefix_cache_hits": cache.num_hits,
            "prefix_cache_hit_rate": cache.hit_rate,
            "num_cached_blocks": self.block_manager.num_cached_blocks,
        }


def _lora_info(adapter: LoRAAdapter) -> dict:
    return {
        "name": adapter.name,
        "source": adapter.source,
        "rank": adapter.rank,
        "target_modules": list(adapter.target_modules),
    }


def _model_name(model: str, path: Path) -> str:
    if model == "default" or Path(model).exists():
        return path.name
    return model


def _eos_token_ids(tokenizer, path: Path) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
