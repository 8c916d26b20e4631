"""Forced tool calls back out of the constrained text (deployments/structured_outputs.py says
what the grammar made the model write): OpenAI `tool_calls`, whole or as stream deltas.

- A named function: the text is its arguments. In a stream, the first delta carries the
  call's id, type and name, the later ones the arguments as they grow (as OpenAI streams).
  finish_reason is the completion's own ("stop"), as OpenAI answers a forced function.
- "required": the text is a JSON array of {"name", "parameters"}. In a stream, each call is
  sent whole as soon as its object closes. finish_reason "tool_calls" (vLLM's).
A completion cut short (finish_reason "length") keeps what could be read: a named function's
partial arguments; for "required", the calls completed so far in a stream, and the raw text
as content (no tool_calls) in a whole response.
"""

from __future__ import annotations

import json
from typing import Any

from deployments.openai_protocol import FunctionCall, ToolCall
from deployments.structured_outputs import REQUIRED

_DECODER = json.JSONDecoder()


def parse_tool_calls(forced: str, text: str) -> list[ToolCall] | None:
    """A completion's tool calls (forced: a function name or REQUIRED); None if the text of a
    "required" completion is not a whole JSON array of calls."""
    if forced != REQUIRED:
        return [ToolCall(function=FunctionCall(name=forced, arguments=text))]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
        return None
    return [_call(c) for c in calls]


def finish_reason(forced: str, reason: str | None) -> str | None:
    return "tool_calls" if forced == REQUIRED and reason == "stop" else reason


def _is_call(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)


def _call(obj: dict[str, Any]) -> ToolCall:
    arguments = json.dumps(obj.get("parameters", {}), ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=arguments))


class ToolCallStream:
    """One choice's forced tool calls, as the `tool_calls` entries of its stream deltas."""

    def __init__(self, forced: str) -> None:
        self.forced = forced
        self.text = ""
        self.pos = 0  # "required": where the next array element starts (or its "," / "[")
        self.num_calls = 0
        self.done = False  # "required": the array closed

    def feed(self, delta: str) -> list[dict[str, Any]]:
        if self.forced != REQUIRED:
            return self._named(delta)
        self.text += delta
        out = []
        while not self.done:
            i = self._skip(self.pos)
            if i < len(self.text) and self.text[i] == "]":
                self.done = True
                break
            if i < len(self.text) and self.text[i] in "[,":
                i = self._skip(i + 1)
            try:
                obj, end = _DECODER.raw_decode(self.text, i)
            except ValueError:  # not closed yet (or not JSON: nothing more to send)
                break
            self.pos = end
            if _is_call(obj):
                out.append(self._entry(_call(obj)))
        return out

    def _named(self, delta: str) -> list[dict[str, Any]]:
        if self.num_calls == 0:
            return [self._entry(ToolCall(function=FunctionCall(name=self.forced, arguments=delta)))]
        if not delta:
            return []
        return [{"index": 0, "function": {"arguments": delta}}]

    def _entry(self, call: ToolCall) -> dict[str, Any]:
        entry = {"index": self.num_calls, **call.model_dump()}
        self.num_calls += 1
        return entry

    def _skip(self, i: int) -> int:
        while i < len(self.text) and self.text[i] in " \t\r\n":
            i += 1
        return i
