"""OpenAI-compatible request/response models and the error shape (as vLLM serves them).

Requests are parsed leniently (unknown fields are ignored, as OpenAI's and vLLM's servers
do); fields raylora cannot honour are rejected with a 400 rather than silently dropped.
Responses are built as these models and sent as JSON.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error the HTTP layer returns as OpenAI's error JSON with `status`.

    Raised by the ingress (and re-raised by deployments.client for handle callers).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __reduce__(self):  # keep the fields when pickled across Ray processes
        return (APIError, (self.status, self.message, self.type, self.param, self.code))


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error_to_api(err: ValidationError) -> APIError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = first.get("msg", "invalid request")
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def _reject_unsupported(self) -> None:
        if self.presence_penalty not in (None, 0, 0.0):
            raise bad_request("presence_penalty is not supported", param="presence_penalty")
        if self.frequency_penalty not in (None, 0, 0.0):
            raise bad_request("frequency_penalty is not supported", param="frequency_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (batched prompts are not supported)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(
                    "batched prompts are not supported; send one prompt per request",
                    param="prompt",
                )
            p = p[0]
        if isinstance(p, str) and not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(p, list) and not p:
            raise bad_request("prompt must not be empty", param="prompt")
        return p

    def sampling_params(self) -> dict[str, Any]:
        self._reject_unsupported()
        if self.best_of not in (None, self.n):
            raise bad_request("best_of != n is not supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        params = _common_params(self, self.max_tokens if self.max_tokens is not None else 16)
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise bad_request(
                    f"content part type {part.get('type')!r} is not supported (text only)",
                    param="messages",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise bad_request("only response_format type 'text' is supported", "response_format")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_params(self) -> dict[str, Any]:
        self._reject_unsupported()
        max_tokens = self.max_completion_tokens or self.max_tokens
        # vLLM's chat default: up to the context limit; a fixed default keeps CPU replicas sane.
        params = _common_params(self, max_tokens if max_tokens is not None else 256)
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        return params


def _common_params(req: _SamplingFields, max_tokens: int) -> dict[str, Any]:
    """SamplingParams kwargs; OpenAI's defaults where the request is silent."""
    params: dict[str, Any] = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_tokens": max_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    if req.top_k is not None:
        params["top_k"] = req.top_k
    if req.stop:
        params["stop"] = req.stop
    if req.stop_token_ids:
        params["stop_token_ids"] = req.stop_token_ids
    if req.seed is not None:
        params["seed"] = req.seed
    return params


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


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


def validate_as(model: type[BaseModel], value: Any) -> Any:
    """`value` as a `model` instance (validated from a dict if need be); APIError 400 if invalid."""
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_error_to_api(e) from None
