"""Adapter tiers below the scheduler: disk/Hub -> CPU cache (LRU) -> max_loras slots.

The scheduler decides which adapter sits in which slot (engine/scheduler.py SlotTable);
this manager owns the weights: the CPU cache of validated adapters and, per packed linear,
the stacked slot tensors the kernels read (raylora_kernels.SlotWeights), for each slice s of the
packed module (q/k/v, gate/up):
    lora_a[s]: [max_loras, max_lora_rank, in_features]   (zero-padded past the adapter's rank)
    lora_b[s]: [max_loras, out_features_s, max_lora_rank] (scaling folded in)
as views of SlotWeights.a (the slices' A stacked) and SlotWeights.b_t (their B^T side by
side), the layouts the CPU path reads fastest.
Modules an adapter does not target stay zero in its slot, so they contribute nothing.
"""

import hashlib
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

from engine.config import LoRAConfig
from engine.lora.adapter import (
    LoRAAdapter,
    LoRAModelSpec,
    load_adapter,
    resolve_adapter_dir,
    source_stamp,
)
from engine.lora.request import LoRARequest
from engine.models.llama import PACKED_MODULES, LoRALinear
from raylora_kernels import SlotWeights


class AdapterTier(Protocol):
    """A tier between the CPU cache and disk/Hub that replicas share (on Ray Serve the object
    store, deployments/shared_adapters.py): an adapter one replica read is fetched there by the
    others instead of being read again. The calls never raise: a tier that fails is a miss,
    and the read goes to disk/Hub. `fetch` blocks (a worker thread makes it); a miss may be a
    claim on the read (the others wait for this replica's copy): the reader then publishes
    what it read, or abandons the read if it failed. `offer` shares what a replica read
    without asking first (a local folder), if the tier lacks it: a replica on a node without
    the folder may ask for it. publish and offer return at once (the sharing runs aside)."""

    def fetch(self, lora: LoRARequest) -> LoRAAdapter | None: ...

    def publish(self, lora: LoRARequest, adapter: LoRAAdapter) -> None: ...

    def offer(self, lora: LoRARequest, adapter: LoRAAdapter) -> None: ...

    def abandon(self, lora: LoRARequest) -> None: ...


# A local folder is read before asking the tier unless its reads take this long (moving
# average). Asking costs a registry round trip and, on a hit, a copy out of the object store;
# measured on the real routing benchmark (SmolLM2-135M, 19 MB adapters read in 38 ms here, a
# fetch measured faster), asking first cost the tail: p99 1.13x / 1.05x / 1.21x the peer's
# against 1.06x / 0.98x reading locally (docs/benchmarks.md). Reads this slow are a network
# mount or adapters of hundreds of MB, where a copy from memory can save the request path.
SLOW_LOCAL_READ_S = 0.25


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        spec: LoRAModelSpec,
        linears: dict[tuple[int, str], LoRALinear],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.spec = spec
        self.device, self.dtype = device, dtype
        self.cpu_cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.known: dict[str, LoRARequest] = {}  # every adapter validated once
        self.pinned: set[str] = set()
        # eviction order: the unpinned adapter with the lowest priority(name), LRU among
        # equals; None = plain LRU (vLLM's). See SlotTable.priority.
        self.priority: Callable[[str], float] | None = None
        self.slot_names: list[str | None] = [None] * config.max_loras
        self.num_loads = self.num_cpu_hits = self.num_cpu_evictions = 0
        self.num_shared_reads = 0  # reads answered by an AdapterTier (not disk/Hub)
        # seconds, moving averages: reads of a local folder, and fetches a tier answered
        self.local_read_s: float | None = None
        self.local_read_cpu_s: float | None = None  # the reading thread's CPU time (quick_read)
        self.tier_fetch_s: float | None = None
        self.linears = linears
        L, R = config.max_loras, config.max_lora_rank
        for lin in linears.values():
            lin.lora = SlotWeights.zeros(L, R, lin.weight.shape[1], lin.out_sizes, device, dtype)
            # each slot's rank per slice, for the C++ CPU and Triton kernels (SlotWeights.ranks)
            lin.lora.ranks = torch.zeros(L, len(lin.out_sizes), dtype=torch.int64)
            lin.lora.sync_ranks()

    # -- CPU cache --------------------------------------------------------------------
    # Loading is split so that the disk/Hub read can run without the engine lock:
    #   lora_to_read (quick, reads the cache)  ->  read_lora (slow, touches nothing shared)
    #   ->  insert_lora (quick, under the lock). add_lora does all three in one go.
    def lora_to_read(self, lora: LoRARequest) -> LoRARequest | None:
        """The request to read from disk/Hub, or None if the CPU cache already holds it.
        Only looks at the cache: a stale answer costs a read, never a wrong adapter
        (insert_lora checks again)."""
        cached = self.cpu_cache.get(lora.lora_name)
        if cached is not None:
            _check_same_source(lora, cached)
            return None
        if not lora.lora_path:  # reload by name after a CPU eviction
            return self.known.get(lora.lora_name, lora)
        return lora

    def read_lora(self, lora: LoRARequest, tier: AdapterTier | None = None) -> LoRAAdapter:
        """Read and validate an adapter (raises LoRAError). Uses only the immutable model spec,
        so it is safe in a worker thread while the engine steps (the content hash too).
        tier: ask it first where `tier_first`, and publish there what is read after asking;
        a local folder read without asking is offered to it (shared if it lacks it)."""
        local, use_tier = self._read_source(lora, tier)
        if use_tier:
            t0 = time.perf_counter()
            adapter = tier.fetch(lora)
            # what asking costs, hit or miss (a miss is a registry round trip before the read)
            self.tier_fetch_s = _average(self.tier_fetch_s, time.perf_counter() - t0)
            # another deployment's limits may differ: what this one cannot take is a miss
            if adapter is not None and adapter.rank <= self.config.max_lora_rank:
                self.num_shared_reads += 1  # a worker thread: a stats counter, not exact
                return adapter
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            # the folder itself, or a Hub repo's snapshot in the local cache (downloaded once)
            folder = resolve_adapter_dir(lora.lora_path, lora.lora_name)
            stamp = source_stamp(str(folder))  # before the read
            adapter = load_adapter(lora.lora_path, lora.lora_name, self.spec, folder)
            if stamp is not None and source_stamp(str(folder)) != stamp:
                stamp = None  # written during the read: the stamp does not name what was read
            adapter.identity = (
                folder_identity(str(folder), stamp) if stamp else adapter_identity(adapter)
            )
        except BaseException:
            if use_tier:
                tier.abandon(lora)  # another replica may be waiting for this read
            raise
        if local:
            self.local_read_s = _average(self.local_read_s, time.perf_counter() - t0)
            self.local_read_cpu_s = _average(self.local_read_cpu_s, time.thread_time() - cpu0)
        if use_tier:  # ends this replica's claim on the key, if the fetch made one
            tier.publish(lora, adapter)
        elif tier is not None and local:
            tier.offer(lora, adapter)
        return adapter

    def read_costs_ms(self) -> dict[str, float | None]:
        """What tier_first and quick_read compare (moving averages; None until measured)."""
        ms = {
            "local_read_ms": self.local_read_s,
            "local_read_cpu_ms": self.local_read_cpu_s,
            "tier_fetch_ms": self.tier_fetch_s,
        }
        return {k: None if v is None else 1000 * v for k, v in ms.items()}

    def tier_first(self, local: bool) -> bool:
        """Ask the shared tier before reading? Always for a source that is not a local folder
        (a Hub or object-storage download: seconds, and every replica would pay it). For a
        local folder, only once its reads measured slow (SLOW_LOCAL_READ_S, which says why),
        and then unless asking (a hit or a miss) measured slower still. With KB-sized adapters
        asking first also cost a first touch 9 ms to its first token against 4.9."""
        if not local:
            return True
        if self.local_read_s is None or self.local_read_s < SLOW_LOCAL_READ_S:
            return False
        return self.tier_fetch_s is None or self.tier_fetch_s <= self.local_read_s

    def quick_read(self, lora: LoRARequest, tier: AdapterTier | None = None) -> bool:
        """Is reading `lora` quick enough to make under the engine lock, as vLLM reads in its
        step? True if the CPU cache holds it, or if it is a local folder this replica reads
        itself (`tier_first` false) and its local reads took less CPU than one GIL switch
        interval (5 ms; KB-sized adapters take ~1 ms) and less wall time than ten. Beside a
        running step such a read gains nothing (the two threads share the GIL) and waits for
        the GIL at every turn. CPU time, because a read beside a step is mostly such waits;
        the wall-time bound keeps a disk that makes reads wait without CPU (a network file
        system) off the lock, and the caller stops quick reads for good once one held the
        lock longer than a switch interval (AsyncLLMEngine)."""
        to_read = self.lora_to_read(lora)
        if to_read is None:
            return True
        cpu, wall, interval = self.local_read_cpu_s, self.local_read_s, sys.getswitchinterval()
        if cpu is None or wall is None or cpu >= interval or wall >= 10 * interval:
            return False
        local, use_tier = self._read_source(to_read, tier)
        return local and not use_tier

    def _read_source(self, lora: LoRARequest, tier: AdapterTier | None) -> tuple[bool, bool]:
        """(is `lora` a local folder, does read_lora ask `tier` first for it)."""
        local = os.path.isdir(os.path.expanduser(lora.lora_path or ""))
        return local, tier is not None and self.tier_first(local)

    def insert_lora(self, lora: LoRARequest, adapter: LoRAAdapter) -> LoRAAdapter:
        """Put a read adapter into the CPU cache (evicting the LRU unpinned one if full). If
        the same adapter got in meanwhile, that copy stays and is returned."""
        name = lora.lora_name
        cached = self.cpu_cache.get(name)
        if cached is not None:
            _check_same_source(lora, cached)
            self.cpu_cache.move_to_end(name)
            self.num_cpu_hits += 1
            return cached
        self.num_loads += 1
        if adapter.identity is None:
            adapter.identity = adapter_identity(adapter)
        self._make_room()
        self.cpu_cache[name] = adapter
        self.known[name] = lora
        return adapter

    def add_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """Validate and load into the CPU cache (raises LoRAError before touching anything)."""
        to_read = self.lora_to_read(lora)
        if to_read is None:
            return self.insert_lora(lora, self.cpu_cache[lora.lora_name])  # counts the hit
        return self.insert_lora(to_read, self.read_lora(to_read))

    def _make_room(self) -> None:
        while len(self.cpu_cache) >= self.config.max_cpu_loras:
            unpinned = [n for n in self.cpu_cache if n not in self.pinned]  # LRU first
            if not unpinned:
                raise RuntimeError("every adapter in the CPU cache is pinned; raise max_cpu_loras")
            victim = unpinned[0] if self.priority is None else min(unpinned, key=self.priority)
            del self.cpu_cache[victim]
            self.num_cpu_evictions += 1

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter: CPU cache, pin, and the name of any slot it sits in."""
        self.pinned.discard(name)
        self.known.pop(name, None)
        self.slot_names = [None if n == name else n for n in self.slot_names]
        return self.cpu_cache.pop(name, None) is not None

    def pin_lora(self, name: str) -> None:
        if name not in self.cpu_cache:
            raise KeyError(f"adapter {name!r} is not loaded")
        self.pinned.add(name)

    # -- slots ------------------------------------------------------------------------
    def activate(self, slot: int, lora: LoRARequest) -> None:
        """Copy an adapter into a slot (reloading it from disk if the CPU cache dropped it)."""
        self.slot_names[slot] = None  # until the copy is complete: a failed one leaves no name
        adapter = self.add_lora(lora)
        R = self.config.max_lora_rank
        r = adapter.rank
        for (layer, packed), lin in self.linears.items():
            for s, module in enumerate(PACKED_MODULES[packed]):
                a_slot, b_slot = lin.lora.lora_a[s][slot], lin.lora.lora_b[s][slot]
                w = adapter.weights.get((layer, module))
                lin.lora.ranks[slot, s] = 0 if w is None else r
                if w is None:
                    a_slot.zero_()
                    b_slot.zero_()
                    continue
                a, b = w
                a_slot[:r].copy_(a)
                a_slot[r:R].zero_()
                b_slot[:, :r].copy_(b * adapter.scaling)  # b on the CPU, the slot maybe not
                b_slot[:, r:R].zero_()
        for lin in self.linears.values():
            lin.lora.sync_ranks()
        self.slot_names[slot] = lora.lora_name

    def cached_local_reads(self) -> list[tuple[LoRARequest, LoRAAdapter]]:
        """The CPU cache's adapters read from local folders, each with the request it was read
        for (what a shared tier is offered, AdapterTier.offer). Safe from any thread: one
        snapshot of the cache."""
        held = list(self.cpu_cache.items())
        out = []
        for name, adapter in held:
            lora = self.known.get(name)
            if lora is not None and self._read_source(lora, None)[0]:  # a local folder
                out.append((lora, adapter))
        return out

    def residency(self) -> tuple[list[str], list[str]]:
        """(adapters in slots, adapters in the CPU cache)."""
        return [n for n in self.slot_names if n is not None], list(self.cpu_cache)

    def stats(self) -> dict:
        slots, cpu = self.residency()
        return {
            "loads": self.num_loads,
            "shared_reads": self.num_shared_reads,  # of the reads, fetched from a shared tier
            **self.read_costs_ms(),
            "cpu_hits": self.num_cpu_hits,
            "cpu_evictions": self.num_cpu_evictions,
            "adapters_in_slots": slots,
            "adapters_in_cpu": cpu,
        }


def folder_identity(path: str, stamp: tuple) -> str:
    """The identity of an adapter read from a local folder (or a Hub repo's snapshot in the
    local cache) whose files had `stamp` before and after the read (source_stamp: then they
    held the bytes the stamp names): sha256 of the folder's real path and the stamp, no pass
    over the weights. Files written since (in place too) get another stamp, so another
    identity: a reload from other weights never reuses the old one's KV blocks, a reread of
    the same files after a CPU-cache eviction does, under any name or path that reaches the
    same folder. A copy of the files in another folder is another identity (as every adapter
    is to vLLM's prefix cache)."""
    key = repr(("folder", os.path.realpath(os.path.expanduser(path)), stamp))
    return hashlib.sha256(key.encode()).hexdigest()


def adapter_identity(adapter: LoRAAdapter) -> str:
    """sha256 of everything the adapter computes with: each (layer, module)'s A and B (bytes,
    shape, dtype) and the scaling. Its name and source are left out: the identity is the
    weights, so a reload from other weights under the same name never reuses the old one's
    KV blocks, and a reread of the same weights still does. For what has no stamp (files
    written in the last RACY_S seconds, an adapter given as weights): ~13 ms of a
    core for 20 MB of weights, as much as the read itself (folder_identity makes none)."""
    h = hashlib.sha256(f"scaling={adapter.scaling!r}".encode())
    for key in sorted(adapter.weights):
        h.update(repr(key).encode())
        for w in adapter.weights[key]:
            w = w.detach().cpu().contiguous()
            h.update(f"{w.dtype}{tuple(w.shape)}".encode())
            h.update(w.view(torch.uint8).numpy() if w.numel() else b"")
    return h.hexdigest()


def _check_same_source(lora: LoRARequest, cached: LoRAAdapter) -> None:
    if lora.lora_path and cached.source != lora.lora_path:
        raise ValueError(
            f"adapter {lora.lora_name!r} is already loaded from {cached.source!r}; "
            f"remove it before loading it from {lora.lora_path!r}"
        )


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average (the first sample as it is)."""
    return new if old is None else (1 - weight) * old + weight * new
