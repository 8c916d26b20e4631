"""ModelRunner: owns the model, the KV cache and the LoRA slots; runs one batched forward."""

import logging
from collections.abc import Iterable
from typing import TypeVar

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.lora.adapter import LoRAModelSpec
from engine.lora.manager import LoRAManager
from engine.models.llama import ForwardContext, LlamaForCausalLM, ModelArgs, rope_inv_freq
from engine.models.loader import load_model_config, load_state_dict
from engine.sampler import Sampler, SampleResult
from engine.scheduler import SchedulerOutput
from kernels import LoRABatchMeta
from kernels.cpu_kernel import cpu_lora_op, packed_gemm_fast

logger = logging.getLogger(__name__)
T = TypeVar("T")


def pick_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def pick_lora_dtype(config: EngineConfig, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The slots' weight dtype: lora_dtype, or the model's dtype for "auto". The Triton kernels
    take weights in the activations' dtype only."""
    if config.lora_dtype == "auto":
        return model_dtype
    dtype = getattr(torch, config.lora_dtype)
    if backend == "triton" and dtype != model_dtype:
        raise ValueError(
            f"lora_dtype {config.lora_dtype} differs from the model's dtype "
            f"{str(model_dtype)[6:]}: the triton LoRA backend needs them equal (use "
            "lora_dtype='auto')"
        )
    return dtype


def order_by_slot(tagged: Iterable[tuple[T, int]]) -> list[tuple[T, int]]:
    """(item, LoRA slot) pairs with the adapter ones first in ascending slot order and the base
    ones (slot -1) last; stable otherwise. The LoRA kernels then find each slot's tokens as one
    run of rows (LoRABatchMeta.tokens_sorted), which the torch path reads as views instead of
    gathering and scattering rows in every LoRA layer."""
    return sorted(tagged, key=lambda t: (t[1] < 0, t[1]))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path) -> None:
        self.config = config
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        backend = config.lora_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.lora_backend = backend
        self.lora_dtype = pick_lora_dtype(config, self.dtype, backend)  # checked before loading
        self.args = ModelArgs.from_hf_config(load_model_config(model_path))
        with torch.device("meta"):
            model = LlamaForCausalLM(self.args)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.inv_freq = rope_inv_freq(self.args).to(self.device)  # fp32, not self.dtype
        model.load_weights(load_state_dict(model_path, dtype=self.dtype))
        self.model = model.eval()
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for_memory()
        self._allocate_kv_cache()
        self.sampler = Sampler(config.seed)
        self.lora_manager: LoRAManager | None = None
        if config.enable_lora:
            spec = LoRAModelSpec(
                self.args.num_layers, self.args.lora_module_shapes(), config.max_lora_rank
            )
            self.lora_manager = LoRAManager(
                config.lora, spec, self.model.lora_linears(), self.device, self.lora_dtype
            )
        if self.device.type == "cpu" and self.dtype == torch.float32:
            # the C++ CPU kernels (the packed GEMM; LoRA on the torch backend): build them
            # (first time on this machine) or load them now, not mid-step
            if cpu_lora_op() is not None and packed_gemm_fast():
                self.model.pack_cpu_weights()

    def _kv_bytes_per_block(self) -> int:
        a = self.args
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

    def _blocks_for_memory(self) -> int:
        return max(1, int(self.config.kv_cache_memory_gb * 2**30) // self._kv_bytes_per_block())

    def _allocate_kv_cache(self) -> None:
        a = self.args
        shape = (self.num_kv_blocks * self.block_size, a.num_kv_heads, a.head_dim)
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, SampleResult]:
        """Run the scheduled tokens; return seq_id -> sampled token for sequences that sample."""
        if self.lora_manager is not None:
            for slot, lora in out.lora_loads:
                self.lora_manager.activate(slot, lora)
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []
        specs = []
        tagged = [
            (s, out.lora_slots[s.seq.lora_name] if s.seq.lora_name is not None else -1)
            for s in out.scheduled
        ]
        for s, slot in order_by_slot(tagged):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            token_slots.extend([slot] * n)
            specs.append((start, n, seq.block_table))
            if s.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        dev = self.device
        lora_meta = None
        if self.lora_manager is not None and out.lora_slots:
            lora_meta = LoRABatchMeta.build(
                torch.tensor(token_slots, dtype=torch.int32, device=dev), self.config.max_loras
            )
        ctx = ForwardContext(
            attn=AttentionMetadata.build(specs, self.block_size, dev),
            lora=lora_meta,
            lora_backend=self.lora_backend,
        )
        logits = self.model(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            ctx,
            torch.tensor(sample_rows, dtype=torch.long, device=dev),
        )
        if not sample_seqs:
            return {}
        results = self.sampler(logits.cpu(), sample_seqs)
        return {seq.seq_id: r for seq, r in zip(sample_seqs, results, strict=True)}
