"""The shared adapter tier on a local Ray cluster (deployments/shared_adapters.py
RayAdapterTier): a replica's read shared through the object store until the replica goes,
and local reads offered only while another node is alive. The registry's store and the
engine's read path through a tier: tests/test_shared_adapters.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import EngineConfig, LLMEngine, LoRARequest
from tests.lora_fixtures import make_adapter_set

pytestmark = pytest.mark.timeout(300)


def test_ray_tier_shares_a_replicas_read_until_it_goes(ray_cluster, tiny_model_dir, tmp_path):
    """An actor (a replica) reads the adapter and publishes it; the driver fetches the same
    weights; another model's key and a re-registration of the name get nothing; once the
    reader is gone its copy is a miss, and the registry forgets it. Two replicas missing the
    adapter at once: one reads, the other waits for its copy (or reads, if the read fails)."""
    import ray
    import torch

    from deployments.registry import get_or_create_registry
    from deployments.shared_adapters import RayAdapterTier

    folder = str(make_adapter_set(tiny_model_dir, tmp_path)["qv4"])
    lora = LoRARequest("ray-shared", 1, folder)
    registry = get_or_create_registry(shared_tier_bytes=64 << 20)
    assert ray.get(registry.shared_stats.remote())["budget_bytes"] == 64 << 20

    @ray.remote(num_cpus=0)
    class Reader:
        def read(self, model_dir: str) -> dict:
            from deployments.registry import get_registry

            engine = LLMEngine(EngineConfig(model=model_dir, max_loras=2, max_lora_rank=16))
            # as on a cluster of two nodes, where a local read is offered
            tier = RayAdapterTier(get_registry(), "tiny", "reader-1", count_nodes=lambda: 2)
            adapter = engine.read_lora(lora, tier)
            return {k: (a.clone(), b.clone()) for k, (a, b) in adapter.weights.items()}

    def shared_count() -> int:
        return ray.get(registry.shared_stats.remote())["adapters"]

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 30  # shared_put / shared_forget are fire-and-forget
        while shared_count() != count:
            assert time.monotonic() < deadline, f"the registry never held {count} adapters"
            time.sleep(0.1)

    RayAdapterTier(registry, "tiny", "warm").warm_up()  # a local put: the registry keeps none
    assert shared_count() == 0
    reader = Reader.remote()
    want = ray.get(reader.read.remote(tiny_model_dir), timeout=240)
    wait_for(1)
    tier = RayAdapterTier(registry, "tiny")
    got = tier.fetch(lora)
    assert got is not None and got.name == "ray-shared" and set(got.weights) == set(want)
    for k, (a, b) in want.items():
        assert torch.equal(got.weights[k][0], a) and torch.equal(got.weights[k][1], b)
    assert RayAdapterTier(registry, "other-model").fetch(lora) is None  # another model's key

    ray.get(registry.remove_replica.remote("reader-1"))  # the registry forgets the reader:
    assert shared_count() == 0 and tier.fetch(lora) is None  # its copies go with it
    # that miss claimed the read; the driver reads nothing, so it ends the claim (the reader
    # below would wait for it); ray.get: done before the reader asks
    ray.get(registry.shared_abandon.remote(tier.key(lora), tier.owner))

    ray.get(reader.read.remote(tiny_model_dir), timeout=240)  # a miss: read, shared again
    wait_for(1)
    ray.kill(reader)  # the owner of the copy dies without a word to the registry
    time.sleep(1)
    assert tier.fetch(lora) is None  # a miss, not an error: the caller reads from disk
    wait_for(0)

    tier.publish(lora, got)  # the driver shares its own copy; a reload of the name drops it
    wait_for(1)
    # an offer (a local read that did not ask first) of a kept key puts nothing: forgetting
    # the offerer leaves the driver's copy (_publish_now: what offer's thread does; as on a
    # cluster of two nodes, where offers are made)
    offerer = RayAdapterTier(registry, "tiny", "offerer", count_nodes=lambda: 2)
    offerer._publish_now(lora, got, offered=True)
    ray.get(registry.remove_replica.remote("offerer"))
    assert shared_count() == 1
    ray.get(registry.register_adapter.remote("ray-shared", folder, 4, ["q_proj"], "tiny"))
    assert tier.fetch(lora) is None and shared_count() == 0
    ray.get(registry.shared_abandon.remote(tier.key(lora), tier.owner))

    # single flight: while replica a reads the adapter, b waits for a's copy and takes it
    a, b = RayAdapterTier(registry, "tiny", "replica-a"), RayAdapterTier(registry, "tiny", "b")
    assert a.fetch(lora) is None  # a misses: a reads it
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(b.fetch, lora)
        time.sleep(0.5)
        assert not waiting.done(), "b read the adapter a second time instead of waiting"
        a.publish(lora, got)
        fetched = waiting.result(timeout=30)
    assert fetched is not None and set(fetched.weights) == set(want)
    for k, (x, y) in want.items():
        assert torch.equal(fetched.weights[k][0], x) and torch.equal(fetched.weights[k][1], y)
    # a read that fails ends the claim: the waiter is told to read
    ray.get(registry.register_adapter.remote("ray-shared", folder, 4, ["q_proj"], "tiny"))
    assert a.fetch(lora) is None
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(b.fetch, lora)
        time.sleep(0.5)
        assert not waiting.done()
        a.abandon(lora)
        assert waiting.result(timeout=30) is None
    assert ray.get(registry.shared_stats.remote())["waits"] >= 2


def test_local_reads_are_offered_only_while_another_node_is_alive(
    ray_cluster, tiny_model_dir, tmp_path, monkeypatch
):
    """On one node every replica reads the folder itself: an offer makes no registry call and
    puts nothing. When a second node appears, the publish thread offers what the replica
    holds (its CPU cache's local reads), and later reads are offered as they come."""
    import ray

    import deployments.shared_adapters as shared_adapters
    from deployments.registry import get_or_create_registry
    from deployments.shared_adapters import RayAdapterTier

    monkeypatch.setattr(shared_adapters, "NODES_CHECK_S", 0.2)
    folders = make_adapter_set(tiny_model_dir, tmp_path)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, max_loras=2, max_lora_rank=16))
    held = LoRARequest("node-held", 1, str(folders["qv4"]))
    later = LoRARequest("node-later", 2, str(folders["all16"]))
    engine.add_lora(held)
    assert [lora.lora_name for lora, _ in engine.cached_local_reads()] == ["node-held"]
    registry = get_or_create_registry()
    nodes = [1]
    tier = RayAdapterTier(registry, "tiny", "node-test", count_nodes=lambda: nodes[0])
    tier.cached = engine.cached_local_reads

    def kept(lora: LoRARequest) -> bool:
        return ray.get(registry.shared_has.remote(tier.key(lora)))

    def wait_kept(lora: LoRARequest) -> None:
        deadline = time.monotonic() + 30
        while not kept(lora):
            assert time.monotonic() < deadline, f"{lora.lora_name} was never offered"
            time.sleep(0.1)

    tier.offer(held, engine.read_lora(held))
    time.sleep(1.0)  # the publish thread has handled it, and checked the nodes again
    assert not kept(held)
    nodes[0] = 2  # a node joins: the cache is offered without a new read
    wait_kept(held)
    tier.offer(later, engine.read_lora(later))
    wait_kept(later)
    ray.get(registry.remove_replica.remote("node-test"))
