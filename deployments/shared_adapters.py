"""The shared adapter tier: an adapter read from disk/Hub once, fetched by every other replica
from the Ray object store.

Without it every replica that takes an adapter reads it from the cold tier, and the router
trades those reads against balance: a hot adapter grown onto one more replica, an adapter
moved off a busy one, each costs a cold read (seconds from object storage). With it the first
reader parses and validates the adapter, `ray.put`s it and registers the ref with the
registry actor; the others fetch it (a copy across the cluster's network, no parsing). The
reader owns the object: when it goes (scaled down, failed), its copies go with it, and the
next reader of each reads from disk and shares again. An adapter in a local folder is read
where it is before asking, unless this replica's local reads measured slow (a network mount;
LoRAManager.tier_first), and offered to the tier: the first offer of each is kept, for
replicas on nodes without the folder. docs/routing.md has what the tier does to the routing
sweep.

- `SharedAdapterStore` (inside the registry actor): key -> the adapter's ref, LRU under a byte
  budget. A key is (model, adapter name, source): another deployment's model never gets it, and
  loading a name from another source is another key. The load and unload APIs drop every key
  of the name (AdapterRegistry.register_adapter / unregister_adapter).
- `RayAdapterTier` (in each replica, engine.lora.manager.AdapterTier): fetch, publish, offer
  and abandon. Never raises: a tier that fails (registry gone, the owner of the copy gone, a
  timeout) is a miss, the read goes to disk, and a lost copy's key is forgotten.
- One read at a time per key (single flight): the miss that sends a replica to the cold tier
  is a *claim* on the key (`SharedAdapterStore.claim`), and a replica that misses while
  another holds the claim waits for that replica's copy instead of reading the same adapter
  a second time (two homes of a new hot adapter, or two routers' first requests for it,
  reach two replicas within one read: a second object-storage download). The claim ends
  with the reader's put or abandon (its read failed), when its replica is forgotten, or
  after `claim_s`; then a waiter reads itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the registry actor imports this module: it must not import torch
    from engine.lora.adapter import LoRAAdapter
    from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

DEFAULT_SHARED_TIER_BYTES = 2 << 30  # of the object store, for adapters (the registry's budget)
# a reader's claim on a key: the others wait this long at most for its copy (an adapter of
# hundreds of MB from object storage takes seconds to tens of seconds)
DEFAULT_CLAIM_S = 60.0
# a waiter asks again after 5 ms, 10 ms, ... at most every 0.5 s: a local read is done in
# milliseconds, one from object storage in seconds
MIN_POLL_S, MAX_POLL_S = 0.005, 0.5
Key = tuple[str, str, str]  # (model, adapter name, source)
# how often a replica's publish thread asks Ray how many nodes are alive: a local folder's
# read is offered only while another node is (RayAdapterTier.offer says why)
NODES_CHECK_S = 10.0


class SharedAdapterStore:
    """key -> ([ref], bytes, owner), least recently fetched first; kept within `budget_bytes`
    (an adapter larger than the whole budget is not kept). Holding the ref is what keeps the
    object alive: a dropped entry's object is freed once no replica is still fetching it.
    `owner` is the replica that put it: when the registry forgets a replica (it left, or
    stopped reporting), its copies are dropped too, so no reader waits on a dead owner (on
    the real app each such fetch cost about a second before it fell back to disk)."""

    def __init__(
        self,
        budget_bytes: int = DEFAULT_SHARED_TIER_BYTES,
        claim_s: float = DEFAULT_CLAIM_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if int(budget_bytes) < 0:
            raise ValueError(f"shared tier budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.entries: OrderedDict[Key, tuple[list[Any], int, str]] = OrderedDict()
        self.total_bytes = 0
        self.hits = self.misses = self.evictions = self.waits = 0
        self.claim_s = claim_s
        self.clock = clock
        self.reading: dict[Key, tuple[str, float]] = {}  # key -> (claimed by, at)

    def get(self, key: Key) -> list[Any] | None:
        refs = self._hit(key)
        if refs is None:
            self.misses += 1
        return refs

    def _hit(self, key: Key) -> list[Any] | None:
        """The refs under `key`, counted as a hit and made the most recent; None if absent."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return entry[0]

    def claim(self, key: Key, owner: str) -> tuple[str, list[Any] | None]:
        """What `owner`, missing `key` in its CPU cache, does: ("hit", refs): fetch them;
        ("read", None): read it from the cold tier, then put (or abandon) it: until then
        the others wait; ("wait", None): another replica is reading it, ask again shortly."""
        refs = self._hit(key)
        if refs is not None:
            return "hit", refs
        claim = self.reading.get(key)
        now = self.clock()
        if claim is not None and claim[0] != owner and now - claim[1] < self.claim_s:
            self.waits += 1
            return "wait", None
        self.misses += 1
        self.reading[key] = (owner, now)
        return "read", None

    def has(self, key: Key) -> bool:
        """Is a copy kept under `key`? (Not a fetch: counts nothing, moves nothing.)"""
        return key in self.entries

    def abandon(self, key: Key, owner: str) -> None:
        """`owner`'s read of `key` failed: its claim ends (a waiter reads next)."""
        if self.reading.get(key, ("",))[0] == owner:
            del self.reading[key]

    def put(self, key: Key, refs: list[Any], num_bytes: int, owner: str = "") -> bool:
        """Keep `refs` (a one-element list: Ray passes a bare ref by value) under `key`,
        replacing what was there, and end the claim on it; evict the least recently fetched
        to fit. False if the adapter alone is over the budget."""
        self.reading.pop(key, None)
        self.forget(key)
        if num_bytes > self.budget_bytes:
            return False
        while self.entries and self.total_bytes + num_bytes > self.budget_bytes:
            _, (_, size, _) = self.entries.popitem(last=False)
            self.total_bytes -= size
            self.evictions += 1
        self.entries[key] = (refs, int(num_bytes), owner)
        self.total_bytes += int(num_bytes)
        return True

    def forget(self, key: Key) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.total_bytes -= entry[1]

    def drop_name(self, name: str) -> int:
        """Forget every key of adapter `name` (any model, any source) and the reads of it
        under way (a reload: their copies would be of the old source); how many keys."""
        self.reading = {k: c for k, c in self.reading.items() if k[1] != name}
        return self._drop([k for k in self.entries if k[1] == name])

    def drop_owners(self, gone: set[str]) -> int:
        """Forget the copies that the replicas in `gone` put, and their claims; how many
        copies."""
        self.reading = {k: c for k, c in self.reading.items() if c[0] not in gone}
        return self._drop([k for k, e in self.entries.items() if e[2] in gone])

    def owners(self) -> set[str]:
        return {e[2] for e in self.entries.values()}

    def _drop(self, keys: list[Key]) -> int:
        for key in keys:
            self.forget(key)
        return len(keys)

    def stats(self) -> dict[str, int]:
        return {
            "adapters": len(self.entries),
            "bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,  # answered "read": a read from the cold tier
            "waits": self.waits,  # answered "wait" (a replica asks again until it is done)
            "reading": len(self.reading),
            "evictions": self.evictions,
        }


class RayAdapterTier:
    """engine.lora.manager.AdapterTier over the registry actor's SharedAdapterStore."""

    def __init__(
        self,
        registry: Any,
        model: str,
        owner: str = "",
        registry_timeout_s: float = 5.0,
        timeout_s: float = 60.0,
        count_nodes: Callable[[], int] | None = None,
    ) -> None:
        """owner: this replica's id (the registry drops its copies when it forgets it).
        count_nodes: the cluster's alive nodes (Ray's node table by default)."""
        self.registry = registry
        self.model = model
        self.owner = owner
        self.registry_timeout_s = registry_timeout_s  # a restarting registry: read from disk
        self.timeout_s = timeout_s  # the copy itself (tens of MB across the network)
        self._publishing: queue.SimpleQueue | None = None  # publish's background thread
        self._publishing_lock = threading.Lock()
        self.count_nodes = count_nodes or _alive_nodes
        # what this replica holds read from local folders (its CPU cache): offered when a
        # second node appears (LLMServer sets it; the publish thread calls it)
        self.cached: Callable[[], list[tuple[LoRARequest, LoRAAdapter]]] | None = None
        self._other_nodes = False  # at the last check, another node was alive
        self._nodes_checked: float | None = None  # time.monotonic() of that check

    def key(self, lora: LoRARequest) -> Key:
        return (self.model, lora.lora_name, lora.lora_path or "")

    def warm_up(self) -> None:
        """Put (and drop) a one-weight adapter in this process's object store, registering
        nothing: a process's first `ray.put` costs ~100 ms of CPU whatever its size (Ray's
        serialization set-up, measured), which would otherwise fall on the first offer's
        background thread, holding the GIL beside the replica's first steps."""
        import ray
        import torch

        from engine.lora.adapter import LoRAAdapter

        w = torch.zeros(1, 1)
        try:
            ray.put(LoRAAdapter("warm-up", 1, 1.0, 1.0, ["q_proj"], {(0, "q_proj"): (w, w)}, ""))
        except Exception as e:  # only a cost moved to start-up; nothing depends on it
            logger.warning("raylora: shared tier warm-up put failed (%s)", e)

    def fetch(self, lora: LoRARequest) -> LoRAAdapter | None:
        import ray

        from engine.lora.adapter import LoRAAdapter

        key = self.key(lora)
        pause = MIN_POLL_S
        while True:
            try:
                status, refs = ray.get(
                    self.registry.shared_claim.remote(key, self.owner),
                    timeout=self.registry_timeout_s,
                )
            except Exception as e:  # no registry now: read from disk
                logger.warning("raylora: shared adapter tier unavailable (%s)", e)
                return None
            if status != "wait":
                break
            time.sleep(pause)  # another replica reads it: its copy comes in one read's time
            pause = min(2 * pause, MAX_POLL_S)
        if status != "hit" or not refs:
            return None  # claimed: this replica reads it, then publishes or abandons it
        try:
            adapter = ray.get(refs[0], timeout=self.timeout_s)
        except Exception as e:  # lost (its owner is gone) or too slow: forget it, read
            logger.warning("raylora: shared copy of %s unavailable (%s)", lora.lora_name, e)
            self.registry.shared_forget.remote(key)
            return None
        return adapter if isinstance(adapter, LoRAAdapter) else None

    def abandon(self, lora: LoRARequest) -> None:
        """This replica's read failed: its claim ends, so a replica waiting reads itself."""
        try:
            self.registry.shared_abandon.remote(self.key(lora), self.owner)
        except Exception as e:  # the claim expires by itself after DEFAULT_CLAIM_S
            logger.warning("raylora: could not end the read claim on %s (%s)", lora.lora_name, e)

    def offer(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        """Share an adapter this replica read without asking the tier first (a local folder,
        LoRAManager.tier_first) if the tier lacks it, for replicas on nodes without the
        folder: in the background thread, a registry call, and a put only for the first
        offer of each key (every replica on the folder's node offers what it reads). Only
        while another node is alive: on one node every replica reads the folder itself, and
        the registry call per read and the put per adapter were cost alone (on the real
        routing benchmark affinity's misses reached their first token at p50 107 ms against
        the peer's 90 with them, 84-97 against 85-93 without, docs/benchmarks.md). When a
        second node appears, the publish thread offers what `cached` lists (checked every
        NODES_CHECK_S)."""
        self._enqueue(lora, adapter, True)

    def publish(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        """Share an adapter this replica read after a miss: handed to a background thread, so
        the request that read it does not wait for the ray.put and the registry call (on the
        real routing benchmark they cost a first touch ~5 ms to its first token on a busy
        replica). A replica waiting for the copy meanwhile polls until it lands (single
        flight)."""
        self._enqueue(lora, adapter, False)

    def _enqueue(self, lora: LoRARequest, adapter: LoRAAdapter, offered: bool) -> None:
        with self._publishing_lock:
            if self._publishing is None:
                self._publishing = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._publish_loop, name="raylora-tier-publish", daemon=True
                )
                thread.start()
            self._publishing.put((lora, adapter, offered))

    def _publish_loop(self) -> None:
        assert self._publishing is not None
        while True:
            try:
                lora, adapter, offered = self._publishing.get(timeout=NODES_CHECK_S)
            except queue.Empty:
                if not _ray_up() and self._stop_publishing():
                    return  # Ray was shut down (a test, a driver's end): nothing to share with
                self._check_nodes()  # a node that joins gets this replica's cache
                continue
            self._publish_now(lora, adapter, offered)

    def _stop_publishing(self) -> bool:
        """End the publish thread if nothing is queued (a later publish starts another)."""
        with self._publishing_lock:
            if self._publishing is None or not self._publishing.empty():
                return False
            self._publishing = None
            return True

    def _check_nodes(self) -> None:
        """Every NODES_CHECK_S at most: is another node alive? If one appeared since the last
        check, offer what `cached` lists (queued for the publish thread)."""
        now = time.monotonic()
        if self._nodes_checked is not None and now - self._nodes_checked < NODES_CHECK_S:
            return
        self._nodes_checked = now
        try:
            other_nodes = self.count_nodes() > 1
        except Exception as e:  # not known: offer, as where it would be needed
            logger.warning("raylora: could not count the cluster's nodes (%s)", e)
            other_nodes = True
        joined, self._other_nodes = other_nodes and not self._other_nodes, other_nodes
        if joined and self.cached is not None:
            try:
                held = self.cached()
            except Exception as e:  # only the catch-up is lost; later reads are offered
                logger.warning("raylora: could not list the adapters to offer (%s)", e)
                return
            for lora, adapter in held:
                self._enqueue(lora, adapter, True)

    def _publish_now(self, lora: LoRARequest, adapter: LoRAAdapter, offered: bool = False) -> None:
        """What publish (offered: offer) does, in the caller's thread."""
        import ray

        if offered:  # nobody holds a claim on an offer: skip it where a copy is kept
            self._check_nodes()
            if not self._other_nodes:  # one node: every replica reads the folder itself
                return
            try:
                key = self.key(lora)
                if ray.get(self.registry.shared_has.remote(key), timeout=self.registry_timeout_s):
                    return
            except Exception as e:  # no registry now: nothing to share with
                logger.warning("raylora: could not offer %s to the tier (%s)", lora.lora_name, e)
                return
        try:
            # This replica owns the copy (Ray 2.56 removed ray.put's _owner): the registry's
            # ref keeps it alive as long as the replica lives; after that a fetch fails, is
            # forgotten, and the next reader reads from disk and shares its own copy.
            ref = ray.put(adapter)
            self.registry.shared_put.remote(self.key(lora), [ref], adapter.num_bytes(), self.owner)
        except Exception as e:  # the adapter is read; only the sharing failed
            logger.warning("raylora: could not share %s (%s)", lora.lora_name, e)
            self.abandon(lora)  # nobody waits for a copy that will not come


def _ray_up() -> bool:
    """Whether this process is connected to Ray (always, in a replica)."""
    import ray

    return ray.is_initialized()


def _alive_nodes() -> int:
    """The cluster's alive nodes (Ray's node table: a call to its control store)."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))
