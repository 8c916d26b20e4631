"""AsyncLLMEngine: LLMEngine stepped by a background thread, one async stream per request.

The forward pass is blocking CPU/GPU work, so it runs in its own thread; the engine itself is
not thread-safe, so every call into it holds `self._lock`. Outputs cross back into asyncio
with loop.call_soon_threadsafe.

Failures (vLLM's names):
- a request the engine failed in a step (LLMEngine.step's isolation): RequestFailedError
  raised in that request's generate(); the loop goes on.
- an exception out of LLMEngine.step() or the loop itself (a bug; the engine's state may be
  inconsistent): the loop stops, every in-flight request gets EngineDeadError, `errored` is
  True, `dead_error` holds the error, and check_health() and generate() raise it.
Adapter reads (disk / Hub) run in the request's worker thread, before it takes the lock, so
steps and the caller's event loop go on; the insert into the CPU cache is in the same lock
hold as the request's add. One thread hop per request, as without an adapter: under load each
hop between the event loop and a worker costs up to a GIL switch interval (5 ms) while the
step thread runs. Concurrent requests for one adapter share one read (`_reads`).
`read_loras_off_lock = False` is vLLM's way instead (the peer arm of benchmarks/routing.py):
an adapter missing from the CPU cache is read under the lock, as vLLM's worker reads it inside
the step (vllm/lora/worker_manager.py), so every running request waits for the read.
"""

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InjectedFault, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import AdapterTier
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Route = tuple[asyncio.AbstractEventLoop, asyncio.Queue]
ReadKey = tuple[str, str | None]  # (adapter name, source) of a read not yet inserted
Read = tuple[LoRARequest, LoRAAdapter]  # (the request read, the adapter)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, Route] = {}  # req_id -> where its outputs go
        self._stopping = False
        self._listeners: list[Callable[[list[str], list[str]], None]] = []
        self._residency: tuple[list[str], list[str]] = ([], [])
        # engine.stats() as of the last step or adapter change (latest_stats)
        self._latest_stats: dict = self.engine.stats()
        self._dead_error: EngineDeadError | None = None
        # where adapter reads look before disk/Hub (LLMServer sets the object-store tier)
        self.adapter_tier: AdapterTier | None = None
        # False: read a missing adapter under the lock, blocking steps (vLLM's in-step read);
        # True: off the lock, unless the read is quick (_quick_read)
        self.read_loras_off_lock = True
        self._in_lock_reads_slow = False  # a quick read under the lock took too long once
        # reads in flight or not yet inserted, shared by the requests that need them
        self._reads: dict[ReadKey, concurrent.futures.Future] = {}
        self._reads_lock = threading.Lock()
        self._thread_stop = False
        self._thread = threading.Thread(target=self._loop, name="raylora-engine", daemon=True)
        self._thread.start()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- health -----------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True once the loop died (or its thread is gone without a shutdown)."""
        return self._dead_error is not None or (
            not self._thread.is_alive() and not self._thread_stop
        )

    @property
    def dead_error(self) -> EngineDeadError | None:
        if self._dead_error is None and self.errored:
            return EngineDeadError("the engine loop thread is not running")
        return self._dead_error

    def check_health(self) -> None:
        """Raise EngineDeadError if the loop died. Cheap: takes no lock."""
        error = self.dead_error
        if error is not None:
            raise error

    # -- requests ---------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | dict,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields cumulative RequestOutputs; closing the generator aborts the request. Raises
        RequestFailedError if the engine failed the request, EngineDeadError if it died."""
        self.check_health()
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        structured = getattr(sampling_params, "structured_outputs", None)
        if structured is not None:  # compile in a worker thread, not in the step's lock
            await asyncio.to_thread(self.engine.structured.compile, structured)

        def add() -> None:
            read, owned = None, None
            off_lock = lora_request is not None and self.read_loras_off_lock
            quick = off_lock and self._quick_read(lora_request)
            if off_lock and not quick:
                read, owned = self._read_shared(lora_request)  # no lock: steps go on
            try:
                with self._lock:
                    self.check_health()  # after a death under this lock, no stream fails again
                    if read is not None:
                        self.engine.insert_lora(*read)
                    # a quick read add_request is about to make (not cached meanwhile): timed
                    timed = quick and self.engine.lora_to_read(lora_request) is not None
                    t0 = time.perf_counter()
                    self.engine.add_request(request_id, prompt, sampling_params, lora_request)
                    if timed and time.perf_counter() - t0 > sys.getswitchinterval():
                        self._in_lock_reads_slow = True  # it held every step up: a slow disk
                    self._streams[request_id] = (loop, queue)
            finally:
                self._read_done(owned)

        await asyncio.to_thread(add)  # reads, then waits for the lock (a step), off the loop
        self._wakeup.set()
        done = False  # finished, failed or dead: nothing left to abort
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        def do() -> None:
            with self._lock:
                if self._dead_error is None:  # a dead engine's state may be inconsistent
                    self.engine.abort_request(request_id)
                self._streams.pop(request_id, None)

        await asyncio.to_thread(do)

    # -- adapters and introspection ----------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> dict:
        """Load an adapter into the CPU cache: read in a worker thread without the engine lock
        (steps go on), then inserted under it. Raises engine.lora.errors.LoRAError."""

        def insert() -> dict:
            read, owned = self._read_shared(lora_request)  # no lock: steps go on
            try:
                with self._lock:
                    if read is None:  # cached (or, if evicted since the peek, read under the lock)
                        info = self.engine.add_lora(lora_request)
                    else:
                        info = self.engine.insert_lora(*read)
            finally:
                self._read_done(owned)
            self._publish_state()
            return info

        return await asyncio.to_thread(insert)

    def _quick_read(self, lora: LoRARequest) -> bool:
        """With read_loras_off_lock: read `lora` (if the CPU cache lacks it) under the lock as
        the request is added, since the read is quick (LLMEngine.quick_read)? Beside a running
        step such a read only waits for the GIL (a first touch took 21-26 ms p50 against the
        in-step read's 20-24 on the real routing app, docs/benchmarks.md). Never again once
        such a read held the lock longer than a GIL switch interval."""
        return not self._in_lock_reads_slow and self.engine.quick_read(lora, self.adapter_tier)

    def reads_shared(self) -> bool:
        """Would this replica fetch an adapter it lacks from its shared tier rather than read
        it from disk (LLMEngine.reads_shared)? What the replica reports to the router."""
        return self.engine.reads_shared(self.adapter_tier)

    def _read_shared(
        self, lora: LoRARequest
    ) -> tuple[Read | None, tuple[ReadKey, concurrent.futures.Future] | None]:
        """In a worker thread, without the engine lock: the read of an adapter the CPU cache
        lacks (None if cached), and, if this thread made it, its entry, which the caller ends
        with _read_done once it has inserted it. A read in flight for the same adapter and
        source is joined, not repeated; a failed one fails its joiners too and is forgotten,
        so the next request tries again. The cache peek takes no lock: a stale answer only
        costs a read later, under the lock (LoRAManager.lora_to_read)."""
        to_read = self.engine.lora_to_read(lora)
        if to_read is None:
            return None, None
        key = (to_read.lora_name, to_read.lora_path)
        with self._reads_lock:
            read = self._reads.get(key)
            mine = read is None
            if read is None:
                read = self._reads[key] = concurrent.futures.Future()
        if not mine:
            return (to_read, read.result()), None
        try:
            adapter = self.engine.read_lora(to_read, self.adapter_tier)
        except BaseException as e:
            read.set_exception(e)
            self._read_done((key, read))
            raise
        read.set_result(adapter)
        return (to_read, adapter), (key, read)

    def _read_done(self, owned: tuple[ReadKey, concurrent.futures.Future] | None) -> None:
        """The read is inserted (or failed): later requests find it in the CPU cache."""
        if owned is not None:
            key, read = owned
            with self._reads_lock:
                if self._reads.get(key) is read:
                    del self._reads[key]

    def remove_lora(self, lora_name: str) -> bool:
        with self._lock:
            removed = self.engine.remove_lora(lora_name)
        self._publish_state()
        return removed

    def list_loras(self) -> list[str]:
        with self._lock:
            return self.engine.list_loras()

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.engine.input_processor.apply_chat_template(messages)

    def stats(self) -> dict:
        """engine.stats() now: waits for the engine lock, so for as long as a step runs."""
        with self._lock:
            return self.engine.stats()

    def latest_stats(self) -> dict:
        """engine.stats() as of the last step or adapter change, without the lock: for
        callers on an event loop (routing stats, residency reports), which would otherwise
        stall every request they serve while a step ends and the GIL comes back (up to the
        5 ms switch interval). Read-only: the dict is shared."""
        return self._latest_stats

    def add_residency_listener(self, callback: Callable[[list[str], list[str]], None]) -> None:
        """callback(adapters_in_slots, adapters_in_cpu), called from the engine thread on change."""
        self._listeners.append(callback)

    def inject_fault(self, kind: str) -> None:
        """Test-only (engine/faults.py). "step": the next step's forward raises, so its
        requests fail (RequestFailedError) and the engine goes on. "loop": the loop raises
        outside the step's handling, as a bug would, so the engine dies (EngineDeadError)."""
        self.engine.faults.arm(kind)
        self._wakeup.set()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish (up to timeout_s), stop the loop."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        self._thread_stop = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 5.0)

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._thread_stop:
                if self.engine.faults.take("loop"):
                    raise InjectedFault("injected engine-loop fault (test-only, engine/faults.py)")
                self._wakeup.clear()  # before the check: a request added after it wakes us
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                if not busy:
                    self._wakeup.wait(timeout=0.5)
                    continue
                self._step()
                self._publish_state()
        except BaseException as e:  # a bug outside one request: fail everyone, loudly
            self._die(e)

    def _step(self) -> None:
        with self._lock:
            outputs = self.engine.step()
            routes = [(o, self._streams.get(o.request_id)) for o in outputs]
            for o in outputs:
                if o.finished:
                    self._streams.pop(o.request_id, None)
        gone = []
        for o, route in routes:
            item = o if o.error is None else RequestFailedError(o.error)
            if route is not None and not _deliver(route, item):
                gone.append(o.request_id)
        if gone:  # their callers' event loops closed: nobody reads these any more
            with self._lock:
                for req_id in gone:
                    self.engine.abort_request(req_id)
                    self._streams.pop(req_id, None)

    def _die(self, e: BaseException) -> None:
        logger.error("the engine loop died; failing every request", exc_info=e)
        message = f"the engine loop died: {type(e).__name__}: {e}"
        dead = EngineDeadError(message)
        dead.__cause__ = e
        self._dead_error = dead
        with self._lock:
            streams, self._streams = self._streams, {}
        for route in streams.values():
            error = EngineDeadError(message)  # one instance per waiter: each gets a traceback
            error.__cause__ = e
            _deliver(route, error)

    def _publish_state(self) -> None:
        """After a step or an adapter change: refresh latest_stats (2-3 us) and tell the
        residency listeners if the slots or the CPU cache changed."""
        with self._lock:
            stats = self.engine.stats()
        self._latest_stats = stats
        now = (stats["adapters_in_slots"], stats["adapters_in_cpu"])
        if self._listeners and now != self._residency:
            self._residency = now
            for cb in self._listeners:
                cb(*now)


def _deliver(route: Route, item: RequestOutput | BaseException) -> bool:
    """Hand an item to a stream's event loop; False if that loop is closed."""
    loop, queue = route
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True
