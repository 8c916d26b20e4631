"""Malformed requests and the status each must get, with OpenAI's error JSON. Replayed by
tests/test_ingress_validation.py against the HTTP layer alone and by tests/test_serve_app.py
against the running app (real engine), which must serve correctly afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Case:
    name: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are
    status: int
    method: str = "POST"
    engine: bool = False  # only the engine can tell (it needs the tokenized prompt)

    def content(self) -> bytes | None:
        if self.body is None:
            return None
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def cases(base: str, adapter: str, adapter_root: str, max_body_bytes: int) -> list[Case]:
    c, chat, load = "/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"

    def comp(name: str, status: int = 400, engine: bool = False, **fields) -> Case:
        return Case(name, c, {"model": adapter, "prompt": "Hello", **fields}, status, engine=engine)

    def raw(name: str, text: str, path: str = c) -> Case:
        return Case(name, path, text.encode(), 400)

    msgs = [{"role": "user", "content": "Hi"}]

    def ch(name: str, status: int = 400, engine: bool = False, **fields) -> Case:
        return Case(
            name, chat, {"model": adapter, "messages": msgs, **fields}, status, engine=engine
        )

    return [
        # model and prompt
        Case("unknown model", c, {"model": "nope", "prompt": "x"}, 404),
        Case("unknown adapter of the base", c, {"model": f"{base}:nope", "prompt": "x"}, 404),
        Case("no model", c, {"prompt": "x"}, 400),
        Case("empty model", c, {"model": "", "prompt": "x"}, 400),
        Case("model is a number", c, {"model": 5, "prompt": "x"}, 400),
        Case("no prompt", c, {"model": adapter}, 400),
        comp("empty prompt", prompt=""),
        comp("empty token list", prompt=[]),
        comp("empty prompt in a batch", prompt=[[1, 2], []]),
        comp("mixed prompt list", prompt=[1, "a"]),
        comp("negative token id", prompt=[-1, 5]),
        comp("token id outside the vocabulary", prompt=[10**9], engine=True),
        comp("prompt is an object", prompt={"text": "x"}),
        comp("too many prompts", prompt=["x"] * 257),
        comp("prompt longer than the context", prompt="hello " * 5000, engine=True),
        # sampling values
        raw("temperature NaN", f'{{"model": "{adapter}", "prompt": "x", "temperature": NaN}}'),
        raw(
            "temperature Infinity",
            f'{{"model": "{adapter}", "prompt": "x", "temperature": Infinity}}',
        ),
        raw(
            "temperature -Infinity",
            f'{{"model": "{adapter}", "prompt": "x", "temperature": -Infinity}}',
        ),
        raw("temperature 1e400", f'{{"model": "{adapter}", "prompt": "x", "temperature": 1e400}}'),
        comp("negative temperature", temperature=-1),
        comp("temperature as a string", temperature="0.5"),
        comp("temperature as a bool", temperature=True),
        comp("top_p 0", top_p=0),
        comp("top_p above 1", top_p=1.5),
        raw("top_p NaN", f'{{"model": "{adapter}", "prompt": "x", "top_p": NaN}}'),
        comp("top_k below -1", top_k=-2),
        comp("fractional top_k", top_k=1.5),
        comp("n 0", n=0),
        comp("n 1000", n=1000),
        comp("n as a bool", n=True),
        comp("n above the engine's max_n", n=17, max_tokens=2, engine=True),
        comp("negative max_tokens", max_tokens=-1),
        comp("max_tokens 0 without echo", max_tokens=0),
        comp("max_tokens 10^9", max_tokens=10**9, engine=True),
        comp("max_tokens 2^70", max_tokens=2**70, engine=True),
        comp("max_tokens 8192 against a short context", max_tokens=8192, engine=True),
        comp("max_tokens as a string", max_tokens="16"),
        comp("seed 2^70", seed=2**70),
        comp("seed -2^70", seed=-(2**70)),
        comp("fractional seed", seed=1.5),
        comp("logprobs 21", logprobs=21),
        comp("negative logprobs", logprobs=-1),
        comp("empty stop string", stop=[""]),
        comp("stop is a number", stop=5),
        comp("17 stop strings", stop=[f"s{i}" for i in range(17)]),
        comp("negative stop token id", stop_token_ids=[-1]),
        comp("presence_penalty", presence_penalty=0.5),
        comp("presence_penalty out of range", presence_penalty=5),
        raw(
            "logit_bias NaN", f'{{"model": "{adapter}", "prompt": "x", "logit_bias": {{"1": NaN}}}}'
        ),
        comp("logit_bias", logit_bias={"1": 5}),
        comp("best_of != n", best_of=3),
        comp("suffix", suffix="x"),
        comp("min_tokens (a vLLM field raylora lacks)", min_tokens=5),
        comp("stream as a string", stream="yes"),
        comp("stream_options without stream", stream_options={"include_usage": True}),
        # the body itself
        raw("malformed JSON", "{oops"),
        raw("a JSON array", "[1, 2]"),
        raw("a JSON string", '"hello"'),
        raw("an empty body", ""),
        Case("invalid UTF-8", c, b"\xff\xfe{}", 400),
        raw("JSON nested 100k deep", '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        Case("a body over the size cap", c, b" " * (max_body_bytes + 1), 413),
        # chat
        Case("chat without messages", chat, {"model": adapter}, 400),
        ch("empty messages", messages=[]),
        ch("messages as a string", messages="hi"),
        ch("message without a role", messages=[{"content": "hi"}]),
        ch("unknown role", messages=[{"role": "robot", "content": "hi"}]),
        ch("image content", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        ch("content is a number", messages=[{"role": "user", "content": 5}]),
        # structured outputs and tools (the replica's compiler checks what needs xgrammar)
        ch("tools with tool_choice auto", tools=[{"type": "function", "function": {"name": "f"}}]),
        ch(
            "tool_choice naming no tool",
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        ch("response_format of an unknown type", response_format={"type": "xml"}),
        ch(
            "response_format json_schema not a schema",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 5}},
            },
        ),
        comp("guided_json not JSON", guided_json="{oops"),
        comp("two constraints", guided_regex="a+", guided_choice=["a"]),
        comp("structured_outputs unknown key", structured_outputs={"jsn": {}}),
        comp("guided_regex lookbehind", guided_regex="(?<=a)b", engine=True),
        comp("guided_grammar undefined rule", guided_grammar="root ::= nope", engine=True),
        ch(
            "json schema keyword xgrammar ignores",
            engine=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
        ),
        comp("structured outputs with ignore_eos", guided_regex="a+", ignore_eos=True, engine=True),
        ch("top_logprobs without logprobs", top_logprobs=2),
        ch("top_logprobs 50", logprobs=True, top_logprobs=50),
        ch("max_completion_tokens 0", max_completion_tokens=0),
        ch("chat max_tokens 10^9", max_tokens=10**9, engine=True),
        # adapter endpoints and routes
        Case("load without a path", load, {"lora_name": "x"}, 400),
        Case("load with an empty name", load, {"lora_name": "", "lora_path": adapter_root}, 400),
        Case(
            "load under a name the router takes for a prompt-prefix key",
            load,
            {"lora_name": "prefix:sql", "lora_path": adapter_root},
            400,
        ),
        Case("load from outside the roots", load, {"lora_name": "x", "lora_path": "/etc"}, 403),
        Case(
            "load of a missing folder",
            load,
            {"lora_name": "x", "lora_path": f"{adapter_root}/missing"},
            404,
        ),
        Case(
            "unload of an unknown adapter", "/v1/unload_lora_adapter", {"lora_name": "never"}, 404
        ),
        Case("GET on a POST route", c, None, 405, method="GET"),
        Case("unknown route", "/v1/nothing", {}, 404),
    ]
