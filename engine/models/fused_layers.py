"""The fused C++ forward's side of the model: which batches it takes and its arguments.

    model.enable_fused_layers(op)        # LlamaForCausalLM, after pack_cpu_weights
    if model.fused.applies(ctx):
        hidden = model.fused(op, x, cos, sin, ctx, rows)    # [S, hidden] of rows [S]

`op` is raylora_cpu::forward_layers (raylora_kernels/csrc/layers_cpu.cpp): every decoder layer of a
batch of decode tokens and prefill chunks in one C++ call. The model's weights, biases and
LoRA linears are listed here once, in the op's order, when it is enabled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.models.llama import ForwardContext, LlamaForCausalLM

# slot weight dtypes the C++ LoRA kernel reads (widened to fp32 in registers)
FUSED_LORA_DTYPES = (torch.float32, torch.bfloat16)


class FusedLayers:
    def __init__(self, model: LlamaForCausalLM) -> None:
        a = model.args
        self.model = model
        # qkv, o, gate_up, down of each layer in turn: forward_layers' order of LoRA arguments
        self.lora_linears = list(model.lora_linears().values())
        self.weights = [
            w
            for layer in model.layers
            for w in (
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.weight.data,
                layer.self_attn.o_proj.weight.data,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight.data,
                layer.mlp.down_proj.weight.data,
            )
        ]
        self.biases = [layer.self_attn.qkv_proj.bias for layer in model.layers]
        self.dims = [a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size]

    def applies(self, ctx: ForwardContext) -> bool:
        """Every row's attention on the C++ kernels (no SDPA buckets or chunks), and no LoRA or
        a LoRA batch the C++ kernel takes (the CPU backend's route for it: tokens grouped by
        slot, at most its cap a slot; fp32/bf16 slots)."""
        md, slots = ctx.attn, self.lora_linears[-1].lora if self.lora_linears else None
        return (
            not md.prefills
            and not md.decodes
            and (md.decode_batch is not None or md.prefill_batch is not None)
            and (
                ctx.lora is None
                or ctx.lora.no_lora
                or (
                    getattr(ctx.lora_backend, "kernel_batch", False)
                    and slots is not None
                    and slots.a.dtype in FUSED_LORA_DTYPES
                )
            )
        )

    def lora_args(self, ctx: ForwardContext) -> tuple[list, list, torch.Tensor | None]:
        """forward_layers' LoRA arguments: a and b_t of qkv, o, gate_up, down of every layer,
        their ranks, the batch's segments; empty for a base batch."""
        if ctx.lora is None or ctx.lora.no_lora:
            return [], [], None
        slots = [lin.lora for lin in self.lora_linears]
        weights = [t for w in slots for t in (w.a, w.b_t)]
        return weights, [w.ranks for w in slots], ctx.lora.segments

    def __call__(
        self,
        op: Any,
        x: torch.Tensor,  # [T, hidden] embeddings
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        ctx: ForwardContext,
        rows: torch.Tensor,  # [S] the rows whose hidden states are wanted
    ) -> torch.Tensor:  # [S, hidden], after the last layer (before the final norm)
        md, attn = ctx.attn, [layer.self_attn for layer in self.model.layers]
        d, p = md.decode_batch, md.prefill_batch
        return op(
            x,
            cos[:, 0].contiguous(),
            sin[:, 0].contiguous(),
            self.weights,
            self.biases,
            [a.k_cache for a in attn],
            [a.v_cache for a in attn],
            md.slot_mapping,
            *((d.rows, d.tables, d.lens) if d is not None else (None, None, None)),
            *((p.chunks, p.tables) if p is not None else (None, None)),
            [*self.dims, md.block_size],
            self.model.args.rms_norm_eps,
            attn[0].scale,
            *self.lora_args(ctx),
            rows,
        )
