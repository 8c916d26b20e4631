"""AsyncLLMEngine's adapter reads: one read shared by the requests that need it, made in the
thread that adds the request (one hop off the event loop), steps and the event loop going on
while a read takes a second, failed reads forgotten, and vLLM's in-step read (under the engine
lock) for the peer arm of benchmarks/routing.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import engine.lora.manager as lora_manager_module
from engine import AsyncLLMEngine, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.lora.errors import LoRAError
from tests.lora_fixtures import make_peft_adapter
from tests.model_fixtures import make_tiny_llama

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def async_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    cfg = dict(model=model_dir, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    return AsyncLLMEngine(engine=LLMEngine(EngineConfig(**(cfg | {"enable_lora": True} | kw))))


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("reads") / "a"
    return str(make_peft_adapter(tiny_model_dir, out, r=4, target_modules=["q_proj"], seed=3))


class Loads(list):
    """Every disk read of an adapter, each entry whether an engine `watch`ed held its lock."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[AsyncLLMEngine] = []

    def watch(self, eng: AsyncLLMEngine) -> None:
        self.watched.append(eng)


@pytest.fixture
def loads(monkeypatch) -> Loads:
    """Disk reads of adapters, each slowed to 0.2 s."""
    seen = Loads()
    real = lora_manager_module.load_adapter

    def slow(*args, **kwargs):
        seen.append(any(e._lock.locked() for e in seen.watched))
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_manager_module, "load_adapter", slow)
    return seen


async def texts(eng: AsyncLLMEngine, lora: LoRARequest | None, rid: str) -> list[int]:
    outs = [o async for o in eng.generate("The capital of France is", PARAMS, rid, lora)]
    assert outs[-1].finished
    return outs[-1].outputs[0].token_ids


def test_concurrent_requests_for_one_adapter_share_one_read(tiny_model_dir, adapter, loads):
    """Four requests for an adapter not in the CPU cache, at once: one disk read, and each
    gets what a request for the adapter already cached gets."""

    async def main():
        eng = async_engine(tiny_model_dir)
        try:
            lora = LoRARequest("a", 1, adapter)
            got = await asyncio.gather(*(texts(eng, lora, f"r{i}") for i in range(4)))
            reads = len(loads)
            again = await texts(eng, lora, "cached")
            base = await texts(eng, None, "base")
            return got, reads, again, base, dict(eng._reads)
        finally:
            await eng.shutdown()

    got, reads, again, base, pending = asyncio.run(main())
    assert reads == 1 and len(loads) == 1
    assert all(g == again for g in got)
    assert again != base  # the adapter changes the output: the requests did use it
    assert pending == {}  # inserted, so no longer held as a pending read


def test_the_read_is_made_in_the_thread_that_adds_the_request(
    tiny_model_dir, adapter, loads, monkeypatch
):
    """A request for an adapter missing from the CPU cache costs one worker-thread hop, as one
    without an adapter does: its read and its add run in the same thread (each hop between
    the event loop and a worker waits for the GIL while a step runs)."""
    threads: dict[str, list[int]] = {"read": [], "add": []}
    real_read, real_add = LLMEngine.read_lora, LLMEngine.add_request

    def read(self, *args, **kwargs):
        threads["read"].append(threading.get_ident())
        return real_read(self, *args, **kwargs)

    def add(self, *args, **kwargs):
        threads["add"].append(threading.get_ident())
        return real_add(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "read_lora", read)
    monkeypatch.setattr(LLMEngine, "add_request", add)

    async def main():
        eng = async_engine(tiny_model_dir)
        try:
            await texts(eng, LoRARequest("a", 1, adapter), "r")
            return eng.list_loras(), len(eng._reads)
        finally:
            await eng.shutdown()

    assert asyncio.run(main()) == (["a"], 0)
    assert len(loads) == 1 and len(threads["read"]) == 1 and threads["read"] == threads["add"]
    assert threads["read"][0] != threading.main_thread().ident


def test_a_failed_read_is_forgotten(tiny_model_dir, adapter, tmp_path, loads):
    """A read that fails fails its request and is not kept: the next request reads again,
    and the engine serves other adapters as before."""

    async def main():
        eng = async_engine(tiny_model_dir)
        try:
            (tmp_path / "no-adapter-here").mkdir()  # a folder, so the read itself fails
            missing = LoRARequest("m", 2, str(tmp_path / "no-adapter-here"))
            for i in range(2):
                with pytest.raises(LoRAError):
                    await texts(eng, missing, f"bad{i}")
            failed_reads = len(loads)
            await texts(eng, LoRARequest("a", 1, adapter), "r")
            return failed_reads, len(loads), len(eng._reads)
        finally:
            await eng.shutdown()

    assert asyncio.run(main()) == (2, 3, 0)


def test_read_loras_off_lock_false_reads_under_the_lock(tiny_model_dir, adapter, loads):
    """vLLM's way (read_loras_off_lock = False): the request's add reads the adapter holding
    the engine lock, so no step runs meanwhile; the default reads it with the lock free (one
    request, no step running)."""

    async def main(off_lock: bool):
        eng = async_engine(tiny_model_dir)
        loads.watch(eng)
        eng.read_loras_off_lock = off_lock
        try:
            await texts(eng, LoRARequest("a", 1, adapter), "r")
            return eng.list_loras()
        finally:
            await eng.shutdown()

    assert asyncio.run(main(False)) == ["a"]
    assert loads == [True]
    assert asyncio.run(main(True)) == ["a"]
    assert loads == [True, False]


def test_latest_stats_never_waits_for_the_lock_and_follows_steps(tiny_model_dir, adapter):
    """latest_stats (what a replica's event loop reads for routing and residency reports)
    returns while a step holds the engine lock, and after the step it is what stats() says."""

    async def main():
        eng = async_engine(tiny_model_dir)
        try:
            before = eng.latest_stats()
            await texts(eng, LoRARequest("a", 1, adapter), "r")
            await asyncio.sleep(0.05)  # the loop refreshes after the step that finished r
            after, exact = eng.latest_stats(), eng.stats()
            with eng._lock:  # as a running step holds it
                start = time.perf_counter()
                held = eng.latest_stats()
                waited = time.perf_counter() - start
            return before, after, exact, held, waited
        finally:
            await eng.shutdown()

    before, after, exact, held, waited = asyncio.run(main())
    assert before["adapters_in_cpu"] == [] and before["lora"]["activations"] == 0
    assert after["adapters_in_slots"] == exact["adapters_in_slots"] == ["a"]
    assert after["adapters_in_cpu"] == exact["adapters_in_cpu"] == ["a"]
    assert after["lora"] == exact["lora"] and after["lora"]["activations"] == 1
    assert after["num_running"] == after["num_waiting"] == 0
    assert held is after and waited < 0.01


def test_quick_local_reads_are_made_under_the_lock_until_one_is_slow(
    tiny_model_dir, adapter, loads
):
    """Once this replica's local reads measured less CPU than a GIL switch interval (and
    less wall time than ten), the next adapter is read under the engine lock (as vLLM reads
    in its step: beside a step such a read only waits for the GIL); once such a read held
    the lock longer than that (a slow disk: here every read sleeps 0.2 s), reads go off the
    lock again."""

    async def main():
        eng = async_engine(tiny_model_dir)
        loads.watch(eng)
        manager = eng.engine.model_runner.lora_manager
        try:
            got = [await texts(eng, LoRARequest("a", 1, adapter), "a")]
            measured = manager.local_read_cpu_s
            # as a quick disk measures, whatever this one did (each read here sleeps 0.2 s)
            manager.local_read_cpu_s, manager.local_read_s = 0.001, 0.002
            unread = LoRARequest("z", 9, adapter)
            decisions = (eng.engine.quick_read(unread), eng.engine.quick_read(unread, object()))
            for name, lora_id in (("b", 2), ("c", 3)):
                got.append(await texts(eng, LoRARequest(name, lora_id, adapter), name))
            return got, measured, decisions
        finally:
            await eng.shutdown()

    got, measured, decisions = asyncio.run(main())
    assert measured is not None  # the first read was measured
    # quick with or without a tier: a local folder that reads quickly is read before asking
    # the tier (LoRAManager.tier_first)
    assert decisions == (True, True)
    assert loads == [False, True, False]  # unmeasured: off; quick: under the lock; then off
    assert got[0] == got[1] == got[2]  # one adapter under three names: one output


def test_adapter_reads_do_not_block_steps_or_the_event_loop(tmp_path, monkeypatch):
    """While an adapter read takes a second (add_lora, then generate() with an adapter not in
    the CPU cache), a running stream keeps getting tokens and another task keeps running."""
    # a 4096-token context, so that one stream outlasts both reads
    model_dir = str(make_tiny_llama(tmp_path / "model", max_position_embeddings=4096))
    paths = [
        make_peft_adapter(model_dir, tmp_path / f"a{i}", r=4, target_modules=["q_proj"], seed=i)
        for i in range(2)
    ]
    windows: list[tuple[float, float]] = []
    real = lora_manager_module.load_adapter

    def slow_load(*args, **kwargs):
        start = time.monotonic()
        assert threading.current_thread() is not threading.main_thread()
        time.sleep(1.0)
        try:
            return real(*args, **kwargs)
        finally:
            windows.append((start, time.monotonic()))

    monkeypatch.setattr(lora_manager_module, "load_adapter", slow_load)

    async def main():
        eng = async_engine(model_dir, max_model_len=4096)
        stream_times: list[float] = []
        ticks: list[float] = []
        stop = asyncio.Event()

        async def stream():
            params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
            gen = eng.generate("Hello world!", params, "base")
            async for _ in gen:
                stream_times.append(time.monotonic())
                if stop.is_set():
                    break
            await gen.aclose()

        async def ticker():
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(stream()), asyncio.create_task(ticker())]
        while not stream_times:
            await asyncio.sleep(0.01)
        info = await eng.add_lora(LoRARequest("a0", 1, str(paths[0])))
        assert info["name"] == "a0" and info["rank"] == 4
        lora = LoRARequest("a1", 2, str(paths[1]))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o async for o in eng.generate("The capital of France is", params, "with-a1", lora)]
        stop.set()
        await asyncio.gather(*tasks)
        assert eng.list_loras() == ["a0", "a1"]
        await eng.shutdown()
        return stream_times, ticks, outs

    stream_times, ticks, outs = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(windows) == 2
    for start, end in windows:
        assert end - start >= 1.0
        during = [t for t in stream_times if start < t < end]
        ticked = [t for t in ticks if start < t < end]
        assert len(during) >= 5, (len(during), end - start)
        assert len(ticked) >= 10, len(ticked)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
