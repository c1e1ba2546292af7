"""The documents anyone may poll (``/v1/status``, ``/metrics``), shared by the polls: a stranger polling them takes
the coordinator's lock, and the byte flush it does, at most once a tick (the HTTP layer, :mod:`.app`, serves them)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Generation:
    """How many requests that may have changed the coordinator's state have finished: bumped on the event loop
    only (one writer), read by the threads that make snapshots."""

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class Snapshot(Generic[T]):
    """A document made under the coordinator's lock (the status, the metrics) and shared by the requests that read
    it: made again once it is ``max_age_s`` old, or once a request that may change it has finished since its making
    began. Readers wait on this snapshot's own lock, one making at a time, never on the event loop."""

    def __init__(self, make: Callable[[], T], generation: Generation, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.make = make
        self.generation = generation
        self.max_age_s = max_age_s  # seconds a document is served for while no state-changing request finishes
        self.clock = clock
        self._lock = threading.Lock()
        self._made: tuple[int, float, T] | None = None  # (generation when its making began, when, the document)

    def get(self) -> T:
        with self._lock:
            gen, now = self.generation.value, self.clock()
            made = self._made
            if made is None or made[0] != gen or now - made[1] >= self.max_age_s:
                made = self._made = (gen, now, self.make())
            return made[2]
