"""What goes in and out of an LLMServer replica besides the engine itself: catalog entries for
adapter folders, engine outputs as the replica's output dicts (the format
deployments/responses.py turns into OpenAI responses), engine errors as APIError.

Engine imports stay inside the functions: the ingress imports this package without torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deployments.protocol import APIError


def adapter_entry(name: str, path: str, base_model: str) -> dict[str, Any]:
    """A catalog entry (the registry's spec) for a PEFT folder, read from adapter_config.json.

    A Hub repo id (not a local folder) gets rank 1 and no target modules until a replica
    loads it; the engine validates every adapter when it loads it anyway.
    """
    folder = Path(path).expanduser()
    rank, targets = 1, []
    cfg_file = folder / "adapter_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        rank = int(cfg.get("r", 1))
        t = cfg.get("target_modules") or []
        targets = [t] if isinstance(t, str) else list(t)
    elif folder.is_absolute() or path.startswith((".", "~")):
        raise FileNotFoundError(f"adapter {name!r}: {path} has no adapter_config.json")
    return {"source": str(path), "rank": rank, "target_modules": targets, "base_model": base_model}


def initial_adapters(adapters: dict[str, str] | None, demo_adapters: bool) -> dict[str, str]:
    """name -> path of the adapters a replica starts with: `adapters`, plus the demo adapters
    found on disk (engine.lora.demo) when demo_adapters is set."""
    found = dict(adapters or {})
    if demo_adapters:
        from engine.lora.demo import DEMO_ADAPTERS, demo_adapter_dir, is_demo_adapter_present

        for name in DEMO_ADAPTERS:
            if name not in found and is_demo_adapter_present(name):
                found[name] = str(demo_adapter_dir(name))
    return found


def to_api_error(exc: BaseException) -> BaseException:
    """Engine exception -> APIError with its HTTP status; anything else is returned as is."""
    from engine.errors import InvalidRequestError, PromptTooLongError
    from engine.lora.errors import InvalidLoRAError, LoRAError, LoRANotFoundError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LoRANotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, (InvalidLoRAError, LoRAError)):
        return APIError(400, str(exc), param="model", code="invalid_adapter")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc))
    return exc


def output_dict(out, completions: list[dict], first: bool) -> dict[str, Any]:
    """One engine RequestOutput as the replica's output dict (see deployments/responses.py)."""
    return {
        "request_id": out.request_id,
        "prompt": out.prompt if first else None,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "outputs": completions,
        "finished": out.finished,
    }


def completion_dict(
    o, num_chars: int, num_tokens: int, end: int | None, token_text: Callable[[int], str]
) -> dict[str, Any]:
    """One completion from character num_chars (to end) and token num_tokens on: the new part
    of a stream, or all of it from (0, 0)."""
    new_ids = list(o.token_ids[num_tokens:])
    logprobs = None
    if o.logprobs is not None:
        logprobs = [
            logprob_entry(tid, lp, token_text)
            for tid, lp in zip(new_ids, o.logprobs[num_tokens:], strict=False)
        ]
    return {
        "index": o.index,
        "text": o.text[num_chars:end],
        "token_ids": new_ids,
        "logprobs": logprobs,
        "finish_reason": o.finish_reason,
        "stop_reason": o.stop_reason,
    }


def logprob_entry(
    token_id: int, top: dict[int, float], token_text: Callable[[int], str]
) -> dict[str, Any]:
    """{"token", "logprob", "top": {token: logprob}} for one generated token."""
    return {
        "token": token_text(token_id),
        "logprob": float(top.get(token_id, float("-inf"))),
        "top": {token_text(t): float(lp) for t, lp in top.items()},
    }
