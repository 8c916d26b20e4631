"""The shared adapter tier (deployments/shared_adapters.py): the registry's store, the engine's
read path through a tier, and how an adapter travels (the Ray object store tier on a local Ray
cluster: tests/test_shared_adapters_ray.py).

The engine test deletes the adapter's files after the first read: a second engine that still
serves it token for token as the first one did can only have taken it from the tier.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from deployments.shared_adapters import SharedAdapterStore
from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.lora.errors import LoRAError
from tests.lora_fixtures import make_adapter_set

pytestmark = pytest.mark.timeout(300)


# -- the registry's store ----------------------------------------------------------------


def test_store_keeps_the_most_recently_fetched_within_its_budget():
    store = SharedAdapterStore(budget_bytes=100)
    a, b, c = ("m", "a", "/a"), ("m", "b", "/b"), ("m", "c", "/c")
    assert store.put(a, ["ra"], 40) and store.put(b, ["rb"], 40)
    assert store.get(a) == ["ra"]  # a is now the most recent: b goes first
    assert store.put(c, ["rc"], 40)
    assert store.get(b) is None and store.get(a) == ["ra"] and store.get(c) == ["rc"]
    hits = store.hits
    assert store.has(a) and not store.has(b) and store.hits == hits  # not a fetch
    assert store.total_bytes == 80 and store.evictions == 1
    assert not store.put(("m", "big", "/big"), ["rx"], 101)  # over the whole budget: not kept
    assert store.put(a, ["ra2"], 10) and store.get(a) == ["ra2"]  # replaced, not added
    assert store.total_bytes == 50
    assert store.drop_name("a") == 1 and store.get(a) is None and store.total_bytes == 40
    store.forget(c)
    assert store.stats()["adapters"] == 0 and store.total_bytes == 0
    assert not SharedAdapterStore(budget_bytes=0).put(a, ["ra"], 1)  # a budget of 0: off
    with pytest.raises(ValueError, match=">= 0"):
        SharedAdapterStore(budget_bytes=-1)


def test_store_drops_the_copies_of_replicas_that_left():
    store = SharedAdapterStore(budget_bytes=100)
    store.put(("m", "a", "/a"), ["ra"], 10, owner="r1")
    store.put(("m", "b", "/b"), ["rb"], 10, owner="r2")
    store.put(("m", "c", "/c"), ["rc"], 10, owner="r1")
    assert store.owners() == {"r1", "r2"}
    assert store.drop_owners({"r1", "r9"}) == 2
    assert store.get(("m", "b", "/b")) == ["rb"] and store.total_bytes == 10


def test_one_replica_reads_a_key_while_the_others_wait():
    """Single flight: a miss claims the read; others wait until the reader puts (then hit),
    abandons, is dropped, or its claim is claim_s old (then the next one reads)."""
    now = [0.0]
    store = SharedAdapterStore(budget_bytes=100, claim_s=60.0, clock=lambda: now[0])
    k, other = ("m", "a", "/a"), ("m", "b", "/b")
    assert store.claim(k, "r1") == ("read", None)
    assert store.claim(k, "r2") == ("wait", None) and store.claim(k, "r3") == ("wait", None)
    assert store.claim(k, "r1") == ("read", None)  # its own claim: it reads (a retry)
    assert store.claim(other, "r2") == ("read", None)  # keys are independent
    assert store.put(k, ["ra"], 10, owner="r1")
    assert store.claim(k, "r2") == ("hit", ["ra"])
    assert store.stats()["waits"] == 2 and store.stats()["misses"] == 3

    store.abandon(other, "r9")  # not its claim: nothing ends
    assert store.claim(other, "r3") == ("wait", None)
    store.abandon(other, "r2")  # r2's read failed: r3 reads next
    assert store.claim(other, "r3") == ("read", None)
    now[0] = 59.9
    assert store.claim(other, "r4") == ("wait", None)
    now[0] = 60.0  # r3's claim is over claim_s old: r4 reads
    assert store.claim(other, "r4") == ("read", None)
    store.drop_owners({"r4"})  # its replica is forgotten: so is its claim
    assert store.claim(other, "r5") == ("read", None)
    store.drop_name("b")  # a reload of the name: the read under way was of the old source
    assert store.claim(other, "r6") == ("read", None) and store.stats()["reading"] == 1


# -- the engine's read path --------------------------------------------------------------


class DictTier:
    """An in-process AdapterTier: what the Ray one does, without Ray."""

    def __init__(self, fetch_s: float = 0.0) -> None:
        self.store: dict[tuple[str, str], object] = {}
        self.fetches = self.publishes = self.offers = self.abandons = 0
        self.fetch_s = fetch_s  # what a fetch costs

    def fetch(self, lora):
        self.fetches += 1
        time.sleep(self.fetch_s)
        return self.store.get((lora.lora_name, lora.lora_path))

    def publish(self, lora, adapter) -> None:
        self.publishes += 1
        self.store[(lora.lora_name, lora.lora_path)] = adapter

    def offer(self, lora, adapter) -> None:
        self.offers += 1
        self.store.setdefault((lora.lora_name, lora.lora_path), adapter)

    def abandon(self, lora) -> None:
        self.abandons += 1


def _generate(engine: LLMEngine, lora: LoRARequest, tier) -> list[int]:
    engine.insert_lora(lora, engine.read_lora(lora, tier))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("r", "The quick brown fox", params, lora)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return out.outputs[0].token_ids


def test_a_second_engine_takes_the_adapter_from_the_tier(tiny_model_dir, tmp_path):
    """The first engine reads the local folder itself and offers it to the tier; an engine
    on a node without the folder (deleted here) takes it from there."""
    folder = Path(make_adapter_set(tiny_model_dir, tmp_path)["all16"])
    lora = LoRARequest("shared", 1, str(folder))
    tier = DictTier()
    first = LLMEngine(EngineConfig(model=tiny_model_dir, max_loras=2, max_lora_rank=16))
    want = _generate(first, lora, tier)
    assert (tier.fetches, tier.offers, tier.publishes) == (0, 1, 0)
    assert first.stats()["lora"]["shared_reads"] == 0
    shutil.rmtree(folder)  # from here on, only the tier has it

    second = LLMEngine(EngineConfig(model=tiny_model_dir, max_loras=2, max_lora_rank=16))
    assert _generate(second, lora, tier) == want
    assert second.stats()["lora"]["shared_reads"] == 1 and tier.fetches == 1
    # an adapter over this engine's slot rank is a miss (then a disk read, which fails here)
    small = LLMEngine(EngineConfig(model=tiny_model_dir, max_loras=2, max_lora_rank=4))
    with pytest.raises(LoRAError):
        small.read_lora(lora, tier)
    assert small.stats()["lora"]["shared_reads"] == 0
    assert tier.abandons == 1 and tier.publishes == 0  # the failed read ended its claim


def test_a_local_folder_is_asked_of_the_tier_only_where_its_reads_are_slow(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A local folder is read before asking the tier, and offered to it, until this engine's
    local reads measured slow (manager.SLOW_LOCAL_READ_S, a slow disk made here by a sleep);
    then it asks first, as long as asking (a hit or a miss) measures no slower than its
    reads. A source that is not a local folder (a Hub id: a download) is always asked first."""
    from engine.lora import manager

    sets = make_adapter_set(tiny_model_dir, tmp_path)
    x, y, z = (LoRARequest(n, i, str(sets[n])) for i, n in enumerate(("qv4", "all16", "mlp8"), 1))
    tier = DictTier()
    cfg = EngineConfig(model=tiny_model_dir, max_loras=2, max_lora_rank=16)
    engine = LLMEngine(cfg)
    # what the replica reports to the router (routing_stats "reads_shared"): never without a
    # tier; with one, not while its local reads are quick
    assert not engine.reads_shared(tier) and not engine.reads_shared(None)
    engine.read_lora(x, tier)
    engine.read_lora(y, tier)
    assert (tier.fetches, tier.offers, tier.publishes) == (0, 2, 0)
    assert engine.stats()["lora"]["local_read_ms"] < 1000 * manager.SLOW_LOCAL_READ_S
    assert not engine.reads_shared(tier)
    hub = LoRARequest("hub-ad", 9, "some-org/some-adapter")  # not a local folder
    tier.store[("hub-ad", "some-org/some-adapter")] = engine.read_lora(y, None)
    engine.read_lora(hub, tier)  # a download is always asked of the tier first
    assert tier.fetches == 1 and engine.stats()["lora"]["shared_reads"] == 1

    real_load = manager.load_adapter

    def slow_load(*args, **kwargs):  # a network mount: every read takes this long
        time.sleep(1.2 * manager.SLOW_LOCAL_READ_S)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(manager, "load_adapter", slow_load)
    slow = LLMEngine(cfg)
    slow.read_lora(z, tier)  # nothing measured yet: read, offered
    assert (tier.fetches, tier.offers) == (1, 3) and slow.reads_shared(tier)
    slow.read_lora(x, tier)  # now asked first: a hit
    assert tier.fetches == 2 and slow.stats()["lora"]["shared_reads"] == 1
    tier.fetch_s = 2 * manager.SLOW_LOCAL_READ_S  # now asking is slower than reading: asked
    for _ in range(20):  # until the moving average (weight 0.2) crosses over
        if not slow.reads_shared(tier):
            break
        slow.read_lora(y, tier)
    lora = slow.stats()["lora"]
    fetches = tier.fetches
    assert fetches > 3 and lora["tier_fetch_ms"] > lora["local_read_ms"]
    slow.read_lora(z, tier)  # read locally again, and offered (the tier has it already)
    assert tier.fetches == fetches and tier.offers == 4


# -- how an adapter travels -----------------------------------------------------------------


def test_an_adapter_pickles_as_one_out_of_band_buffer():
    """LoRAAdapter.__reduce__: under protocol 5 (Ray's) every weight travels in one buffer,
    one copy into the object store; what comes back is the same weights bit for bit, in
    each one's dtype and shape (an empty one too), writable and not the sender's memory."""
    import pickle

    import torch

    from engine.lora.adapter import LoRAAdapter

    gen = torch.Generator().manual_seed(0)
    weights = {
        (0, "q_proj"): (torch.randn(4, 10, generator=gen), torch.randn(6, 4, generator=gen)),
        (1, "v_proj"): (
            torch.randn(4, 10, generator=gen).to(torch.bfloat16),
            torch.randn(3, 4, generator=gen).to(torch.float16),
        ),
        (1, "o_proj"): (torch.empty(0, 10), torch.randn(5, 1, generator=gen)),
    }
    weights[(0, "q_proj")][0][0, 0] = float("-0.0")  # the bits, not only the value
    adapter = LoRAAdapter("a", 4, 8.0, 2.0, ["q_proj", "v_proj", "o_proj"], weights, "/src")
    adapter.identity = "id-1"
    buffers: list = []
    data = pickle.dumps(adapter, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 4096  # the weights are not in the stream
    assert adapter.num_bytes() <= buffers[0].raw().nbytes <= adapter.num_bytes() + 64 * 6
    for got in (pickle.loads(data, buffers=buffers), pickle.loads(pickle.dumps(adapter))):
        assert (got.name, got.rank, got.lora_alpha, got.scaling, got.source) == (
            "a",
            4,
            8.0,
            2.0,
            "/src",
        )
        assert got.target_modules == adapter.target_modules and got.identity == "id-1"
        assert list(got.weights) == list(weights) and got.num_bytes() == adapter.num_bytes()
        for key, pair in weights.items():
            for want, have in zip(pair, got.weights[key], strict=True):
                assert have.dtype == want.dtype and have.shape == want.shape
                assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))
        got.weights[(0, "q_proj")][1].add_(1.0)  # its own memory: the sender's is untouched
        assert not torch.equal(got.weights[(0, "q_proj")][1], weights[(0, "q_proj")][1])


def test_the_publish_thread_ends_once_ray_is_shut_down(monkeypatch):
    """The publish thread checks the nodes every NODES_CHECK_S while Ray is up; once the
    process is no longer connected (a test's shutdown, a driver's end) it ends instead of
    warning every check, and a later offer starts another."""
    import torch

    import deployments.shared_adapters as shared_adapters
    from deployments.shared_adapters import RayAdapterTier
    from engine.lora.adapter import LoRAAdapter

    monkeypatch.setattr(shared_adapters, "NODES_CHECK_S", 0.05)
    up = [True]
    monkeypatch.setattr(shared_adapters, "_ray_up", lambda: up[0])
    counted: list[float] = []
    tier = RayAdapterTier(None, "m", "r", count_nodes=lambda: counted.append(0.0) or 1)
    w = torch.zeros(1, 1)
    adapter = LoRAAdapter("a", 1, 1.0, 1.0, ["q_proj"], {(0, "q_proj"): (w, w)}, "/a")
    lora = LoRARequest("a", 1, "/a")

    def publish_threads() -> int:
        import threading

        return sum(t.name == "raylora-tier-publish" for t in threading.enumerate())

    def wait(condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    before = publish_threads()
    tier.offer(lora, adapter)  # one node: no registry call (the registry here is None)
    wait(lambda: len(counted) >= 3, "the thread stopped checking while Ray was up")
    assert publish_threads() == before + 1 and tier._publishing is not None
    up[0] = False
    wait(lambda: tier._publishing is None, "the thread outlived Ray")
    wait(lambda: publish_threads() == before, "the thread outlived Ray")
    checks = len(counted)
    time.sleep(0.3)
    assert len(counted) == checks  # no more checks, so no more warnings
    up[0] = True
    tier.offer(lora, adapter)
    wait(lambda: len(counted) > checks, "a later offer started no thread")
    up[0] = False
    wait(lambda: publish_threads() == before, "the second thread outlived Ray")
