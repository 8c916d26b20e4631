"""Test-only fault injection: faults armed by a test (or a soak run) and taken once each.

The engine checks one of these once per step, at two fixed points:
- "step": ModelRunner.execute raises InjectedFault before the forward, so the step's
  failure isolation handles it (every request of that step fails, the engine goes on);
- "loop": AsyncLLMEngine's loop raises InjectedFault outside the step's handling, as an
  unexpected bug would, so the loop dies (EngineDeadError).
Nothing arms a fault in normal serving.
"""

import threading

FAULT_KINDS = ("step", "loop")


class FaultInjector:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # armed from the caller's thread, taken by the engine's
        self._armed: set[str] = set()

    def arm(self, kind: str) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        with self._lock:
            self._armed.add(kind)

    def take(self, kind: str) -> bool:
        """True once after arm(kind): the caller raises there."""
        if not self._armed:  # the common case: no lock
            return False
        with self._lock:
            if kind in self._armed:
                self._armed.discard(kind)
                return True
        return False
