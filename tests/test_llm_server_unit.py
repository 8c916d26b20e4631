"""LLMServer in this process, outside Serve (no Ray: the registry is simply absent), on the
tiny model: adapter reads do not block the replica's event loop, and the typed boundary
carries what the engine produced."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from deployments.protocol import APIError, GenerateRequest, SamplingSpec
from tests.serve_fixtures import make_tiny_adapter

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_loras": 1, "max_cpu_loras": 2, "max_num_seqs": 4, "num_kv_blocks": 64}


async def _server(model_dir: str, adapters: dict[str, str]):
    from deployments.llm_server import LLMServer

    server = object.__new__(LLMServer)
    await LLMServer.__init__(server, {"model": model_dir, **ENGINE}, adapters=adapters)
    return server


def _as_adapter(name: str) -> None:
    """What Serve does for a call made with multiplexed_model_id=name (in this task only)."""
    from ray.serve.context import _RequestContext, _serve_request_context

    _serve_request_context.set(_RequestContext(multiplexed_model_id=name))


def test_adapter_read_does_not_block_the_event_loop(tiny_model_dir, tmp_path, monkeypatch):
    """Once, LLMServer read an adapter from disk on its event loop: every stream of the
    replica stalled for the length of the read. Here the read takes 1.5 s (a slow disk or
    the Hub); the loop must keep ticking and a base stream must keep getting tokens."""
    import engine.lora.manager as manager

    path = make_tiny_adapter(tiny_model_dir, tmp_path / "slow", 4, ["q_proj", "v_proj"], 3)
    real_load = manager.load_adapter

    def slow_load(*args, **kwargs):
        time.sleep(1.5)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(manager, "load_adapter", slow_load)

    async def run():
        server = await _server(tiny_model_dir, {"slow": str(path)})
        gaps, token_times = [], []
        loading = asyncio.Event()

        async def heartbeat():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append((last, now - last))
                last = now

        async def base_stream():  # back to back until cancelled: outlasts the read anywhere
            spec = SamplingSpec(max_tokens=400, temperature=0, ignore_eos=True)
            for i in itertools.count():
                request = GenerateRequest(f"base-{i}", spec, prompt="Hello there")
                async for _ in server.generate(request):
                    token_times.append(time.monotonic())
                    if not loading.is_set() and len(token_times) > 3:
                        loading.set()

        async def adapter_request():
            await loading.wait()
            _as_adapter("slow")
            start = time.monotonic()
            spec = SamplingSpec(max_tokens=4, temperature=0)
            out = await server.complete(GenerateRequest("ad", spec, prompt="Hi"))
            return start, time.monotonic(), out

        beat = asyncio.create_task(heartbeat())
        stream = asyncio.create_task(base_stream())
        start, end, out = await adapter_request()
        beat.cancel()
        stream.cancel()
        await asyncio.gather(beat, stream, return_exceptions=True)
        await server.engine.shutdown(1.0)
        return start, end, out, gaps, token_times

    start, end, out, gaps, token_times = asyncio.run(run())
    assert end - start >= 1.5  # the read really was slow
    assert out.finished and out.outputs[0].token_ids
    during = [g for t, g in gaps if t + g >= start and t <= end]  # gaps overlapping the read
    assert during and max(during) < 0.5, max(during)  # the loop never stalled on the read
    assert sum(start < t < end for t in token_times) >= 5  # the stream went on meanwhile


def test_unknown_adapter_and_bad_values_are_api_errors(tiny_model_dir, tmp_path, monkeypatch):
    """...and the replica's metrics name an adapter only once it found it: a caller's made-up
    ids (handle calls skip the ingress's check) share the label "unknown"."""
    from deployments import metrics

    counted: list[tuple[str, str]] = []

    class Recorder:
        def inc(self, value: float = 1.0, tags=None) -> None:
            counted.append((tags["adapter"], tags["status"]))

    monkeypatch.setattr(metrics, "REPLICA_REQUESTS", Recorder())
    path = make_tiny_adapter(tiny_model_dir, tmp_path / "a", 4, ["q_proj", "v_proj"], 3)

    async def run():
        server = await _server(tiny_model_dir, {"a": str(path)})
        errors = []
        for adapter, spec in [
            ("nope", SamplingSpec()),
            ("", SamplingSpec(temperature=float("nan"))),
            ("", SamplingSpec(max_tokens=10**6)),
            ("", SamplingSpec(seed=2**64)),
        ]:
            _as_adapter(adapter)
            try:
                await server.complete(GenerateRequest("r", spec, prompt="Hi"))
            except APIError as e:
                errors.append((e.status, e.code))
        _as_adapter("a")
        await server.complete(GenerateRequest("a", SamplingSpec(max_tokens=2), prompt="Hi"))
        try:  # a request for an adapter the replica has, refused before the lookup (no prompt)
            await server.complete(GenerateRequest("b"))
        except APIError as e:
            errors.append((e.status, "bad a"))
        # a handle caller's load under a name the router takes for a prompt-prefix key: 400,
        # and the replica's catalog (what it reports to the registry) does not get it
        try:
            await server.load_adapter("prefix:a", str(path))
        except APIError as e:
            errors.append((e.status, "prefix"))
        assert "prefix:a" not in server.reporter.catalog
        # a load that fails (no adapter at the path) leaves no name -> id entry behind
        held = len(server._lora_ids)
        with pytest.raises(APIError):
            await server.load_adapter("missing", str(tmp_path / "no-such-adapter"))
        assert len(server._lora_ids) == held and "missing" not in server.reporter.catalog
        _as_adapter("")
        ok = await server.complete(GenerateRequest("ok", SamplingSpec(max_tokens=3), prompt="Hi"))
        with pytest.raises(APIError):  # no prompt at all
            await server.complete(GenerateRequest("none"))
        await server.engine.shutdown(1.0)
        return errors, ok

    errors, ok = asyncio.run(run())
    assert errors == [
        (404, "model_not_found"),
        (400, None),
        (400, "context_length_exceeded"),
        (400, None),
        (400, "bad a"),
        (400, "prefix"),
    ]
    assert ok.finished and len(ok.outputs[0].token_ids) == 3
    labels = [label for label, _ in counted[:6]]
    assert labels == ["unknown", "<base>", "<base>", "<base>", "a", "a"]
    assert counted[0][1] == "APIError" and counted[4][1] == "ok" and counted[5][1] != "ok"


def test_logprob_token_text_is_hf_decode(tiny_model_dir):
    """A logprob's token text (the fast Rust decode) is HF's decode([id]) for every id of the
    vocabulary, special tokens included (skip_special_tokens=False, HF's default)."""

    async def run():
        server = await _server(tiny_model_dir, {})
        tok = server.engine.tokenizer
        try:
            return [(server._token_text(i), tok.decode([i])) for i in range(len(tok))]
        finally:
            await server.engine.shutdown(1.0)

    pairs = asyncio.run(run())
    assert len(pairs) > 100 and all(ours == hf for ours, hf in pairs)
