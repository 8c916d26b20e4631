"""Exceptions the engine raises for bad input. The HTTP layer maps them to status codes."""


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling params, duplicate id). HTTP 400."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one new token) does not fit in max_model_len. HTTP 400."""
