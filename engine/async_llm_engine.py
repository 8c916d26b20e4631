"""AsyncLLMEngine: LLMEngine stepped by a background thread, one async stream per request.

The forward pass is blocking CPU/GPU work, so it runs in its own thread; the engine itself is
not thread-safe, so every call into it holds `self._lock`. Outputs cross back into asyncio
with loop.call_soon_threadsafe.
"""

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_END = object()


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._listeners: list[Callable[[list[str], list[str]], None]] = []
        self._residency: tuple[list[str], list[str]] = ([], [])
        self._errored: BaseException | None = None
        self._thread_stop = False
        self._thread = threading.Thread(target=self._loop, name="raylora-engine", daemon=True)
        self._thread.start()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- requests ---------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | dict,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields cumulative RequestOutputs; closing the generator aborts the request."""
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        if self._errored is not None:
            raise RuntimeError("the engine loop died") from self._errored
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> None:
            with self._lock:
                self.engine.add_request(request_id, prompt, sampling_params, lora_request)
                self._streams[request_id] = (loop, queue)

        await asyncio.to_thread(add)  # adapter loading may read files: keep the loop free
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        def do() -> None:
            with self._lock:
                self.engine.abort_request(request_id)
                self._streams.pop(request_id, None)

        await asyncio.to_thread(do)

    # -- adapters and introspection ----------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> dict:
        with self._lock:
            info = self.engine.add_lora(lora_request)
        self._notify_residency()
        return info

    def remove_lora(self, lora_name: str) -> bool:
        with self._lock:
            removed = self.engine.remove_lora(lora_name)
        self._notify_residency()
        return removed

    def list_loras(self) -> list[str]:
        with self._lock:
            return self.engine.list_loras()

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.engine.input_processor.apply_chat_template(messages)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def add_residency_listener(self, callback: Callable[[list[str], list[str]], None]) -> None:
        """callback(adapters_in_slots, adapters_in_cpu), called from the engine thread on change."""
        self._listeners.append(callback)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish (up to timeout_s), stop the loop."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._thread_stop = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 5.0)

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._thread_stop:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    routes = [(o, self._streams.get(o.request_id)) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
            except BaseException as e:  # a bug in a step must not hang every caller
                self._errored = e
                self._fail_all(e)
                return
            for o, route in routes:
                if route is not None:
                    loop, queue = route
                    loop.call_soon_threadsafe(queue.put_nowait, o)
            self._notify_residency()

    def _fail_all(self, e: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for loop, queue in streams.values():
            loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine step failed: {e!r}"))

    def _notify_residency(self) -> None:
        if not self._listeners:
            return
        with self._lock:
            now = self.engine.residency()
        if now != self._residency:
            self._residency = now
            for cb in self._listeners:
                cb(*now)
