"""Structured outputs and forced tool calls in the HTTP layer, without Ray: each way of asking
(OpenAI's response_format and tools, vLLM's structured_outputs and guided_*) reaches the
replica as the right StructuredOutputsSpec, bad ones are 400s that reach no replica, and
scripted replica text comes back as OpenAI tool_calls, whole and streamed. The running app
is tested with the openai client in tests/test_clients.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from deployments.openai_app import build_openai_app
from deployments.openai_serving import OpenAIServing
from deployments.protocol import CompletionDelta, GenerateRequest, ReplicaOutput
from tests.ingress_fakes import BASE, FakeRegistry, assert_error, sse_events

pytestmark = pytest.mark.timeout(60)

MSGS = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "now"}},
]


class ScriptedLLM:
    """Answers every request with `pieces` (one stream item each); records the requests."""

    def __init__(self) -> None:
        self.pieces = ["Hello"]
        self.finish = "stop"
        self.requests: list[GenerateRequest] = []

    def _items(self, request: GenerateRequest) -> list[ReplicaOutput]:
        items = []
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            outs = [
                CompletionDelta(i, piece, [k], None, self.finish if last else None)
                for i in range(request.sampling.n)
            ]
            items.append(ReplicaOutput(request.request_id, 3, outs, last))
        return items

    async def stream(self, request: GenerateRequest, adapter: str):
        self.requests.append(request)
        for item in self._items(request):
            yield item

    async def complete(self, request: GenerateRequest, adapter: str) -> ReplicaOutput:
        self.requests.append(request)
        final = self._items(request)[-1]
        for o in final.outputs:
            o.text, o.token_ids = "".join(self.pieces), list(range(len(self.pieces)))
        return final

    async def model_info(self) -> dict:
        return {"model_name": BASE}


@pytest.fixture
def env():
    llm = ScriptedLLM()
    serving = OpenAIServing(llm, FakeRegistry({"sql": {"source": "/a/sql", "rank": 8}}))
    return TestClient(build_openai_app(serving)), llm


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": BASE, "messages": MSGS, **fields})


def sent_spec(llm) -> dict | None:
    so = llm.requests[-1].sampling.structured_outputs
    return None if so is None else {k: v for k, v in so.engine_kwargs().items() if v}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "path, fields, want",
    [
        ("chat", {"response_format": {"type": "json_object"}}, {"json_object": True}),
        ("chat", {"response_format": {"type": "text"}}, None),
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": SCHEMA},
        ),
        ("comp", {"response_format": {"type": "json_object"}}, {"json_object": True}),
        ("chat", {"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
        ("comp", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json": SCHEMA}),
        (
            "comp",
            {"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
            {"regex": "[a-z]+", "disable_any_whitespace": True},
        ),
        ("comp", {"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
        ("chat", {"structured_outputs": {"grammar": 'root ::= "x"'}}, {"grammar": 'root ::= "x"'}),
        (
            "chat",
            {"structured_outputs": {"json_object": True, "disable_fallback": True}},
            {"json_object": True},
        ),
        ("comp", {"guided_json": SCHEMA}, {"json": SCHEMA}),
        (
            "comp",
            {"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"},
            {"json": SCHEMA},
        ),
        ("chat", {"guided_regex": r"\d{3}"}, {"regex": r"\d{3}"}),
        ("chat", {"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ("comp", {"guided_grammar": 'root ::= "a" | "b"'}, {"grammar": 'root ::= "a" | "b"'}),
        ("chat", {"tools": TOOLS, "tool_choice": "none"}, None),
        (
            "chat",
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            {"json": WEATHER},
        ),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            {"json": {"type": "object", "properties": {}}},
        ),
    ],
)
def test_each_way_of_asking_reaches_the_replica(env, path, fields, want):
    client, llm = env
    if path == "chat":
        r = chat(client, **fields)
    else:
        r = client.post("/v1/completions", json={"model": BASE, "prompt": "x", **fields})
    assert r.status_code == 200, r.text
    assert sent_spec(llm) == want


@pytest.mark.parametrize(
    "fields, says",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "not a valid JSON Schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "schema is required",
        ),
        ({"response_format": {"type": "structural_tag"}}, "json_schema"),
        ({"guided_json": "{nope"}, "not valid JSON"),
        ({"guided_json": {"properties": {"a": {"minLength": -1}}}}, "at #/properties/a/minLength"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 5]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " *"}, "disable_any_whitespace"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format and guided_regex",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {}}, "exactly one"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"tools": TOOLS}, 'tool_choice "auto"'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "required"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope'",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0.function"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice and response_format",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": n,
                            "parameters": {"$defs": {"D": {"type": t}}, "$ref": "#/$defs/D"},
                        },
                    }
                    for n, t in [("f", "integer"), ("g", "string")]
                ],
                "tool_choice": "required",
            },
            "$defs/D twice",
        ),
    ],
)
def test_bad_requests_are_400s_that_reach_no_replica(env, fields, says):
    client, llm = env
    err = assert_error(chat(client, **fields), 400)
    assert says in err["message"], err
    assert not llm.requests


def test_named_tool_call_whole_and_streamed(env):
    client, llm = env
    args = '{"city": "Paris", "unit": "c"}'
    llm.pieces = ['{"city": "Pa', 'ris", "un', 'it": "c"}']
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(client, tools=TOOLS, tool_choice=choice).json()
    (c,) = body["choices"]
    assert c["finish_reason"] == "stop"  # OpenAI's answer to a forced function
    assert c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": args}
    events = sse_events(chat(client, tools=TOOLS, tool_choice=choice, stream=True))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    entries = [t for d in deltas for t in d.get("tool_calls", [])]
    assert entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == "get_weather"
    assert all(t["index"] == 0 and "name" not in t["function"] for t in entries[1:])
    assert "".join(t["function"]["arguments"] for t in entries) == args
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_required_tool_calls_whole_and_streamed(env):
    client, llm = env
    calls = [
        {"name": "get_weather", "parameters": {"city": 'Oslo, "NO" ]'}},
        {"name": "get_time", "parameters": {}},
    ]
    text = json.dumps(calls)
    cut = [7, 30, 41, 55, len(text)]  # inside strings, between calls, at the closing bracket
    llm.pieces = [text[a:b] for a, b in zip([0, *cut], cut, strict=False)]
    body = chat(client, tools=TOOLS, tool_choice="required").json()
    schema = llm.requests[-1].sampling.structured_outputs.json
    jsonschema.validate(calls, schema)  # the constraint accepts what the parser reads
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"x": 1}, "extra": 1}, {}], schema)
    (c,) = body["choices"]
    assert c["finish_reason"] == "tool_calls"
    got = [
        (t["function"]["name"], json.loads(t["function"]["arguments"]))
        for t in c["message"]["tool_calls"]
    ]
    assert got == [(x["name"], x["parameters"]) for x in calls]
    events = sse_events(chat(client, tools=TOOLS, tool_choice="required", stream=True))
    entries = [
        t for e in events if e["choices"] for t in e["choices"][0]["delta"].get("tool_calls", [])
    ]
    assert [t["index"] for t in entries] == [0, 1]
    streamed = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in entries]
    assert streamed == got
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # parallel_tool_calls=false: at most one call
    chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert llm.requests[-1].sampling.structured_outputs.json["maxItems"] == 1


def test_required_cut_short_returns_the_text(env):
    client, llm = env
    llm.pieces, llm.finish = ['[{"name": "get_time", "param'], "length"
    (c,) = chat(client, tools=TOOLS, tool_choice="required").json()["choices"]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]
    assert c["message"]["content"] == llm.pieces[0]


def test_tool_history_messages_are_accepted(env):
    client, llm = env
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = client.post("/v1/chat/completions", json={"model": BASE, "messages": history})
    assert r.status_code == 200, r.text
    sent = llm.requests[-1].messages
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert json.loads(sent[1]["content"]) == [{"name": "get_time", "arguments": "{}"}]
