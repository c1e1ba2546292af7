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
    began. One request makes it at a time; while one does, the others are answered the document it replaces at once
    instead of queueing (each would hold a worker thread, which the workers' own requests need, for as long as the
    coordinator's lock is busy). A making that raises is not tried again by every poll: the polls of the next
    ``max_age_s`` get the same error, unless a state-changing request finishes first."""

    def __init__(self, make: Callable[[], T], generation: Generation, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.make = make
        self.generation = generation
        self.max_age_s = max_age_s  # seconds a document is served for while no state-changing request finishes
        self.clock = clock
        self._making = threading.Lock()  # held by the one request making the document
        self._made: tuple[int, float, T] | None = None  # (generation when its making began, when, the document)
        self._failed: tuple[int, float, Exception] | None = None  # the same, for a making that raised

    def _fresh(self, made: tuple[int, float, object] | None) -> bool:
        return made is not None and made[0] == self.generation.value and self.clock() - made[1] < self.max_age_s

    def get(self) -> T:
        made = self._made
        if self._fresh(made):
            assert made is not None
            return made[2]
        if not self._making.acquire(blocking=made is None):  # another request is making it: the last one will do
            assert made is not None
            return made[2]
        try:
            made = self._made  # made again while this request waited for the first one
            if self._fresh(made):
                assert made is not None
                return made[2]
            failed = self._failed
            if self._fresh(failed):
                assert failed is not None
                raise failed[2].with_traceback(None)  # shared by the polls of a tick: its traceback does not grow
            gen, now = self.generation.value, self.clock()
            try:
                document = self.make()
            except Exception as exc:
                self._failed = (gen, now, exc)
                raise
            self._made, self._failed = (gen, now, document), None
            return document
        finally:
            self._making.release()
