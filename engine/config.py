"""EngineConfig: the flat, user-facing knobs (vLLM names) and the validated sub-config tree."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_loras: int
    # Anti-starvation: a waiting adapter request skipped for more than this many steps
    # puts the scheduler in drain mode (see engine/scheduler.py).
    lora_starvation_steps: int


@dataclass(slots=True)
class CacheConfig:
    block_size: int
    # None: planned once the model is loaded (CUDA: gpu_memory_utilization; CPU:
    # kv_cache_memory_gb), see engine/memory.py
    num_kv_blocks: int | None
    kv_cache_memory_gb: float
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9


@dataclass(slots=True)
class LoRAConfig:
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_backend: str  # "auto" (triton on CUDA, torch on CPU) | "torch" | "triton"
    lora_dtype: str = "auto"  # the slots' weights: "auto" (the model's dtype) or a dtype name


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    tokenizer: str | None = None
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 4096)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: planned from the memory below
    # CUDA (vLLM's name): the fraction of the device's memory this engine may use; the KV
    # cache gets what the model, the LoRA slots and a profiled step leave (engine/memory.py).
    gpu_memory_utilization: float = 0.9
    # CPU only (as vLLM's VLLM_CPU_KVCACHE_SPACE): the KV cache's size in GiB.
    kv_cache_memory_gb: float = 1.0
    # Automatic prefix caching (vLLM's name and v1 default): reuse the KV of full blocks of
    # an earlier prompt with the same prefix under the same adapter (engine/block_manager.py).
    enable_prefix_caching: bool = True
    enable_lora: bool = True
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 32
    lora_backend: str = "auto"
    # dtype of the slots' LoRA weights (vLLM's lora_dtype): "auto" = the model's dtype. On the
    # CPU, "bfloat16" under an fp32 model halves the bytes a decode step reads (the C++
    # kernel widens them to fp32 in registers; the math stays fp32).
    lora_dtype: str = "auto"
    lora_starvation_steps: int = 32
    max_n: int = 16
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    seed: int = 0
    # vLLM's name: True runs every GPU decode step eagerly instead of replaying the CUDA graphs
    # captured at start-up (engine/cuda_graphs.py). The CPU always runs eagerly.
    enforce_eager: bool = False
    # a few dummy requests through the engine before it serves, so the first real ones do not
    # wait for Triton kernel compiles (engine/warmup.py). None: on CUDA only.
    warm_up: bool | None = None
    scheduler: SchedulerConfig = field(init=False)
    cache: CacheConfig = field(init=False)
    lora: LoRAConfig = field(init=False)

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "lora_starvation_steps": self.lora_starvation_steps,
            "max_n": self.max_n,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.warm_up is not None and not isinstance(self.warm_up, bool):
            raise ValueError(f"warm_up must be True, False or None, got {self.warm_up!r}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.lora_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"lora_backend must be auto, torch or triton, got {self.lora_backend!r}"
            )
        for name in ("dtype", "lora_dtype"):
            if getattr(self, name) not in ("auto", "float32", "bfloat16", "float16"):
                raise ValueError(
                    f"{name} must be auto, float32, bfloat16 or float16, "
                    f"got {getattr(self, name)!r}"
                )
        self.scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or 0,  # filled in by finalize()
            max_loras=self.max_loras if self.enable_lora else 0,
            lora_starvation_steps=self.lora_starvation_steps,
        )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        self.cache = CacheConfig(
            self.block_size,
            self.num_kv_blocks,
            self.kv_cache_memory_gb,
            self.enable_prefix_caching,
            float(self.gpu_memory_utilization),
        )
        self.lora = LoRAConfig(
            self.enable_lora,
            self.max_loras,
            self.max_lora_rank,
            self.max_cpu_loras,
            self.lora_backend,
            self.lora_dtype,
        )

    def finalize(self, model_max_len: int, num_kv_blocks: int) -> None:
        """Fill in what depends on the loaded model."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, 4096)
        elif self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's {model_max_len}"
            )
        self.scheduler.max_model_len = self.max_model_len
        self.cache.num_kv_blocks = num_kv_blocks
