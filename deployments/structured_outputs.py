"""Structured outputs and forced tool calls at the HTTP door: OpenAI's `response_format` and
`tools` / `tool_choice`, and vLLM's `structured_outputs` (0.1x's `guided_*` too), as one
deployments.protocol.StructuredOutputsSpec for the replica.

Checked here, without torch (xgrammar imports it): the fields' shapes, that at most one
constraint is asked for, that a JSON Schema is valid against its draft's meta-schema
(`jsonschema`), that a named tool exists. What only the grammar engine can tell (a regex or
grammar that does not compile, a schema keyword xgrammar does not enforce) the replica
answers, also with a 400 and also before the request is queued (engine/structured/).

Tools (vLLM's model-agnostic way): a named `tool_choice` constrains the output to that
function's `parameters` schema (the text is its arguments), `"required"` to a JSON array of
`{"name", "parameters"}` objects, one per call, over the given functions.
deployments/tool_calls.py turns the text back into OpenAI `tool_calls`. `"auto"` needs a
parser for the model's own tool-call syntax, and the default model's chat template
(SmolLM2's ChatML) defines none, so it is a 400.
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.protocol import StructuredOutputsSpec, bad_request

StrictBool = Annotated[bool, Field(strict=True)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[str], Field(min_length=1, max_length=4096)]
JSONSchema = dict[str, Any] | str
REQUIRED = "required"  # forced_tool(): any number (>= 1) of calls of any given function


# ---------------------------------------------------------------- request models


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the output follows the schema either way


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: JSONSchema | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Choices | None = None
    grammar: NonEmptyStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    # vLLM's knobs that change nothing here: one backend (no fallback), and xgrammar never
    # generates properties a schema does not list (its strict mode, always on).
    disable_fallback: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatCompletionTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class StructuredOutputFields(BaseModel):
    """The request fields that ask for structured outputs (both endpoints, as in vLLM)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JSONSchema | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmptyStr | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    guided_whitespace_pattern: str | None = None

    def structured_outputs_spec(
        self, tool_spec: StructuredOutputsSpec | None = None
    ) -> StructuredOutputsSpec | None:
        """The one constraint the request asks for (tool_spec: a forced tool's), or None;
        APIError 400 if it asks for two or one is malformed."""
        asked: list[tuple[str, StructuredOutputsSpec]] = []
        if tool_spec is not None:
            asked.append(("tool_choice", tool_spec))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputsSpec(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.json_schema if rf.json_schema is not None else None
            if schema is None:
                raise bad_request(
                    "response_format.json_schema.schema is required for type 'json_schema'",
                    param="response_format",
                )
            param = "response_format.json_schema.schema"
            asked.append(
                ("response_format", StructuredOutputsSpec(json=check_schema(schema, param)))
            )
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", _from_vllm(self.structured_outputs)))
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        for name, value in guided.items():
            if value is not None:
                asked.append((name, _spec(name.removeprefix("guided_"), value, name)))
        if self.guided_whitespace_pattern is not None:
            raise bad_request(
                "guided_whitespace_pattern is not supported (xgrammar has no whitespace "
                "pattern); use structured_outputs.disable_any_whitespace",
                param="guided_whitespace_pattern",
            )
        if len(asked) > 1:
            names = " and ".join(name for name, _ in asked)
            raise bad_request(
                f"only one structured output may be asked for per request, got {names}",
                param=asked[1][0],
            )
        return asked[0][1] if asked else None


def _from_vllm(so: StructuredOutputsField) -> StructuredOutputsSpec:
    if so.whitespace_pattern is not None:
        raise bad_request(
            "structured_outputs.whitespace_pattern is not supported (xgrammar has none); use "
            "disable_any_whitespace",
            param="structured_outputs",
        )
    if so.structural_tag is not None:
        raise bad_request(
            "structured_outputs.structural_tag is not supported", param="structured_outputs"
        )
    kinds = {
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object or None,
    }
    given = [k for k, v in kinds.items() if v is not None]
    if len(given) != 1:
        raise bad_request(
            "structured_outputs needs exactly one of json, regex, choice, grammar and "
            f"json_object, got {given or 'none'}",
            param="structured_outputs",
        )
    kind = given[0]
    spec = _spec(kind, kinds[kind], f"structured_outputs.{kind}")
    spec.disable_any_whitespace = so.disable_any_whitespace
    return spec


def _spec(kind: str, value: Any, param: str) -> StructuredOutputsSpec:
    if kind == "json":
        return StructuredOutputsSpec(json=check_schema(value, param))
    if kind == "json_object":
        return StructuredOutputsSpec(json_object=True)
    return StructuredOutputsSpec(**{kind: value})


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """schema (a dict, or its JSON text) if it is a valid JSON Schema object; APIError 400
    naming the problem and where otherwise."""
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param=param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" (at #/{where})" if where else ""
        raise bad_request(
            f"{param} is not a valid JSON Schema: {e.message}{at}", param=param
        ) from None
    return schema


# ---------------------------------------------------------------- tools


class ToolFields(BaseModel):
    """Chat's tool fields."""

    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def forced_tool(self) -> str | None:
        """The function name a named tool_choice forces, REQUIRED, or None (no tools); APIError
        400 for "auto" (no tool-call parser for this model) or a tool_choice without tools."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return None
        if not self.tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        if choice == "auto":
            raise bad_request(
                'tool_choice "auto" needs a parser for the model\'s own tool-call syntax, and '
                "this model's chat template (SmolLM2's ChatML) defines no tool calling. "
                'Supported: tool_choice "required", a named function ({"type": "function", '
                '"function": {"name": ...}}), or "none"',
                param="tool_choice",
            )
        if choice == REQUIRED:
            return REQUIRED
        name = choice.function.name
        if name not in {t.function.name for t in self.tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return name

    def tool_spec(self) -> StructuredOutputsSpec | None:
        """The constraint of a forced tool call (see the module docstring), or None."""
        forced = self.forced_tool()
        if forced is None:
            return None
        tools = self.tools or []
        params = {}
        for i, t in enumerate(tools):
            schema = t.function.parameters
            if schema is None:  # no parameters: an empty object, as vLLM and OpenAI do
                schema = {"type": "object", "properties": {}}
            params[t.function.name] = check_schema(schema, f"tools.{i}.function.parameters")
        if forced != REQUIRED:
            return StructuredOutputsSpec(json=params[forced])
        return StructuredOutputsSpec(json=required_tools_schema(params, self.parallel_tool_calls))


def required_tools_schema(params: dict[str, dict], parallel: bool | None) -> dict[str, Any]:
    """A JSON array of {"name": <one of the functions>, "parameters": <its schema>} (vLLM's);
    each function's $defs move to the root so its $refs still resolve."""
    defs: dict[str, Any] = {}
    calls = []
    for name, schema in params.items():
        schema = copy.deepcopy(schema)
        for def_name, def_schema in schema.pop("$defs", {}).items():
            if defs.setdefault(def_name, def_schema) != def_schema:
                raise bad_request(
                    f"tools define $defs/{def_name} twice, differently; rename one",
                    param="tools",
                )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
        )
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array
