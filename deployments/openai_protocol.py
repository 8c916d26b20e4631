"""OpenAI-compatible request and response models (as vLLM serves them), validated at the door.

Requests are parsed leniently about fields nobody uses (unknown fields are ignored, as
OpenAI's and vLLM's servers do) and strictly about values: every number is finite and of the
JSON type the API documents (no strings, no booleans for numbers), within vLLM's ranges, so
no request reaches a replica with a value the engine cannot take. Fields raylora cannot
honour are rejected with a 400 rather than silently dropped. The one check that needs the
tokenized prompt (prompt + max_tokens <= max_model_len) is the engine's. Structured outputs
and tools have their fields in deployments/structured_outputs.py.
"""

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deployments.protocol import APIError, SamplingSpec, bad_request
from deployments.structured_outputs import StructuredOutputFields, ToolFields

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_PROMPTS = 256  # prompts in one batched /v1/completions request
MAX_STOP = 16  # stop strings per request
MAX_N = 128  # the engine's own max_n (default 16) is checked by the replica
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Int = Annotated[int, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0)]

# vLLM sampling extensions that change results and that raylora does not implement, with the
# value that means "off": any other value is a 400, not a silently different answer.
UNSUPPORTED_EXTENSIONS: dict[str, Any] = {
    "min_tokens": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "prompt_logprobs": None,
    "bad_words": None,
    "allowed_token_ids": None,
}


# What a field that takes several JSON shapes must be (pydantic reports each union member).
UNION_FIELDS = {
    "prompt": "a non-empty string, a list of token ids, a list of strings or a list of "
    "token id lists",
    "stop": "a non-empty string or a list of non-empty strings",
}


def _loc(parts: tuple) -> str:
    """A readable path: field names and list indices, without pydantic's union-member tags."""
    kept = [str(p) for p in parts if isinstance(p, int) or str(p).isidentifier()]
    kept = [p for p in kept if p not in ("body", "str", "int", "float", "bool", "list", "dict")]
    return ".".join(kept)


def validation_error_to_api(err: ValidationError) -> APIError:
    errors = err.errors()
    first = errors[0]
    loc = _loc(first.get("loc", ()))
    field = loc.split(".")[0] if loc else None
    if field in UNION_FIELDS and len(errors) > 1:
        return APIError(400, f"{field} must be {UNION_FIELDS[field]}", param=field)
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=field)


def validate_as(model: type[BaseModel], value: Any) -> Any:
    """`value` as a `model` instance (validated from a dict if need be); APIError 400 if invalid."""
    if isinstance(value, model):
        return value
    if not isinstance(value, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_error_to_api(e) from None


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Field(strict=True)] = False


class _SamplingFields(StructuredOutputFields):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1)]
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)] | None = None
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)] | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = 0.0
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    ignore_eos: Annotated[bool, Field(strict=True)] = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP * 4)] | None = None
    skip_special_tokens: Annotated[bool, Field(strict=True)] = True

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if (
            isinstance(self.stop, str)
            and not self.stop
            or (isinstance(self.stop, list) and not all(self.stop))
        ):
            raise ValueError("stop strings must not be empty")
        return self

    def _reject_unsupported(self) -> None:
        if self.presence_penalty not in (None, 0, 0.0):
            raise bad_request("presence_penalty is not supported", param="presence_penalty")
        if self.frequency_penalty not in (None, 0, 0.0):
            raise bad_request("frequency_penalty is not supported", param="frequency_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        for name, off in UNSUPPORTED_EXTENSIONS.items():
            value = (self.model_extra or {}).get(name, off)
            if value != off and not (off is None and value in ([], {})):
                raise bad_request(f"{name} is not supported by raylora", param=name)

    def _spec(self, max_tokens: int | None) -> SamplingSpec:
        """The SamplingSpec; OpenAI's defaults where the request is silent."""
        self._reject_unsupported()
        tool_spec = self.tool_spec() if isinstance(self, ToolFields) else None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingSpec(
            n=self.n,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_spec(tool_spec),
        )


Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1),
    ]
)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    echo: Annotated[bool, Field(strict=True)] = False
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token lists)."""
        p = self.prompt
        batch = p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]
        if len(batch) > MAX_PROMPTS:
            raise bad_request(
                f"a request may carry at most {MAX_PROMPTS} prompts, got {len(batch)}",
                param="prompt",
            )
        return batch

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (lm-eval does this)."""
        return self.echo and self.max_tokens == 0

    def sampling_spec(self) -> SamplingSpec:
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        if self.best_of not in (None, self.n):
            raise bad_request("best_of != n is not supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        # echo_only runs one token (the engine always samples one) and drops it, as vLLM does
        spec = self._spec(1 if self.echo_only else self.max_tokens)
        spec.logprobs = self.logprobs
        if self.echo and self.logprobs is not None:
            spec.prompt_logprobs = self.logprobs
        return spec

    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if self.content is None and self.tool_calls:
            # the template has no tool syntax: the calls as the JSON the model was made to write
            calls = [c.get("function", c) for c in self.tool_calls]
            return json.dumps(calls, ensure_ascii=False)
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"content part type {part.get('type')!r} is not supported (text only)",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    logprobs: Annotated[bool, Field(strict=True)] = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        # OpenAI's "developer" role is the system prompt of newer models
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]

    def sampling_spec(self) -> SamplingSpec:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        spec = self._spec(self.max_completion_tokens or self.max_tokens)
        if self.logprobs:
            spec.logprobs = self.top_logprobs or 0
        return spec

    def default_max_tokens(self) -> int | None:
        return None  # vLLM's chat default: up to the context limit


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: Int | None = None


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProb] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # only when the request forced a tool call (left out of the JSON otherwise)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raylora"
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
