"""How many uploads each worker has in flight on one route, bounded before any body is read.

The refusal rate limit (:mod:`.conduct`) counts refusals once they happen, so a worker that opened 200 pushes at once
had every one of them admitted, each buffering up to ``max_body_bytes`` (about 700 MB on the paper preset), before
the first was refused. :class:`InFlight` answers 503 ``rate_limited`` past ``limit`` requests of one worker on one
route, which a worker's client retries with backoff as it retries any 5xx (a 429 on a first sending would end its
round). The limit leaves room for one resend: a worker whose answer was lost sends again while the coordinator may
still be reading or checking the first sending; a connection whose path died gives its slot back within
``UPLOAD_STALL_S``, when its body stops coming. Counts live on the event loop, changed only between awaits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason

log = logging.getLogger(__name__)

UPLOADS_PER_WORKER = 2  # a worker's requests read at once on one upload route (its push, and a resend after a lost answer)
UPLOAD_STALL_S = 60.0  # seconds an upload's body may pause before it is cut (408)


class InFlight:
    """Per (worker, route): requests in flight, at most ``limit``."""

    def __init__(self, limit: int = UPLOADS_PER_WORKER) -> None:
        if limit < 1:
            raise ValueError(f"an upload limit must be >= 1, got {limit}")
        self.limit = limit
        self._n: dict[tuple[str, str], int] = {}  # (worker, route) -> requests in flight
        self.refused = 0  # requests answered 503 here since start-up

    @contextmanager
    def one(self, name: str, route: str) -> Iterator[None]:
        """Hold one of ``name``'s slots on ``route`` for the block's duration; 503 when it has none left."""
        key = (name, route)
        n = self._n.get(key, 0)
        if n >= self.limit:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # logged at the 1st, 2nd, 4th, 8th, ... refusal: a flood
                log.warning("worker %s has %d %s uploads in flight; refused another (%d refused since start-up)",
                            name, n, route, self.refused)  # logs a few lines
            raise ProtocolError(503, f"worker {name!r} already has {n} {route} uploads in flight; send it again once "
                                "they are answered", Reason.RATE_LIMITED)
        self._n[key] = n + 1
        try:
            yield
        finally:
            left = self._n[key] - 1
            if left:
                self._n[key] = left
            else:
                del self._n[key]
