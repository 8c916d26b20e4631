"""Structured outputs: grammar-constrained sampling on xgrammar (vLLM's default backend)."""

from engine.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
