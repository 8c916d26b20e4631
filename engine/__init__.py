"""raylora's single-replica engine (no Ray in here), with vLLM's names.

The names below load on first use (PEP 562), so that torch-free modules of the package
(`engine.hub`, `engine.paths`) can be imported where torch is not wanted: the ingress,
serve_app's argument checks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_llm_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.lora.request import LoRARequest
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams

_WHERE = {
    "LLM": "engine.llm",
    "AsyncLLMEngine": "engine.async_llm_engine",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "LoRARequest": "engine.lora.request",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
