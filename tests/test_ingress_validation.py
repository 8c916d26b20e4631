"""The HTTP layer's answers to malformed requests, batched prompts and echo, without Ray
(the fakes of tests/ingress_fakes.py stand in for the replicas and the registry; the same
malformed requests are replayed against the running app in tests/test_serve_app.py)."""

import pytest
from fastapi.testclient import TestClient

from deployments.openai_app import MAX_BODY_BYTES, build_openai_app, json_depth, parse_json
from deployments.openai_serving import OpenAIServing
from deployments.protocol import APIError
from tests.ingress_fakes import (
    BASE,
    PROMPT_TOKENS,
    WORDS,
    FakeLLM,
    FakeRegistry,
    assert_error,
    sse_events,
)
from tests.malformed_requests import cases

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def app(tmp_path):
    llm = FakeLLM()
    registry = FakeRegistry({"sql": {"source": "/adapters/sql", "rank": 8}})
    (tmp_path / "adapters").mkdir()
    serving = OpenAIServing(llm, registry, adapter_roots=[str(tmp_path / "adapters")])
    return TestClient(build_openai_app(serving)), llm, str(tmp_path / "adapters")


def test_malformed_requests_get_openai_errors(app):
    client, llm, root = app
    checked = 0
    for case in cases(BASE, "sql", root, MAX_BODY_BYTES):
        if case.engine:  # the fake replica cannot tell; the app test checks these
            continue
        headers = {"content-type": "application/json"}
        r = client.request(case.method, case.path, content=case.content(), headers=headers)
        try:
            assert_error(r, case.status)
        except AssertionError as e:
            raise AssertionError(f"{case.name}: {e}") from None
        checked += 1
    assert checked >= 60
    assert not llm.requests  # none of them reached a replica
    r = client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "".join(WORDS[:2])


def test_error_messages_name_the_field_and_limit(app):
    client, *_ = app
    err = assert_error(
        client.post("/v1/completions", json={"model": "sql", "prompt": "x", "seed": 2**70}), 400
    )
    assert err["param"] == "seed" and "9223372036854775807" in err["message"]
    assert "int too big" not in err["message"]  # not Python's overflow text
    body = b'{"model": "sql", "prompt": "x", "temperature": NaN}'
    err = assert_error(client.post("/v1/completions", content=body), 400)
    assert "NaN" in err["message"]
    err = assert_error(client.post("/v1/completions", content=b"[" * 200 + b"]" * 200), 400)
    assert "nested deeper than" in err["message"]
    big = b"x" * (MAX_BODY_BYTES + 1)
    err = assert_error(client.post("/v1/completions", content=big), 413)
    assert err["code"] == "request_too_large"


def test_json_depth_and_strict_parse():
    assert json_depth(b'{"a": [1, {"b": "[[[[ not brackets ]"}]}') == 3
    assert json_depth(b'"\\"[[["') == 0
    assert json_depth(b"[" * 1000 + b"]" * 1000) == 1000
    assert parse_json(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for bad in [b'{"t": NaN}', b'{"t": -Infinity}', b"{", b"[" * 65 + b"]" * 65]:
        with pytest.raises(APIError) as e:
            parse_json(bad)
        assert e.value.status == 400


def test_batched_prompts_one_response(app):
    client, llm, _ = app
    r = client.post(
        "/v1/completions",
        json={"model": "sql", "prompt": ["one", "two", "three"], "n": 2, "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert all(c["text"] == "".join(WORDS[:3]) for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 3 * len(PROMPT_TOKENS)
    assert body["usage"]["completion_tokens"] == 6 * 3
    sent = [req for req, _ in llm.requests[-3:]]
    assert [req.prompt for req in sent] == ["one", "two", "three"]
    ids = [req.request_id for req in sent]
    assert len(set(ids)) == 3 and body["id"] == f"cmpl-{ids[0].rsplit('-', 1)[0]}"
    r = client.post("/v1/completions", json={"model": BASE, "prompt": [[1, 2], [3]]})
    assert [req.prompt_token_ids for req, _ in llm.requests[-2:]] == [[1, 2], [3]]


def test_batched_prompts_stream(app):
    client, *_ = app
    r = client.post(
        "/v1/completions",
        json={
            "model": "sql",
            "prompt": ["one", "two"],
            "n": 2,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(r)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert texts == {i: "".join(WORDS[:4]) for i in range(4)} and finished == {0, 1, 2, 3}
    assert chunks[-1]["usage"]["completion_tokens"] == 16


def test_batch_fails_as_a_whole(app):
    client, llm, _ = app
    llm.raise_on_call = APIError(400, "prompt too long", param="prompt")
    for stream in (False, True):
        body = {"model": "sql", "prompt": ["a", "b"], "stream": stream}
        assert_error(client.post("/v1/completions", json=body), 400)


def test_echo_with_logprobs_scores_the_prompt(app):
    client, llm, _ = app
    body = {"model": "sql", "prompt": "Say hi", "echo": True, "logprobs": 1, "max_tokens": 1}
    r = client.post("/v1/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["text"] == "Say hi" + WORDS[0]
    lp = choice["logprobs"]
    assert lp["tokens"] == PROMPT_TOKENS + [WORDS[0]]
    assert lp["token_logprobs"] == [None, -2.0, -0.5]  # the first prompt token has none
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {" hi": -2.0}
    assert lp["text_offset"] == [0, 3, 6]
    assert llm.requests[-1][0].sampling.prompt_logprobs == 1
    # max_tokens=0 with echo: the prompt alone, nothing generated (lm-eval's loglikelihood)
    r = client.post("/v1/completions", json={**body, "max_tokens": 0})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Say hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0]
    assert r.json()["usage"]["completion_tokens"] == 0
    assert llm.requests[-1][0].sampling.max_tokens == 1  # the engine always samples one
    # streamed echo: the first chunk starts with the prompt and its logprobs
    chunks = sse_events(client.post("/v1/completions", json={**body, "stream": True}))
    first = chunks[0]["choices"][0]
    assert first["text"] == "Say hi" + WORDS[0]
    assert first["logprobs"]["token_logprobs"] == [None, -2.0, -0.5]
    chunks = sse_events(
        client.post("/v1/completions", json={**body, "max_tokens": 0, "stream": True})
    )
    assert [c["choices"][0]["text"] for c in chunks] == ["Say hi"]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"


def test_chat_max_tokens_default_is_the_context(app):
    client, llm, _ = app
    client.post(
        "/v1/chat/completions",
        json={"model": "sql", "messages": [{"role": "user", "content": "x"}]},
    )
    request, _ = llm.requests[-1]
    assert request.sampling.max_tokens is None and request.default_max_tokens is None
