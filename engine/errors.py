"""Exceptions the engine raises. The HTTP layer maps them to status codes."""


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling params, duplicate id). HTTP 400."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one new token) does not fit in max_model_len. HTTP 400."""


class ContextLengthError(InvalidRequestError):
    """The prompt fits, but the prompt plus max_tokens does not fit in max_model_len. HTTP 400."""

    def __init__(self, max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> None:
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
            "or the completion."
        )


class RequestFailedError(RuntimeError):
    """The engine failed this one request (a step that ran it raised); the engine lives on.

    `reason` is "<ExceptionType>: <message>" of what raised (RequestOutput.error).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineDeadError(RuntimeError):
    """The engine's background loop died (a bug outside one request); every request fails."""


class InjectedFault(RuntimeError):
    """Raised on purpose by a test-only fault injection (engine/faults.py)."""
