"""raylora's single-replica engine (no Ray in here), with vLLM's names."""

from engine.async_llm_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
