"""LLMServer outputs (deployments.protocol.ReplicaOutput) -> OpenAI responses and stream chunks.

A request with several prompts (a batched /v1/completions) has one ReplicaOutput stream per
prompt; its choices are numbered prompt_index * n + completion index, as vLLM numbers them.
With `echo`, each choice's text starts with its prompt, and with `logprobs` too, its logprobs
start with one entry per prompt token (the first one's is null, as in vLLM and OpenAI's
legacy API). `echo` with max_tokens=0 returns the prompt alone (the one token the engine
generated is dropped): that is how lm-eval scores a prompt. A chat request that forces a
tool call gets its text back as `tool_calls` (deployments/tool_calls.py).
"""

from __future__ import annotations

import time
from typing import Any

from deployments.openai_protocol import (
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
    PromptTokensDetails,
    UsageInfo,
)
from deployments.protocol import CompletionDelta, ReplicaOutput, TokenLogprob
from deployments.tool_calls import ToolCallStream, finish_reason, parse_tool_calls


def _usage(num_prompt: int, num_completion: int, num_cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


def completion_logprobs(
    entries: list[TokenLogprob] | None, offset: int = 0
) -> CompletionLogProbs | None:
    """The legacy completions logprobs object; text_offset starts at `offset`."""
    if entries is None:
        return None
    lp = CompletionLogProbs()
    for e in entries:
        lp.tokens.append(e.token)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append(None if e.logprob is None else e.top)
        lp.text_offset.append(offset)
        offset += len(e.token)
    return lp


def chat_logprobs(entries: list[TokenLogprob] | None) -> ChatChoiceLogProbs | None:
    if entries is None:
        return None
    content = []
    for e in entries:
        top = [
            {"token": t, "logprob": p, "bytes": list(t.encode())}
            for t, p in sorted(e.top.items(), key=lambda kv: -kv[1])
        ]
        content.append(
            ChatLogProb(
                token=e.token,
                logprob=e.logprob if e.logprob is not None else float("-inf"),
                bytes=list(e.token.encode()),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogProbs(content=content)


class _Echo:
    """What a completion choice shows of its prompt (nothing without `echo`)."""

    def __init__(self, req: CompletionRequest, out: ReplicaOutput) -> None:
        self.on = req.echo
        self.only = req.echo_only
        self.text = (out.prompt or "") if req.echo else ""
        self.logprobs = out.prompt_logprobs if req.echo and req.logprobs is not None else None

    def apply(self, o: CompletionDelta) -> tuple[str, list[TokenLogprob] | None, str | None]:
        """(text, logprobs, finish_reason) of a choice's first part, with the prompt echoed."""
        if self.only:  # the prompt alone: drop the token the engine had to generate
            return self.text, self.logprobs, "length" if o.finish_reason else None
        logprobs = o.logprobs
        if self.logprobs is not None:
            logprobs = self.logprobs + list(o.logprobs or [])
        return self.text + o.text, logprobs, o.finish_reason


def build_completion_response(
    req: CompletionRequest, outs: list[ReplicaOutput], response_id: str
) -> CompletionResponse:
    choices = []
    num_prompt = num_completion = num_cached = 0
    for i, out in enumerate(outs):
        echo = _Echo(req, out)
        num_prompt += out.num_prompt_tokens
        num_cached += out.num_cached_tokens
        for o in sorted(out.outputs, key=lambda o: o.index):
            text, logprobs, finish = echo.apply(o)
            num_completion += 0 if echo.only else len(o.token_ids)
            choices.append(
                CompletionChoice(
                    index=i * req.n + o.index,
                    text=text,
                    logprobs=completion_logprobs(logprobs),
                    finish_reason=finish,
                    stop_reason=None if echo.only else o.stop_reason,
                )
            )
    return CompletionResponse(
        id=response_id,
        model=req.model,
        choices=choices,
        usage=_usage(num_prompt, num_completion, num_cached),
    )


def build_chat_response(
    req: ChatCompletionRequest, out: ReplicaOutput, response_id: str
) -> ChatCompletionResponse:
    forced = req.forced_tool()
    choices = []
    for o in sorted(out.outputs, key=lambda o: o.index):
        message, reason = ChatResponseMessage(content=o.text), o.finish_reason
        calls = parse_tool_calls(forced, o.text) if forced is not None else None
        if calls is not None:
            message, reason = ChatResponseMessage(tool_calls=calls), finish_reason(forced, reason)
        choices.append(
            ChatCompletionChoice(
                index=o.index,
                message=message,
                logprobs=chat_logprobs(o.logprobs),
                finish_reason=reason,
                stop_reason=o.stop_reason,
            )
        )
    num_completion = sum(len(o.token_ids) for o in out.outputs)
    return ChatCompletionResponse(
        id=response_id,
        model=req.model,
        choices=choices,
        usage=_usage(out.num_prompt_tokens, num_completion, out.num_cached_tokens),
    )


class ChunkBuilder:
    """Turns the ReplicaOutput deltas of one request's prompts into OpenAI chunk dicts."""

    def __init__(self, req: CompletionRequest | ChatCompletionRequest, response_id: str) -> None:
        self.req = req
        self.chat = isinstance(req, ChatCompletionRequest)
        self.id = response_id
        self.created = int(time.time())
        self._num_prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens
        self._num_cached_tokens: dict[int, int] = {}  # prompt index -> its prefix-cache hits
        self.num_completion_tokens = 0
        self._echo: dict[int, _Echo] = {}  # prompt index -> its echo (completions)
        self._started: set[int] = set()  # choice indices that got their first chunk
        self._offsets: dict[int, int] = {}  # choice index -> text offset (completions logprobs)
        self._forced = req.forced_tool() if self.chat else None  # a function name, "required"
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its tool calls

    def _chunk(self, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }

    def chunks(self, item: ReplicaOutput, prompt_index: int = 0) -> list[dict[str, Any]]:
        self._num_prompt_tokens[prompt_index] = item.num_prompt_tokens
        self._num_cached_tokens[prompt_index] = item.num_cached_tokens
        if not self.chat and prompt_index not in self._echo:
            self._echo[prompt_index] = _Echo(self.req, item)
        out = []
        for o in item.outputs:
            i = prompt_index * self.req.n + o.index
            first = i not in self._started
            self._started.add(i)
            if self.chat:
                self.num_completion_tokens += len(o.token_ids)
                out.extend(self._chat_chunks(o, i, first))
            else:
                out.extend(self._completion_chunks(o, i, first, self._echo[prompt_index]))
        return out

    def _chat_chunks(self, o: CompletionDelta, i: int, first: bool) -> list[dict[str, Any]]:
        out = []
        if first:  # OpenAI's first chunk of a choice carries only the role
            delta = {"role": "assistant", "content": ""}
            out.append(
                self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            )
        delta: dict[str, Any] = {"content": o.text} if o.text else {}
        reason = o.finish_reason
        if self._forced is not None:
            stream = self._tool_streams.setdefault(i, ToolCallStream(self._forced))
            calls = stream.feed(o.text)
            delta = {"tool_calls": calls} if calls else {}
            reason = finish_reason(self._forced, reason)
        if not delta and reason is None:
            return out
        choice = {
            "index": i,
            "delta": delta,
            "logprobs": _dump(chat_logprobs(o.logprobs)),
            "finish_reason": reason,
            "stop_reason": o.stop_reason,
        }
        return [*out, self._chunk([choice])]

    def _completion_chunks(
        self, o: CompletionDelta, i: int, first: bool, echo: _Echo
    ) -> list[dict[str, Any]]:
        if echo.only:
            text, logprobs, finish = echo.apply(o) if first else ("", None, None)
            if not first and o.finish_reason is not None:
                finish = "length"
            stop_reason = None
        elif first and echo.on:
            text, logprobs, finish = echo.apply(o)
            stop_reason = o.stop_reason
        else:
            text, logprobs, finish, stop_reason = o.text, o.logprobs, o.finish_reason, o.stop_reason
        if not echo.only:
            self.num_completion_tokens += len(o.token_ids)
        if not text and finish is None and not (first and echo.on):
            return []
        offset = self._offsets.get(i, 0)
        self._offsets[i] = offset + len(text)
        choice = {
            "index": i,
            "text": text,
            "logprobs": _dump(completion_logprobs(logprobs, offset)),
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        return [self._chunk([choice])]

    def usage_chunk(self) -> dict[str, Any] | None:
        opts = self.req.stream_options
        if opts is None or not opts.include_usage:
            return None
        chunk = self._chunk([])
        num_prompt = sum(self._num_prompt_tokens.values())
        num_cached = sum(self._num_cached_tokens.values())
        chunk["usage"] = _usage(num_prompt, self.num_completion_tokens, num_cached).model_dump()
        return chunk


def _dump(model: Any) -> Any:
    return None if model is None else model.model_dump()
