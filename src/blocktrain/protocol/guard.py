"""Bounds on what a stranger sends before its request reaches the app: the request's head (request line and headers).

uvicorn (0.55, httptools or h11) arms no timer before a connection's first response, cancels its keep-alive timer on
every byte received, and httptools takes headers of any size: a client that opens connections and trickles a head
holds each one for ever, and ``limit_concurrency`` of them make every other request a 503. :func:`guarded_http` is
uvicorn's own HTTP protocol with two bounds, from the head's first byte (a connection's opening counts as one):

* its head must be complete within ``timeout_s`` seconds;
* it may take at most ``max_bytes`` bytes received before it is complete (a body sent with it does not count).

Otherwise the connection is closed. Bodies have their own bounds in the app (the coordinator's caps and
``upload_timeout_s``). The rest of a body answered before it was read (a 429 or a 413 at its head) is read and
dropped by uvicorn; those bytes are no head, and are neither counted nor timed here (as before this guard).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # seconds a request's head may take to arrive
MAX_HEAD_BYTES = 64 * 1024  # bytes a request's head may take


def guarded_http(timeout_s: float = HEAD_TIMEOUT_S, max_bytes: int = MAX_HEAD_BYTES) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with the module docstring's bounds."""
    if not timeout_s > 0 or max_bytes < 1024:
        raise ValueError(f"a head needs a positive timeout and at least 1024 bytes, got {timeout_s} s, {max_bytes} B")
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class GuardedHTTP(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0
            self._body_done = True  # httptools: the last request's body has all arrived (none yet)
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:  # httptools' parser callbacks (h11's protocol has none)
            self._body_done = True  # a new request: its head is arriving, no body yet
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._body_done = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._body_done = True
            super().on_message_complete()

        def _body_pending(self) -> bool:
            """The current request's body is still arriving (after an early answer, uvicorn drops it)."""
            conn = getattr(self, "conn", None)  # h11's connection state machine
            if conn is not None:
                import h11

                return bool(conn.their_state is h11.SEND_BODY)
            return not self._body_done

        def _awaiting_head(self) -> bool:
            """No request of this connection is with the app (none yet, or the last one was answered and its body
            has all arrived)."""
            return self.cycle is None or (bool(self.cycle.response_complete) and not self._body_pending())

        def _arm(self) -> None:
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _cut(self, why: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                log.warning("closed a connection from %s: %s", self.client, why)
                self.transport.close()

        def _head_late(self) -> None:
            self._head_timer = None
            if self._awaiting_head():
                self._cut(f"its request head took more than {timeout_s:g} s")

        def data_received(self, data: bytes) -> None:
            awaiting = self._awaiting_head()
            if awaiting:
                if self._head_timer is None:  # the first byte of the next request on a kept-alive connection
                    self._arm()
                self._head_bytes += len(data)
            super().data_received(data)
            if not self._awaiting_head():  # its head is complete: the request is the app's now
                self._disarm()
            elif awaiting and self._head_bytes > max_bytes:
                self._cut(f"its request head exceeds {max_bytes} bytes")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHTTP
