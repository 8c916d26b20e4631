"""LLMServer output dicts -> OpenAI responses and stream chunks.

An LLMServer output dict is {"request_id", "prompt" (first only), "num_prompt_tokens",
"outputs": [{"index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"}],
"finished"}; in a stream, text/token_ids/logprobs are the new part only. A logprobs entry is
{"token", "logprob", "top": {token: logprob}}.
"""

from __future__ import annotations

import time
from typing import Any

from deployments.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    new_id,
)


def _usage(num_prompt: int, num_completion: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
    )


def completion_logprobs(entries: list[dict] | None, offset: int = 0) -> CompletionLogProbs | None:
    """The legacy completions logprobs object; text_offset starts at `offset`."""
    if entries is None:
        return None
    lp = CompletionLogProbs()
    for e in entries:
        lp.tokens.append(e["token"])
        lp.token_logprobs.append(e["logprob"])
        lp.top_logprobs.append(e["top"])
        lp.text_offset.append(offset)
        offset += len(e["token"])
    return lp


def chat_logprobs(entries: list[dict] | None) -> ChatChoiceLogProbs | None:
    if entries is None:
        return None
    content = []
    for e in entries:
        top = [
            {"token": t, "logprob": p, "bytes": list(t.encode())}
            for t, p in sorted(e["top"].items(), key=lambda kv: -kv[1])
        ]
        content.append(
            ChatLogProb(
                token=e["token"],
                logprob=e["logprob"],
                bytes=list(e["token"].encode()),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogProbs(content=content)


def build_completion_response(req: CompletionRequest, out: dict[str, Any]) -> CompletionResponse:
    echo = (out.get("prompt") or "") if req.echo else ""
    choices = [
        CompletionChoice(
            index=o["index"],
            text=echo + o["text"],
            logprobs=completion_logprobs(o["logprobs"], len(echo)),
            finish_reason=o["finish_reason"],
            stop_reason=o["stop_reason"],
        )
        for o in sorted(out["outputs"], key=lambda o: o["index"])
    ]
    num_completion = sum(len(o["token_ids"]) for o in out["outputs"])
    return CompletionResponse(
        model=req.model, choices=choices, usage=_usage(out["num_prompt_tokens"], num_completion)
    )


def build_chat_response(req: ChatCompletionRequest, out: dict[str, Any]) -> ChatCompletionResponse:
    choices = [
        ChatCompletionChoice(
            index=o["index"],
            message=ChatResponseMessage(content=o["text"]),
            logprobs=chat_logprobs(o["logprobs"]),
            finish_reason=o["finish_reason"],
            stop_reason=o["stop_reason"],
        )
        for o in sorted(out["outputs"], key=lambda o: o["index"])
    ]
    num_completion = sum(len(o["token_ids"]) for o in out["outputs"])
    return ChatCompletionResponse(
        model=req.model, choices=choices, usage=_usage(out["num_prompt_tokens"], num_completion)
    )


class ChunkBuilder:
    """Turns a stream of LLMServer output deltas into OpenAI chunk dicts for one request."""

    def __init__(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self.req = req
        self.chat = isinstance(req, ChatCompletionRequest)
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0
        self._started: set[int] = set()  # indices that got their first chunk
        self._offsets: dict[int, int] = {}  # index -> text offset (completions logprobs)
        self._echo = ""

    def _chunk(self, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }

    def chunks(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.num_prompt_tokens = item["num_prompt_tokens"]
        if item.get("prompt") and not self.chat and self.req.echo:
            self._echo = item["prompt"]
        out = []
        for o in item["outputs"]:
            self.num_completion_tokens += len(o["token_ids"])
            i = o["index"]
            first = i not in self._started
            self._started.add(i)
            if self.chat:
                if first:  # OpenAI's first chunk of a choice carries only the role
                    delta = {"role": "assistant", "content": ""}
                    out.append(
                        self._chunk(
                            [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
                        )
                    )
                delta = {"content": o["text"]} if o["text"] else {}
                choice = {
                    "index": i,
                    "delta": delta,
                    "logprobs": _dump(chat_logprobs(o["logprobs"])),
                }
            else:
                prefix = self._echo if first else ""
                offset = self._offsets.get(i, 0)
                text = prefix + o["text"]
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": _dump(completion_logprobs(o["logprobs"], offset + len(prefix))),
                }
                self._offsets[i] = offset + len(text)
            if not o["text"] and o["finish_reason"] is None and not (first and self._echo):
                continue
            choice["finish_reason"] = o["finish_reason"]
            choice["stop_reason"] = o["stop_reason"]
            out.append(self._chunk([choice]))
        return out

    def usage_chunk(self) -> dict[str, Any] | None:
        opts = self.req.stream_options
        if opts is None or not opts.include_usage:
            return None
        chunk = self._chunk([])
        chunk["usage"] = _usage(self.num_prompt_tokens, self.num_completion_tokens).model_dump()
        return chunk


def _dump(model: Any) -> Any:
    return None if model is None else model.model_dump()
