"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2's q/k/v bias) over a paged KV cache.

q/k/v and gate/up are packed into one matmul each; LoRA applies per slice of the packed
output through raylora_kernels.lora_shrink / lora_expand.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.models.fused_layers import FusedLayers
from raylora_kernels import LoRABackend, LoRABatchMeta, SlotWeights, base_linear
from raylora_kernels.cpu_kernel import cpu_greedy_head_op
from raylora_kernels.packed_weight import GreedyHead, PackedWeight

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @staticmethod
    def from_hf_config(cfg: dict) -> "ModelArgs":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch}; raylora serves {SUPPORTED_ARCHITECTURES}"
            )
        heads = cfg["num_attention_heads"]
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0
        )
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        return ModelArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
        )

    def lora_module_shapes(self) -> dict[str, tuple[int, int]]:
        """HF module name -> (out_features, in_features)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }


# packed module -> the HF modules it holds, in slice order
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoRABatchMeta | None  # None or no_lora: base-only batch, no LoRA work at all
    # The engine's LoRA backend (raylora_kernels.make_lora_backend, chosen once per engine), replaced
    # when the context is built by itself prepared with `lora`: this step's route, decided once
    # for every LoRA linear, held by this context alone (one built ahead for a CUDA graph keeps
    # its own, whatever steps run in between).
    lora_backend: LoRABackend

    def __post_init__(self) -> None:
        self.lora_backend = self.lora_backend.prepare(self.lora)


class LoRALinear(nn.Module):
    """y = x W^T (+ b) + per-token LoRA of the token's slot, slice by slice."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes)), requires_grad=False) if bias else None
        self.lora: SlotWeights | None = None  # the max_loras slots, set by the LoRA manager

    def pack_weight(self) -> None:
        """Replace the weight by its PackedWeight (C++ CPU GEMM layout; pack_cpu_weights)."""
        packed = PackedWeight.pack(self.weight)
        del self.weight  # the parameter: keep one copy of the bytes
        self.weight = packed

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # the prepared backend: base GEMM only when the step or this layer has no LoRA
        return ctx.lora_backend.linear(x, self.weight, self.bias, self.lora)


class PackedEmbedding(nn.Module):
    """A tied embedding read from its lm_head's PackedWeight (the same matrix, kept once)."""

    def __init__(self, packed: PackedWeight) -> None:
        super().__init__()
        self.packed = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.packed.rows(ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    d = args.head_dim
    # on the CPU even under build_model's meta device: meta arange goes through torch._refs
    pos = torch.arange(0, d, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (args.rope_theta ** (pos / d))
    s = args.rope_scaling
    if s is None:
        return inv_freq.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv_freq / s["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling {s}")
    # Llama 3.1 frequency-dependent scaling (same formula as HF's _compute_llama3_parameters)
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D] (HF's rotate_half convention)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = LoRALinear(a.hidden_size, [q, kv, kv], bias=a.qkv_bias)
        self.o_proj = LoRALinear(q, [a.hidden_size])
        self.scale = a.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)
        self.rope_op = None  # LlamaForCausalLM.enable_cpu_elementwise

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x, ctx)
        if self.rope_op is not None:  # one pass over q and k, no temporaries
            q, k = self.rope_op(qkv, cos.view(t, d), sin.view(t, d), h, hkv, d)
        else:
            q, k, _ = qkv.split(self.qkv_proj.out_sizes, dim=-1)
            q = apply_rope(q.view(t, h, d), cos, sin)
            k = apply_rope(k.view(t, hkv, d), cos, sin)
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, ctx.attn, self.scale)
        return self.o_proj(o.reshape(t, -1), ctx)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = LoRALinear(a.hidden_size, [a.intermediate_size] * 2)
        self.down_proj = LoRALinear(a.intermediate_size, [a.hidden_size])
        self.intermediate_size = a.intermediate_size
        self.silu_and_mul_op = None  # LlamaForCausalLM.enable_cpu_elementwise

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, ctx)
        if self.silu_and_mul_op is not None:
            return self.down_proj(self.silu_and_mul_op(gate_up, self.intermediate_size), ctx)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, ctx)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class LlamaForCausalLM(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.args = a
        # _weight: no random init (the loader fills it); on the meta device normal_ would go
        # through torch._refs, whose first use imports torch._dynamo: 1.7 s of start-up
        weight = torch.empty(a.vocab_size, a.hidden_size, requires_grad=False)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.packed_head: PackedWeight | None = None  # pack_cpu_weights
        self.greedy_head: GreedyHead | None = None  # pack_cpu_weights, where AVX512-BF16
        self.fused_layers_op = None  # enable_fused_layers
        self.fused: FusedLayers | None = None
        self.register_buffer("inv_freq", rope_inv_freq(a), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: ForwardContext,
        logits_rows: torch.Tensor,  # [S] rows whose logits are needed
    ) -> torch.Tensor:  # [S, vocab] float32
        return self.compute_logits(self.hidden_states(input_ids, positions, ctx, logits_rows))

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: ForwardContext,
        rows: torch.Tensor,  # [S] rows whose final (normed) hidden states are needed
    ) -> torch.Tensor:  # [S, hidden]
        x = self.embed_tokens(input_ids)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if self.fused_layers_op is not None and self.fused.applies(ctx):
            # the rows alone come back (their last layer runs them alone, too)
            return self.norm(self.fused(self.fused_layers_op, x, cos, sin, ctx, rows))
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        # only the rows that need logits go on: the vocab projection dominates small batches
        return self.norm(x[rows])

    def enable_cpu_elementwise(self, ops) -> None:
        """Float32 on the CPU: the Python layers' rope and silu-and-mul as one C++ pass each
        (raylora_kernels.cpu_kernel.cpu_elementwise_ops; prefill and LoRA batches run these layers)."""
        silu_and_mul, rope_qk = ops
        for layer in self.layers:
            layer.self_attn.rope_op = rope_qk
            layer.mlp.silu_and_mul_op = silu_and_mul

    def enable_fused_layers(self, op) -> None:
        """After pack_cpu_weights: run batches whose attention the C++ kernels take (decode
        tokens and prefill chunks, in any mix), without LoRA or with a LoRA batch the C++
        kernel takes, through `op` (raylora_kernels.cpu_kernel.cpu_forward_layers_op: every layer in
        one C++ call, the same kernels; csrc/layers_cpu.cpp says why). `fused_layers_op = None`
        turns it off again."""
        self.fused_layers_op = op
        self.fused = FusedLayers(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] from hidden_states -> logits [S, vocab] float32."""
        return base_linear(hidden, self.head_weight, None).float()

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(compute_logits(hidden), -1), the same ids, without the float32 logits (the
        packed lm_head's bfloat16 screen, GreedyHead); None where it is not built."""
        return None if self.greedy_head is None else self.greedy_head(hidden)

    @property
    def head_weight(self) -> torch.Tensor | PackedWeight:
        return self.lm_head.weight if self.packed_head is None else self.packed_head

    def pack_cpu_weights(self) -> None:
        """After load_weights, on a float32 CPU model with the C++ kernels: every linear's
        weight, lm_head's too, in the packed GEMM's layout (raylora_kernels/packed_weight.py), one
        layer at a time, the plain copies freed (lm_head's is a copy of the embedding's even
        when tied, see load_weights). A tied embedding is then looked up in the packed copy
        and its own freed (113 MB for SmolLM2-135M)."""
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, LoRALinear):
                    module.pack_weight()
        self.packed_head = PackedWeight.pack(self.lm_head.weight)
        del self.lm_head
        self.greedy_head = GreedyHead.build(self.packed_head, cpu_greedy_head_op())
        if self.args.tie_word_embeddings:
            self.embed_tokens = PackedEmbedding(self.packed_head)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, packing q/k/v and gate/up."""
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        own = dict(self.named_parameters())
        with torch.no_grad():
            own["embed_tokens.weight"].copy_(sd["embed_tokens.weight"])
            own["norm.weight"].copy_(sd["norm.weight"])
            head = sd.get("lm_head.weight")
            if head is None or self.args.tie_word_embeddings:
                head = sd["embed_tokens.weight"]
            own["lm_head.weight"].copy_(head)
            for i in range(self.args.num_layers):
                p = f"layers.{i}."
                for name in ("input_layernorm", "post_attention_layernorm"):
                    own[p + name + ".weight"].copy_(sd[p + name + ".weight"])
                for packed, parts in PACKED_MODULES.items():
                    sub = "self_attn." if packed in ("qkv_proj", "o_proj") else "mlp."
                    w = torch.cat([sd[f"{p}{sub}{m}.weight"] for m in parts])
                    own[f"{p}{sub}{packed}.weight"].copy_(w)
                    if f"{p}{sub}{packed}.bias" in own:
                        b = torch.cat([sd[f"{p}{sub}{m}.bias"] for m in parts])
                        own[f"{p}{sub}{packed}.bias"].copy_(b)

    def lora_linears(self) -> dict[tuple[int, str], LoRALinear]:
        """(layer index, packed module name) -> the LoRALinear that holds it."""
        out = {}
        for i, layer in enumerate(self.layers):
            out[(i, "qkv_proj")] = layer.self_attn.qkv_proj
            out[(i, "o_proj")] = layer.self_attn.o_proj
            out[(i, "gate_up_proj")] = layer.mlp.gate_up_proj
            out[(i, "down_proj")] = layer.mlp.down_proj
        return out
