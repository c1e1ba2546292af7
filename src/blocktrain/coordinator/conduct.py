"""Refusals with consequences: a per-worker rate limit on refused requests, and quarantine.

* **Rate limit.** A worker whose update requests were refused ``refusal_burst`` times within ``refusal_window_s``
  gets 429 ``rate_limited`` for the rest of the window, before its body is parsed (kept in memory only).
* **Quarantine.** A refusal for what an update is or does (:data:`COUNTED`: a claim above its budget, a norm out of
  bounds, a replay, a loss-gate refusal, a malformed body, a delta dropped at its round's close because it disagreed
  with the others) counts against its worker, until it has had ``quarantine_window`` updates applied since. At
  ``quarantine_after`` of them, or as a member of
  ``GROUP_REFUSALS`` refused group means (the hivemind engine), the worker is quarantined: its token is revoked,
  its later requests are refused (403 ``quarantined``), and its updates not yet applied are dropped from their rounds.
  Refusals an honest worker meets in an ordinary run (``stale``, ``base``, ``duplicate``, ``finished``, ...) are
  not counted.

The coordinator calls these under its lock (every use of the store is).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason

log = logging.getLogger(__name__)

COUNTED = (Reason.CLAIM, Reason.NORM, Reason.LAZY, Reason.REPLAY, Reason.GATE, Reason.SCREENED, Reason.METADATA,
           Reason.SCHEMA, Reason.NON_FINITE, Reason.NOT_SAFETENSORS, Reason.GROUP, Reason.COMMITMENT,
           Reason.MOMENTS)  # refusal reasons that count toward quarantine
NOT_REFUSALS = (Reason.RATE_LIMITED, Reason.AUDITS_BUSY)  # answers that are neither stored nor counted against a worker
GROUP_REFUSALS = 2  # refused group means a worker may be a member of before it is quarantined (hivemind engine)


class Conduct:
    """The rate limit and quarantine of one coordinator."""

    def __init__(self, settings: CoordinatorSettings, store: Store,
                 on_quarantine: Callable[[str], None] = lambda name: None) -> None:
        self.settings = settings
        self.store = store
        self.on_quarantine = on_quarantine  # what else a quarantine ends (its audits that await an upload), locked
        self._refused: dict[str, deque[float]] = {}  # worker -> time.monotonic() of its recent refusals
        self.rate_limited = 0  # requests answered 429 since start-up
        self.revoked: set[str] = set()  # workers quarantined since start-up (their tokens may still be cached)

    def quarantined(self, name: str) -> bool:
        return self.store.conduct.quarantined(name) or self.store.conduct.refused_groups(name) >= GROUP_REFUSALS

    def admit(self, name: str) -> None:
        """403 if ``name`` is quarantined, 429 if it is over its refusal rate; else nothing."""
        if self.quarantined(name):
            raise ProtocolError(403, f"worker {name!r} is quarantined: its updates were refused too often for what "
                                "they are or do; ask the run's operator", Reason.QUARANTINED)
        burst = self.settings.refusal_burst
        recent = self._recent(name)
        if burst and len(recent) >= burst:
            self.rate_limited += 1
            wait = self.settings.refusal_window_s - (time.monotonic() - recent[0])
            raise ProtocolError(429, f"worker {name!r} had {len(recent)} updates refused in the last "
                                f"{self.settings.refusal_window_s:g} s; wait {wait:.0f} s and fix what they said",
                                Reason.RATE_LIMITED)

    def _recent(self, name: str) -> deque[float]:
        recent = self._refused.setdefault(name, deque())
        now = time.monotonic()
        while recent and now - recent[0] > self.settings.refusal_window_s:
            recent.popleft()
        return recent

    def refused(self, name: str, reason: str, at: float) -> bool:
        """Count a refusal of ``name``'s update (already stored as a rejection); True if it is now quarantined."""
        if reason in (*NOT_REFUSALS, Reason.QUARANTINED):
            return False
        self._recent(name).append(time.monotonic())
        if reason not in COUNTED or not self.settings.quarantine_after or self.store.conduct.quarantined(name):
            return False
        n = self.store.conduct.counted_refusals(name, COUNTED, self.settings.quarantine_window)
        if n < self.settings.quarantine_after:
            return False
        self.quarantine(name, f"{n} refused updates (last: {reason})", at)
        return True

    def finish_group_quarantines(self, at: float) -> list[str]:
        """At start-up: quarantine in full each worker a crash left between its group refusal (stored) and its
        quarantine (its token, pending updates and group means still there); those quarantined now."""
        return [m for m in self.store.conduct.group_refused_workers()
                if self.store.conduct.refused_groups(m) >= GROUP_REFUSALS and not self.store.conduct.quarantined(m)
                and self.group_refused([m], at)]

    def group_refused(self, members: list[str], at: float) -> list[str]:
        """After a refused group mean (already stored): quarantine each member now in ``GROUP_REFUSALS`` of them (its
        token revoked, its pending updates dropped, as for any quarantine); the members quarantined, old and new."""
        caught = []
        for m in members:
            n = self.store.conduct.refused_groups(m)
            if n < GROUP_REFUSALS:
                continue
            if not self.store.conduct.quarantined(m):
                self.quarantine(m, f"a member of {n} refused group means", at)
            caught.append(m)
        return caught

    def quarantine(self, name: str, why: str, at: float) -> None:
        """Quarantine ``name`` (once: a second call, such as a failed audit decided after another refusal quarantined
        it, changes nothing; it rewrote the record without the revoked token's hash and counted it twice)."""
        if self.store.conduct.quarantined(name):
            return
        with self.store.tx():
            dropped = self.store.conduct.quarantine(name, why, at)
        self.revoked.add(name)
        self.on_quarantine(name)
        log.warning("worker %s quarantined (%s): token revoked, %d pending updates dropped", name, why, dropped)
