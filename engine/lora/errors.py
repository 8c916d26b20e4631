"""Exceptions for LoRA adapters that cannot be found or cannot be served.

The HTTP layer maps them to status codes: `LoRANotFoundError` -> 404, every
`InvalidLoRAError` -> 400. Each message names the adapter and the exact problem.
"""

from __future__ import annotations


class LoRAError(ValueError):
    """Base class of every adapter error. `lora_name` is the adapter's name, when known."""

    def __init__(self, message: str, lora_name: str | None = None) -> None:
        super().__init__(message)
        self.lora_name = lora_name


class LoRANotFoundError(LoRAError):
    """The adapter's folder does not exist, or its Hub repo is missing / not cached offline. HTTP 404."""


class InvalidLoRAError(LoRAError):
    """The adapter exists but cannot be served on this model. HTTP 400."""


class AdapterConfigError(InvalidLoRAError):
    """adapter_config.json is missing, not JSON, or lacks / has a bad r, lora_alpha or target_modules."""


class LoRARankError(InvalidLoRAError):
    """The adapter's rank is above the engine's max_lora_rank."""


class UnsupportedTargetModuleError(InvalidLoRAError):
    """The adapter targets a module the model has not got (or one the engine cannot adapt)."""


class UnsupportedLoRAFeatureError(InvalidLoRAError):
    """DoRA, modules_to_save, LoRA bias, rank/alpha patterns and other PEFT extras."""


class LoRAShapeError(InvalidLoRAError):
    """A weight's shape does not match the base model (e.g. built for another hidden size)."""


class CorruptLoRAWeightsError(InvalidLoRAError):
    """The weight file is missing, unreadable, or its tensors do not match adapter_config.json."""


__all__ = [
    "LoRAError",
    "LoRANotFoundError",
    "InvalidLoRAError",
    "AdapterConfigError",
    "LoRARankError",
    "UnsupportedTargetModuleError",
    "UnsupportedLoRAFeatureError",
    "LoRAShapeError",
    "CorruptLoRAWeightsError",
]
