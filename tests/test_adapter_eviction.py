"""Which adapter leaves a slot or the CPU cache: raylora's frequency eviction (the idle adapter
the replica was asked for least) against vLLM's LRU, by hand on the SlotTable and end to end
on an LLMServer (tiny model, real adapters, no Ray), and vLLM's in-step read."""

from __future__ import annotations

import asyncio

import pytest

from deployments.protocol import GenerateRequest, SamplingSpec
from engine import LoRARequest
from engine.scheduler import SlotTable
from tests.serve_fixtures import make_tiny_adapter

pytestmark = pytest.mark.timeout(300)


def lora(name: str) -> LoRARequest:
    return LoRARequest(name, 1, "/nowhere")


def test_slot_table_evicts_the_least_asked_for_idle_adapter():
    counts = {"A": 5.0, "B": 1.0, "C": 3.0}
    table = SlotTable(3)
    for name in "ABC":  # LRU order A, B, C
        table.acquire(lora(name), set())
    table.priority = lambda n: counts.get(n, 0.0)
    slot_b = table.slot_of["B"]
    assert table.acquire(lora("D"), set()) == (slot_b, True)  # B: asked for once
    assert set(table.slot_of) == {"A", "C", "D"}
    # D (count 0) is running, so the least asked-for idle one is C, not A
    assert table.acquire(lora("E"), {"D"})[1] and set(table.slot_of) == {"A", "D", "E"}
    # equal counts: the least recently used of them
    counts.update({"A": 2.0, "D": 2.0, "E": 2.0})
    table.acquire(lora("F"), set())
    assert set(table.slot_of) == {"D", "E", "F"}
    # no priority: plain LRU (vLLM's)
    lru = SlotTable(2)
    for name in "XYX":
        lru.acquire(lora(name), set())
    lru.acquire(lora("Z"), set())
    assert set(lru.slot_of) == {"X", "Z"}


def _as_adapter(name: str) -> None:
    """What Serve does for a call made with multiplexed_model_id=name (in this task only)."""
    from ray.serve.context import _RequestContext, _serve_request_context

    _serve_request_context.set(_RequestContext(multiplexed_model_id=name))


async def _serve_then_cached(model_dir: str, adapters: dict[str, str], names: str, **kwargs):
    """An LLMServer (CPU cache of 2, 1 slot; no Ray) with `kwargs`, one request for each
    adapter in `names` in turn; returns the adapters left in its CPU cache."""
    from deployments.llm_server import LLMServer

    server = object.__new__(LLMServer)
    engine = {"max_loras": 1, "max_cpu_loras": 2, "max_num_seqs": 4, "num_kv_blocks": 64}
    await LLMServer.__init__(server, {"model": model_dir, **engine}, adapters=adapters, **kwargs)
    try:
        for i, name in enumerate(names):
            await _complete(server, name, i)
        return set(server.engine.engine.model_runner.lora_manager.cpu_cache)
    finally:
        await server.__del__()


async def _complete(server, adapter: str, i: int) -> None:
    async def one():
        _as_adapter(adapter)
        spec = SamplingSpec(max_tokens=2, temperature=0)
        await server.complete(GenerateRequest(f"{adapter}-{i}", spec, prompt="hello"))

    await asyncio.create_task(one())


@pytest.fixture(scope="module")
def three_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("evict")
    return {
        n: str(make_tiny_adapter(tiny_model_dir, root / n, 4, ["q_proj", "v_proj"], seed=k))
        for k, n in enumerate("abc")
    }


@pytest.mark.parametrize(
    "eviction, left", [("frequency", {"a", "c"}), ("lru", {"b", "c"})], ids=["frequency", "lru"]
)
def test_cpu_cache_keeps_the_adapter_asked_for_most(tiny_model_dir, three_adapters, eviction, left):
    """CPU cache of 2: a asked for three times, then b once, then c. LRU drops a (the least
    recently used); frequency drops b (asked for once)."""
    run = _serve_then_cached(tiny_model_dir, three_adapters, "aaabc", adapter_eviction=eviction)
    assert asyncio.run(run) == left


def test_in_step_read_is_the_peer_arms_and_add_lora_is_off_the_request_path(
    tiny_model_dir, three_adapters, monkeypatch
):
    """read_adapters_in_step (vLLM's way) makes the engine read a missing adapter under its
    lock (tests/test_adapter_reads.py); raylora's way reads it off the lock. Neither goes
    through add_lora, whose own hop and insert would make the request wait for one more
    step boundary than its add."""
    from engine import AsyncLLMEngine

    added: list[str] = []
    modes: list[bool] = []
    real_generate = AsyncLLMEngine.generate

    async def no_add(self, lora_request):
        added.append(lora_request.lora_name)
        raise AssertionError("add_lora on the request path")

    def generate(self, *args, **kwargs):
        modes.append(self.read_loras_off_lock)
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(AsyncLLMEngine, "add_lora", no_add)
    monkeypatch.setattr(AsyncLLMEngine, "generate", generate)

    def run(in_step: bool):
        return _serve_then_cached(
            tiny_model_dir, three_adapters, "a", read_adapters_in_step=in_step
        )

    assert asyncio.run(run(True)) == {"a"}
    assert asyncio.run(run(False)) == {"a"}
    assert modes == [False, True] and added == []
