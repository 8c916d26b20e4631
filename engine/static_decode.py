"""Decode-only steps over persistent buffers, eager or replayed from CUDA graphs.

The model runner hands a step here when every scheduled sequence decodes one token and
samples it (no prefill chunk, no prompt logprobs) and the decode attention reads the paged KV
in place (the C++ kernel on the CPU, the Triton kernel on CUDA). The step's inputs are staged
into engine/decode_inputs.py's buffers; the forward then reads only those fixed addresses, so
on a GPU the same step replays from a graph captured per (padded batch size, LoRA on/off)
(engine/cuda_graphs.py). Prefill and mixed steps stay on the eager path
(ModelRunner.execute). `enforce_eager=True` (vLLM's name) turns the graphs off; on the CPU the
same static-buffer path runs eagerly, unpadded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata, DecodeBatch, sdpa_decode_attention
from engine.cuda_graphs import CudaGraph, DecodeGraphs, Graph
from engine.decode_inputs import DecodeInputs, DecodeStep, capture_sizes
from engine.models.llama import ForwardContext
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from raylora_kernels import LoRABatchMeta
from raylora_kernels.metadata import StaticLoRAMeta

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class StaticDecode:
    def __init__(
        self,
        runner: ModelRunner,
        attention_op: Callable[..., None],
        max_model_len: int,
        graph_factory: Callable[[], Graph] | None = None,
        pad_sizes: list[int] | None = None,
    ) -> None:
        """graph_factory: None for eager steps (the CPU), CudaGraph on CUDA, EagerGraph in the
        CPU tests of the capture logic. pad_sizes: the capture sizes (default: vLLM's, up to
        max_num_seqs) when graphs are on; eager steps are padded only when given."""
        cfg = runner.config
        self.runner, self.attention_op = runner, attention_op
        self.block_size = runner.block_size
        if graph_factory is not None and pad_sizes is None:
            pad_sizes = capture_sizes(cfg.max_num_seqs)
        self.inputs = DecodeInputs(
            cfg.max_num_seqs,
            -(-max_model_len // self.block_size),
            self.block_size,
            runner.null_block,
            runner.device,
            pad_sizes,
        )
        self.lora_enabled = runner.lora_manager is not None
        self.steps = 0  # decode steps run here (tests check the path is taken)
        self.graphs: DecodeGraphs | None = None
        if graph_factory is not None:
            modes = (False, True) if self.lora_enabled else (False,)
            self.graphs = DecodeGraphs(self._graph_forward, pad_sizes, modes, graph_factory)
            self.graphs.capture()

    @staticmethod
    def for_runner(runner: ModelRunner, max_model_len: int) -> StaticDecode:
        """The static decode path of this runner: its in-place decode attention (the C++ kernel
        on the CPU, the Triton kernel on CUDA), else SDPA over the gathered table."""
        op = runner.decode_attention or sdpa_decode_attention
        graphs = runner.device.type == "cuda" and not runner.config.enforce_eager
        return StaticDecode(runner, op, max_model_len, CudaGraph if graphs else None)

    def applies(self, out: SchedulerOutput) -> bool:
        return 0 < len(out.scheduled) <= self.inputs.max_num_seqs and all(
            s.num_new_tokens == 1
            and s.sample
            and s.seq.num_computed_tokens > 0
            and not s.seq.prompt_logprob_positions(s.seq.num_computed_tokens, 1)
            for s in out.scheduled
        )

    def run(self, ordered: list[tuple[object, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """ordered: (ScheduledSeq, LoRA slot) in batch order (model_runner.order_by_slot).
        The sequences in row order and their final hidden states [n, hidden]."""
        rows = []
        for s, slot in ordered:
            seq = s.seq
            p = seq.num_computed_tokens
            rows.append((seq.token_ids[p], p, seq.block_table, slot))
        step = self.inputs.stage(rows)
        lora = self.lora_enabled and any(slot >= 0 for _, slot in ordered)
        self.steps += 1
        if self.graphs is not None and (step.padded, lora) in self.graphs.graphs:
            hidden = self.graphs.replay(step.padded, lora)
        else:
            ctx = self._context(step, lora)
            hidden = self.runner.model.hidden_states(step.input_ids, step.positions, ctx, step.rows)
        return [s.seq for s, _ in ordered], hidden[: step.num_seqs]

    def _context(
        self,
        step: DecodeStep,
        lora: bool,
        attn: AttentionMetadata | None = None,
        static_meta: StaticLoRAMeta | None = None,
    ) -> ForwardContext:
        """The step's context: a new one each forward (the backend's per-step route is decided
        from its meta). static_meta: regrouped in place from the staged slots (graphs on the
        Triton backend); else, with LoRA, a host-side LoRABatchMeta built from them."""
        meta = None
        if static_meta is not None:
            meta = static_meta.update_(step.token_slots)
        elif lora:
            meta = LoRABatchMeta.build(step.token_slots, self.runner.config.max_loras)
        return ForwardContext(
            attn=attn or self._attention(step), lora=meta, lora_backend=self.runner.lora_backend
        )

    def _attention(self, step: DecodeStep) -> AttentionMetadata:
        attn = AttentionMetadata(slot_mapping=step.slot_mapping, block_size=self.block_size)
        tables = step.block_tables
        if self.attention_op is sdpa_decode_attention:  # gathers whole rows: only those used
            tables = tables[:, : step.max_blocks]
        attn.decode_batch = DecodeBatch(
            op=self.attention_op, rows=step.rows, tables=tables, lens=step.context_lens
        )
        return attn

    def _graph_forward(self, size: int, lora: bool) -> Callable[[], torch.Tensor]:
        """The forward a graph captures: reads only the persistent buffers. With LoRA on the
        Triton backend, the slot grouping is recomputed inside it from the staged token slots
        (StaticLoRAMeta.update_: device ops, fixed addresses, a grid of (padded rows,
        max_loras)); the torch backend (CPU tests of the capture logic) rebuilds its
        host-side LoRABatchMeta each run instead, which a CUDA graph could not."""
        step = self.inputs.step_views(size, size)
        attn = self._attention(step)
        model, runner = self.runner.model, self.runner
        static_meta = None
        if lora and runner.lora_backend.name == "triton":
            static_meta = StaticLoRAMeta.allocate(size, runner.config.max_loras, runner.device)

        def forward() -> torch.Tensor:
            ctx = self._context(step, lora, attn, static_meta)
            return model.hidden_states(step.input_ids, step.positions, ctx, step.rows)

        return forward
