"""The shared poll documents (coordinator/polls.py): polls never queue behind a making, and a making that raises is
not tried again by every poll."""

from __future__ import annotations

import threading
import time

import pytest

from blocktrain.coordinator.polls import Generation, Snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_poll_during_a_making_gets_the_last_document_at_once() -> None:
    """While one poll makes the document (it waits for the coordinator's lock, here for ``release``), another poll
    gets the document it replaces within a second instead of holding a thread until the making ends."""
    clock, gen = Clock(), Generation()
    release, started = threading.Event(), threading.Event()
    calls: list[int] = []

    def make() -> int:
        calls.append(len(calls))
        if len(calls) == 2:
            started.set()
            assert release.wait(10), "the test never released the making"
        return len(calls)

    snap = Snapshot(make, gen, max_age_s=1.0, clock=clock)
    assert snap.get() == 1
    gen.bump()  # a worker's request finished: the next poll makes it again
    maker = threading.Thread(target=lambda: results.append(snap.get()))
    results: list[int] = []
    maker.start()
    assert started.wait(5)
    t0 = time.monotonic()
    assert snap.get() == 1  # the last document, not a second making
    assert time.monotonic() - t0 < 1.0
    release.set()
    maker.join(10)
    assert results == [2] and len(calls) == 2
    assert snap.get() == 2  # the new one, shared


def test_a_failed_making_is_shared_for_a_tick() -> None:
    """A making that raises is not retried by every poll: the polls of the next tick get its error, until a
    state-changing request finishes or the tick passes."""
    clock, gen = Clock(), Generation()
    calls: list[float] = []
    fail = [True]

    def make() -> str:
        calls.append(clock.now)
        if fail[0]:
            raise RuntimeError("the store is gone")
        return "doc"

    snap = Snapshot(make, gen, max_age_s=0.5, clock=clock)
    for _ in range(5):
        with pytest.raises(RuntimeError, match="the store is gone"):
            snap.get()
    assert calls == [0.0]
    clock.now = 0.6  # a tick later: tried again
    with pytest.raises(RuntimeError):
        snap.get()
    assert calls == [0.0, 0.6]
    fail[0] = False
    gen.bump()  # a state-changing request: tried again at once
    assert snap.get() == "doc" and snap.get() == "doc"
    assert calls == [0.0, 0.6, 0.6]
