"""Bounds on a stranger's HTTP connection outside the app: its request's head (request line and headers), and how
long it may leave a large answer unread.

uvicorn (0.55, httptools or h11) arms no timer before a connection's first response, cancels its keep-alive timer on
every byte received, and httptools takes headers of any size: a client that opens connections and trickles a head
holds each one for ever, and ``limit_concurrency`` of them make every other request a 503. :func:`guarded_http` is
uvicorn's own HTTP protocol with two bounds, from the head's first byte (a connection's opening counts as one):

* its head must be complete within ``timeout_s`` seconds;
* it may take at most ``max_bytes`` bytes received before it is complete (a body sent with it does not count).

Otherwise the connection is closed. Bodies have their own bounds in the app (the coordinator's caps and
``upload_timeout_s``). The rest of a body answered before it was read (a 429 or a 413 at its head) is read and
dropped by uvicorn; those bytes are no head and are not counted, but they must all arrive within ``drain_s``.

Answers are bounded too. A whole answer is written into the transport at once, and closing a connection waits for
its unsent bytes: a client that asked for 32 MB of log-probs and never read held them, and its connection slot, for
ever. A client whose unsent bytes stay past the transport's high-water mark without shrinking for ``write_stall_s``
seconds is dropped, those bytes with it; one that reads, however slowly, is not.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # seconds a request's head may take to arrive
MAX_HEAD_BYTES = 64 * 1024  # bytes a request's head may take
DRAIN_TIMEOUT_S = 60.0  # seconds the rest of a body answered before it was read (a refused upload) may take
WRITE_STALL_S = 60.0  # seconds a client may read nothing while its answer's unsent bytes are past the high-water mark


def guarded_http(timeout_s: float = HEAD_TIMEOUT_S, max_bytes: int = MAX_HEAD_BYTES,
                 drain_s: float = DRAIN_TIMEOUT_S, write_stall_s: float = WRITE_STALL_S) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with the module docstring's bounds."""
    if not timeout_s > 0 or not drain_s > 0 or not write_stall_s > 0 or max_bytes < 1024:
        raise ValueError(f"a head needs positive timeouts and at least 1024 bytes, got {timeout_s} s, {drain_s} s, "
                         f"{write_stall_s} s, {max_bytes} B")
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class GuardedHTTP(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._timer: asyncio.TimerHandle | None = None
            self._phase: str | None = None  # what the timer bounds: "head", "drain", or None (a request with the app)
            self._head_bytes = 0
            self._body_done = True  # httptools: the last request's body has all arrived (none yet)
            self._stall: asyncio.TimerHandle | None = None  # armed while the transport's buffer is past high water
            super().connection_made(transport)
            self._start("head")

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

        def _phase_now(self) -> str | None:
            """"head": no request is with the app and the next one's head is due; "drain": the last one was answered
            before its body had all arrived; None: a request is with the app (its own bounds apply)."""
            if self.cycle is None:
                return "head"
            if not self.cycle.response_complete:
                return None
            return "drain" if self._body_pending() else "head"

        def _start(self, phase: str | None) -> None:
            """Bound ``phase`` from now (its timer restarts; a head's bytes count from 0)."""
            if self._timer is not None:
                self._timer.cancel()
            self._phase, self._timer, self._head_bytes = phase, None, 0
            if phase is not None:
                self._timer = self.loop.call_later(timeout_s if phase == "head" else drain_s, self._late, phase)

        def _cut(self, why: str) -> None:
            self._start(None)
            if not self.transport.is_closing():
                log.warning("closed a connection from %s: %s", self.client, why)
                self.transport.close()

        def _late(self, phase: str) -> None:
            self._timer = None
            if self._phase == phase and self._phase_now() == phase:
                self._cut(f"its request head took more than {timeout_s:g} s" if phase == "head" else
                          f"the rest of a body it was answered for took more than {drain_s:g} s")

        def data_received(self, data: bytes) -> None:
            phase = self._phase_now()
            if phase != self._phase:  # the first byte of a head or of a drain
                self._start(phase)
            if phase == "head":
                self._head_bytes += len(data)
            super().data_received(data)
            after = self._phase_now()
            if after != self._phase:  # a head completed, a drain ended, or a request went to the app
                self._start(after)
            elif after == "head" and self._head_bytes > max_bytes:
                self._cut(f"its request head exceeds {max_bytes} bytes")

        def pause_writing(self) -> None:  # asyncio: the transport's unsent bytes passed its high-water mark
            super().pause_writing()
            if self._stall is None:
                self._watch(self.transport.get_write_buffer_size())

        def resume_writing(self) -> None:  # the client read enough to bring them under the low-water mark
            self._unwatch()
            super().resume_writing()

        def _unwatch(self) -> None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _watch(self, unsent: int) -> None:
            """Look again in ``write_stall_s``: the client must have read some of the ``unsent`` bytes by then."""
            self._stall = self.loop.call_later(write_stall_s, self._stalled, unsent)

        def _stalled(self, before: int) -> None:
            self._stall = None
            unsent = self.transport.get_write_buffer_size()
            if unsent < before:  # it reads, slowly
                self._watch(unsent)
                return
            log.warning("dropped a connection from %s: it read nothing of its answer for %g s", self.client,
                        write_stall_s)
            self.transport.abort()  # close() would wait for the unsent bytes to drain

        def connection_lost(self, exc: Exception | None) -> None:
            self._start(None)
            self._unwatch()
            super().connection_lost(exc)

    return GuardedHTTP
