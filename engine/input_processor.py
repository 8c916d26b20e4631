"""Turns user input (text, token ids, chat messages) into validated prompt token ids."""

from typing import Any

from engine.errors import InvalidRequestError, PromptTooLongError


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids); raises InvalidRequestError."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): "
                    f"{bad[:5]}"
                )
            ids = list(ids)
        else:
            raise InvalidRequestError("prompt must be a string or a dict with 'prompt_token_ids'")
        if not ids:
            raise InvalidRequestError("prompt must not be empty (it has no tokens)")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the maximum is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for one new token)"
            )
        return text, ids

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError("each message needs 'role' and 'content'")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
