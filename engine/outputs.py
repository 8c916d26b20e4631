from dataclasses import dataclass, field

from engine.lora.request import LoRARequest


@dataclass
class CompletionOutput:
    """One of a request's n completions. text and token_ids are cumulative (vLLM default)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: token id -> logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    lora_request: LoRARequest | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
    # Only with SamplingParams.prompt_logprobs: one entry per prompt token, entry 0 None (nothing
    # predicts the first token), entry j: token id -> logprob for prompt token j and the top-k.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The engine failed this request: "<ExceptionType>: <message>"; finish_reason is "error".
    error: str | None = None
    # Prompt tokens whose KV came from the prefix cache at the request's first admission
    # (vLLM's field; its first sequence's for n > 1).
    num_cached_tokens: int = 0
