"""ModelRunner: owns the model, the KV cache and the LoRA slots; runs one batched forward."""

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.device_sampler import DeviceSampler, make_sampler
from engine.errors import InjectedFault
from engine.faults import FaultInjector
from engine.lora.adapter import LoRAModelSpec
from engine.lora.manager import LoRAManager
from engine.memory import (
    CudaMeter,
    MemoryPlan,
    MemorySnapshot,
    plan_kv_blocks,
    profile_run,
    release_host_heap,
)
from engine.models.llama import ForwardContext, ModelArgs
from engine.models.loader import load_model, load_model_config
from engine.sampler import SampleResult
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.static_decode import StaticDecode
from raylora_kernels import LoRABatchMeta, lora_backend_name, make_lora_backend
from raylora_kernels.cpu_kernel import (
    cpu_argmax_op,
    cpu_decode_attention_op,
    cpu_elementwise_ops,
    cpu_forward_layers_op,
    cpu_lora_op,
    cpu_prefill_attention_op,
    packed_gemm_fast,
)
from raylora_kernels.paged_attention import paged_decode_attention_op

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Prompt logprobs take the lm_head + log_softmax over this many logits at a time (32 MB fp32).
LOGITS_CHUNK_ELEMS = 2**23


@dataclass
class ModelRunnerOutput:
    sampled: dict[int, SampleResult] = field(default_factory=dict)  # seq_id -> sampled token
    # seq_id -> the next entries of seq.prompt_logprobs (token id -> logprob), in prompt order
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # seq_id -> "<ExceptionType>: <msg>"


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


def _plain_greedy(seq: Sequence) -> bool:
    """Its token is the logits' argmax and nothing else of them is asked for (no logprobs, no
    grammar mask): the greedy lm_head can answer it (LlamaForCausalLM.greedy_ids)."""
    p = seq.params
    return p.greedy and p.logprobs is None and p.structured_outputs is None


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
        backend = lora_backend_name(config.lora_backend, self.device)
        self.lora_dtype = pick_lora_dtype(config, self.dtype, backend)  # checked before loading
        # the LoRA backend, chosen once: each step's ForwardContext prepares it with that step's
        # batch, and every LoRA linear calls it (raylora_kernels/backends)
        self.lora_backend = make_lora_backend(self.device, self.dtype, backend)
        self.args = ModelArgs.from_hf_config(load_model_config(model_path))
        # CUDA without num_kv_blocks: the KV cache gets what the model, the LoRA slots and a
        # profiled step leave of gpu_memory_utilization (engine/memory.py); measured from here
        baseline = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            baseline = MemorySnapshot.take(self.device)
        # parameters allocated once, in self.dtype; weights streamed shard by shard
        self.model = load_model(model_path, self.args, self.device, self.dtype)
        # the LoRA slots before the KV cache: planning counts them and profiles with them
        self.lora_manager: LoRAManager | None = None
        if config.enable_lora:
            spec = LoRAModelSpec(
                self.args.num_layers, self.args.lora_module_shapes(), config.max_lora_rank
            )
            self.lora_manager = LoRAManager(
                config.lora, spec, self.model.lora_linears(), self.device, self.lora_dtype
            )
        self.block_size = config.block_size
        self.memory_plan: MemoryPlan | None = None  # CUDA planning's numbers, when it ran
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for_memory(baseline)
        self._allocate_kv_cache()
        # on CUDA the logits stay on the device: only the sampled ids and logprobs come back
        self.sampler = make_sampler(
            self.device,
            config.seed,
            cpu_argmax_op() if self.device.type == "cpu" and self.dtype == torch.float32 else None,
        )
        self.faults = FaultInjector()  # test-only (engine/faults.py)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            # the C++ CPU kernels (the packed GEMM; LoRA on the torch backend): build them
            # (first time on this machine) or load them now, not mid-step
            if cpu_lora_op() is not None and packed_gemm_fast():
                self.model.pack_cpu_weights()
        self.static_decode: StaticDecode | None = None  # init_decode, once max_model_len is known
        # decode attention that reads the paged KV in place: the Triton kernel on CUDA, the C++
        # one for float32 on the CPU; else SDPA over gathered blocks
        self.decode_attention = None
        self.prefill_attention = None  # the C++ one for float32 on the CPU; else SDPA
        if self.device.type == "cuda":
            self.decode_attention = paged_decode_attention_op
        if self.device.type == "cpu" and self.dtype == torch.float32:
            a = self.args
            heads = (a.num_heads, a.num_kv_heads, a.head_dim)
            self.decode_attention = cpu_decode_attention_op(*heads)
            self.prefill_attention = cpu_prefill_attention_op(*heads)
            elementwise = cpu_elementwise_ops()
            if elementwise is not None:
                self.model.enable_cpu_elementwise(elementwise)
            fused = cpu_forward_layers_op()
            if (
                self.decode_attention is not None
                and self.prefill_attention is not None
                and self.model.packed_head is not None
                and fused is not None
            ):
                self.model.enable_fused_layers(fused)
        if self.device.type == "cpu":
            release_host_heap()

    def _kv_bytes_per_block(self) -> int:
        a = self.args
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

    def _blocks_for_memory(self, baseline: MemorySnapshot | None) -> int:
        """KV blocks when num_kv_blocks is not given. CPU (baseline None): kv_cache_memory_gb.
        CUDA: plan_kv_blocks from the memory used since `baseline` (model and LoRA slots) and
        the peak of a profiled max_num_batched_tokens step; raises KVCacheMemoryError."""
        bytes_per_block = self._kv_bytes_per_block()
        if baseline is None:
            return max(1, int(self.config.kv_cache_memory_gb * 2**30) // bytes_per_block)
        c, meter = self.config, CudaMeter(self.device)
        model_bytes = meter.allocated() - baseline.torch_allocated_bytes
        peak = profile_run(
            self.model,
            num_tokens=c.max_num_batched_tokens,
            max_seq_len=c.max_model_len or min(self.args.max_position_embeddings, 4096),
            max_num_seqs=c.max_num_seqs,
            block_size=self.block_size,
            max_loras=c.max_loras if self.lora_manager is not None else 0,
            lora_backend=self.lora_backend,
            meter=meter,
        )
        self.memory_plan = plan_kv_blocks(
            lambda: torch.cuda.mem_get_info(self.device),
            c.gpu_memory_utilization,
            model_bytes,
            peak,
            bytes_per_block,
            baseline=baseline,
            torch_reserved_bytes=torch.cuda.memory_reserved(self.device),
        )
        logger.info("%s", self.memory_plan.describe())
        return self.memory_plan.num_kv_blocks

    def _allocate_kv_cache(self) -> None:
        """num_kv_blocks blocks for the scheduler, plus the null block (id num_kv_blocks, owned
        by no sequence) that padded decode rows write to (engine/decode_inputs.py)."""
        a = self.args
        self.null_block = self.num_kv_blocks
        shape = ((self.num_kv_blocks + 1) * self.block_size, a.num_kv_heads, a.head_dim)
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled tokens: sampled tokens and prompt logprobs per sequence. Raises if
        a slot activation or the forward does (the engine then fails the step's requests);
        a sequence whose sampling or prompt logprobs fail alone is in `failed` instead."""
        if self.lora_manager is not None:
            for slot, lora in out.lora_loads:
                self.lora_manager.activate(slot, lora)
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[int] = []
        # (seq, its rows' range in prompt_rows, the prompt token index its first row predicts)
        prompt_seqs: list[tuple[Sequence, range, int]] = []
        specs = []
        tagged = [
            (s, out.lora_slots[s.seq.lora_name] if s.seq.lora_name is not None else -1)
            for s in out.scheduled
        ]
        ordered = order_by_slot(tagged)
        if self.static_decode is not None and self.static_decode.applies(out):
            self._step_fault()
            seqs, hidden = self.static_decode.run(ordered)
            result = ModelRunnerOutput()
            self._sample_into(result, hidden, seqs)
            return result
        for s, slot in ordered:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            token_slots.extend([slot] * n)
            specs.append((start, n, seq.block_table))
            if s.sample:
                sample_rows.append(row0 + n - 1)
                sample_seqs.append(seq)
            wanted = seq.prompt_logprob_positions(start, n)
            if wanted:
                rows = range(len(prompt_rows), len(prompt_rows) + len(wanted))
                prompt_seqs.append((seq, rows, wanted.start + 1))
                prompt_rows.extend(row0 + p - start for p in wanted)
        dev = self.device
        lora_meta = None
        if self.lora_manager is not None and out.lora_slots:
            lora_meta = LoRABatchMeta.build(
                torch.tensor(token_slots, dtype=torch.int32, device=dev), self.config.max_loras
            )
        ctx = ForwardContext(
            attn=AttentionMetadata.build(
                specs, self.block_size, dev, self.decode_attention, self.prefill_attention
            ),
            lora=lora_meta,
            lora_backend=self.lora_backend,
        )
        self._step_fault()
        # final hidden states of the sampling rows, then of the prompt-logprob rows
        hidden = self.model.hidden_states(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            ctx,
            torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=dev),
        )
        result = ModelRunnerOutput()
        if sample_seqs:
            self._sample_into(result, hidden[: len(sample_rows)], sample_seqs)
        prompt_hidden = hidden[len(sample_rows) :]
        for seq, rows, first in prompt_seqs:
            try:
                result.prompt_logprobs[seq.seq_id] = self._prompt_logprobs(
                    prompt_hidden[rows.start : rows.stop], seq, first
                )
            except Exception as e:  # fails this request only
                result.failed[seq.seq_id] = f"{type(e).__name__}: {e}"
        return result

    def _step_fault(self) -> None:
        if self.faults.take("step"):
            raise InjectedFault("injected step fault (test-only, see engine/faults.py)")

    def _sample_into(
        self, result: ModelRunnerOutput, hidden: torch.Tensor, seqs: list[Sequence]
    ) -> None:
        """Sample one token for each of seqs from its row of hidden [len(seqs), hidden]."""
        if all(_plain_greedy(s) for s in seqs) and not isinstance(self.sampler, DeviceSampler):
            ids = self.model.greedy_ids(hidden)  # what the sampler's argmax would give
            if ids is not None:
                for seq, token in zip(seqs, ids.tolist(), strict=True):
                    result.sampled[seq.seq_id] = SampleResult(token, None, None)
                return
        logits = self.model.compute_logits(hidden)
        if not isinstance(self.sampler, DeviceSampler):
            logits = logits.cpu()
        samples, errors = self.sampler.sample_isolated(logits, seqs)
        for seq, sample, error in zip(seqs, samples, errors, strict=True):
            if error is not None:
                result.failed[seq.seq_id] = error
            else:
                result.sampled[seq.seq_id] = sample

    def init_decode(self, max_model_len: int) -> None:
        """Once the engine knows max_model_len: the persistent decode buffers (and on CUDA the
        captured decode graphs), engine/static_decode.py."""
        self.static_decode = StaticDecode.for_runner(self, max_model_len)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, seq: Sequence, first: int
    ) -> list[dict[int, float]]:
        """Entries for prompt tokens first, first + 1, ... (one per row of hidden: [R, H], the
        row at the position before each). log_softmax over the full vocabulary in fp32, a
        chunk of rows at a time: a 2k-token prompt's logits at once would be 400 MB."""
        k = seq.num_prompt_logprobs or 0
        chunk = max(1, LOGITS_CHUNK_ELEMS // self.args.vocab_size)
        entries: list[dict[int, float]] = []
        for i in range(0, hidden.shape[0], chunk):
            logp = torch.log_softmax(self.model.compute_logits(hidden[i : i + chunk]), dim=-1)
            targets = seq.token_ids[first + i : first + i + logp.shape[0]]
            idx = torch.tensor(targets, device=logp.device)[:, None]
            own = logp.gather(1, idx)[:, 0].tolist()
            top_ids, top_vals = [[]] * len(targets), [[]] * len(targets)
            if k:
                vals, ids = logp.topk(k, dim=-1)
                top_ids, top_vals = ids.tolist(), vals.tolist()
            for t, lp, ids_j, vals_j in zip(targets, own, top_ids, top_vals, strict=True):
                entry = dict(zip(ids_j, vals_j, strict=True))
                entry[t] = lp  # the prompt token itself, as the sampled token in logprobs
                entries.append(entry)
        return entries
