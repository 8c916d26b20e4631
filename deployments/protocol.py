"""The replica boundary: what crosses the two Ray hops (caller -> LLMServer -> caller).

Typed dataclasses, not dicts: `GenerateRequest` goes in, a stream of `ReplicaOutput` comes
back, and errors travel as `APIError`, so a caller never unpickles engine classes (and never
imports torch for it). The OpenAI request and response models of the HTTP surface are in
deployments/openai_protocol.py.

- The request id is minted once, by whoever builds the GenerateRequest (the ingress, or a
  handle caller), and it is the engine's request id.
- The adapter travels once, as the handle's multiplexed model id ("" = the base model): that
  is what the request router routes on and what the replica serves.
- `SamplingSpec` mirrors engine.SamplingParams field for field (this module must not import
  the engine); the replica builds SamplingParams from it, and the engine validates it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- errors

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the HTTP layer returns as OpenAI's error JSON with `status`.

    Raised by the ingress and by LLMServer (and re-raised by deployments.client for handle
    callers).
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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------- ingress -> replica


@dataclass(slots=True)
class StructuredOutputsSpec:
    """engine.sampling_params.StructuredOutputsParams' fields: exactly one of json (a JSON
    Schema), regex, choice, grammar (EBNF) and json_object is set."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        """StructuredOutputsParams(**engine_kwargs())."""
        return {
            "json": self.json,
            "regex": self.regex,
            "choice": list(self.choice) if self.choice is not None else None,
            "grammar": self.grammar,
            "json_object": self.json_object,
            "disable_any_whitespace": self.disable_any_whitespace,
        }


@dataclass(slots=True)
class SamplingSpec:
    """engine.SamplingParams' fields (see engine/sampling_params.py for their meaning)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16  # None: up to the context limit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top logprobs per generated token
    prompt_logprobs: int | None = None  # top logprobs per prompt token
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsSpec | None = None  # constrain the output

    def engine_kwargs(self) -> dict[str, Any]:
        """SamplingParams(**engine_kwargs()); structured_outputs travels as a dict, which
        SamplingParams turns into its StructuredOutputsParams."""
        so = self.structured_outputs
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop": list(self.stop) or None,
            "stop_token_ids": list(self.stop_token_ids) or None,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "structured_outputs": so.engine_kwargs() if so is not None else None,
        }


@dataclass(slots=True)
class GenerateRequest:
    """One generation request to an LLMServer replica. Exactly one of prompt,
    prompt_token_ids and messages is set."""

    request_id: str
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # chat: [{"role", "content"}]
    # When sampling.max_tokens is None: at most this many new tokens, and never more than the
    # context leaves (an explicit max_tokens that does not fit is a 400, as in vLLM). None:
    # up to the context limit.
    default_max_tokens: int | None = None
    # The first output carries the prompt's text (decoded if it came as token ids).
    echo: bool = False

    def check(self) -> None:
        """APIError 400 unless exactly one prompt form is set."""
        forms = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(self, f)]
        if len(forms) != 1:
            raise bad_request(
                "a GenerateRequest needs exactly one of prompt, prompt_token_ids and messages"
                f" (got {forms or 'none'})",
                param="prompt",
            )
        if not isinstance(self.request_id, str) or not self.request_id:
            raise bad_request("request_id must be a non-empty string")


# ---------------------------------------------------------------- replica -> caller


@dataclass(slots=True)
class TokenLogprob:
    """One token's logprob and the top alternatives at its position (token text -> logprob).
    logprob is None for a prompt's first token, which nothing predicts."""

    token: str
    logprob: float | None
    top: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionDelta:
    """What one of the n completions gained: in a stream the new part only, in
    LLMServer.complete the whole completion."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, if asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None


@dataclass(slots=True)
class ReplicaOutput:
    """One step's news for one request. The prompt fields are set on the first output only."""

    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionDelta]
    finished: bool
    prompt: str | None = None  # with GenerateRequest.echo
    # one per prompt token (the first one's logprob is None), with sampling.prompt_logprobs
    prompt_logprobs: list[TokenLogprob] | None = None
    # prompt tokens whose KV came from the replica's prefix cache (RequestOutput's field)
    num_cached_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
