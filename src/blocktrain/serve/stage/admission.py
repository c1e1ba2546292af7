"""Admission of inbound connections to a stage, and the limits that keep hostile or broken peers out.

Hostile or broken peers cannot starve a stage: inbound connections are capped
(``max_connections``); one on which no frame starts within ``idle_timeout_s``
(and that has nothing in flight) is closed, and so is one whose started frame
is not complete within ``read_timeout_s``; a frame's whole length is reserved
from a shared :class:`~blocktrain.serve.wire.links.ByteBudget` (``buffer_bytes``,
at most ``conn_buffer_bytes`` per connection) when its prefix is read, before
its body is buffered, and released once it has been handled; 64 KiB of it per
connection is kept for small frames, so that large frames held by slow peers
cannot stop requests and control frames; with a shared ``token`` a connection
must open with a HELLO frame carrying it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from blocktrain.errors import FramingError, WireError
from blocktrain.serve.stage.core import Throttled, log
from blocktrain.serve.stage.options import StageOptions
from blocktrain.serve.wire.frames import (
    MAX_HELLO_BYTES,
    PREFIX,
    ErrorCode,
    Frame,
    FrameKind,
    decode_body,
    encode,
    parse_prefix,
    token_matches,
)
from blocktrain.serve.wire.links import ByteBudget, Conn, Counters


class _HangupError(Exception):
    """Close this inbound connection, after sending ``error`` when there is one."""

    def __init__(self, error: Frame | None = None) -> None:
        super().__init__(error.error if error is not None else "")
        self.error = error



class Admission:
    """Accepting, reading and closing inbound connections within the stage's limits.

    Each frame read goes to ``on_frame``; ``busy(conn)`` says whether work that came in on a connection is still
    in the stage (it then stays open past its idle timeout); ``serving()`` whether the stage accepts connections.
    """

    def __init__(
        self, opts: StageOptions, counters: Counters, budget: ByteBudget, name: str,
        on_frame: Callable[[Frame, Conn], Awaitable[None]], busy: Callable[[Conn], bool], serving: Callable[[], bool],
    ) -> None:
        self.opts = opts
        self.counters = counters
        self.budget = budget
        self.name = name
        self.on_frame = on_frame
        self.busy = busy
        self.serving = serving
        self.conns: set[Conn] = set()
        self.handlers: set[asyncio.Task[Any]] = set()  # one per inbound connection
        self._throttled = Throttled()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The listener's callback: serve one inbound connection until it closes."""
        if not self.serving() or len(self.conns) >= self.opts.max_connections:
            self._refuse(writer)
            return
        conn = Conn(reader, writer, self.counters, self.opts.max_frame_bytes, self.opts.write_timeout_s,
                    # answers waiting for a slow reader: past 4 frames or the stage's buffer, whichever is larger, it is
                    # dropped (a batch holds at most --max-batch-rows sequences, which bounds one batch's answers)
                    max_unsent=max(4 * self.opts.max_frame_bytes, self.opts.buffer_bytes))
        conn.authenticated = not self.opts.token
        task = asyncio.current_task()
        self.conns.add(conn)
        if task is not None:
            self.handlers.add(task)
        try:
            await self._serve_conn(conn)
        except asyncio.CancelledError:
            if self.serving():
                raise
            # stop() ends this handler: return quietly (asyncio logs a cancelled connection handler as an error)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.conns.discard(conn)
            if task is not None:
                self.handlers.discard(task)
            conn.close()

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """Hang up on a connection beyond the cap at once (one small ERROR frame, no reading)."""
        peer = writer.get_extra_info("peername")
        if self.serving():
            self.counters.conns_refused += 1
            self._throttled.warning("refused", "refusing a connection from %s: %d connections are open "
                                    "(max_connections %d)", peer, len(self.conns), self.opts.max_connections)
            message = (f"stage {self.name} already holds {self.opts.max_connections} connections; retry later, "
                       "close idle clients, or raise --max-connections")
        else:
            message = f"stage {self.name} is stopping"
        with contextlib.suppress(Exception):
            writer.write(encode(Frame(FrameKind.ERROR, code=ErrorCode.OVERLOADED, error=message)))
            self.counters.errors_sent += 1
            writer.close()

    async def _serve_conn(self, conn: Conn) -> None:
        while True:
            try:
                frame, held = await self._read_inbound(conn)
            except _HangupError as hangup:
                if hangup.error is not None:
                    await conn.send(hangup.error)
                return
            except WireError as exc:  # one bad frame, well delimited: reject it, keep the connection
                if not conn.authenticated:
                    await conn.send(self._unauthorized(conn, f"its first frame was unreadable ({exc})"))
                    return
                log.warning("rejected a frame from %s: %s", conn.peer, exc)
                # naming its request where the header said (its sender fails it now, not at its timeout)
                await conn.send(Frame(FrameKind.ERROR, exc.request_id, code=ErrorCode.MALFORMED, error=str(exc)))
                continue
            try:
                if conn.authenticated:
                    if frame.kind is not FrameKind.HELLO:
                        await self.on_frame(frame, conn)
                elif token_matches(frame, self.opts.token):
                    conn.authenticated = True
                else:
                    why = "its token does not match" if frame.kind is FrameKind.HELLO else "it did not open with HELLO"
                    await conn.send(self._unauthorized(conn, why, frame))
                    return
            finally:
                self.budget.release(held)

    def _unauthorized(self, conn: Conn, why: str, frame: Frame | None = None) -> Frame:
        self.counters.auth_failures += 1
        self._throttled.warning("auth", "closing %s: %s (this stage requires its shared token)", conn.peer, why)
        message = (f"stage {self.name} requires a shared token: open the connection with a HELLO frame carrying it "
                   "(PipelineClient(token=...), or BLOCKTRAIN_SERVE_TOKEN for 'blocktrain generate/serve')")
        err = Frame(FrameKind.ERROR, code=ErrorCode.UNAUTHORIZED, error=message)
        if frame is not None:
            err.request_id = frame.request_id
        return err

    async def _frame_start(self, conn: Conn) -> bytes:
        """The first byte of the next frame; _HangupError once the connection has been idle for idle_timeout_s (a
        connection that has not said HELLO yet: read_timeout_s, so strangers cannot hold every slot for long)."""
        idle = self.opts.idle_timeout_s if conn.authenticated else min(self.opts.idle_timeout_s, self.opts.read_timeout_s)
        while True:
            try:
                async with asyncio.timeout(idle):
                    return await conn.reader.readexactly(1)
            except TimeoutError:
                if not self.busy(conn):
                    self.counters.conns_idle_closed += 1
                    log.debug("closing %s: no frame for %.1fs", conn.peer, idle)
                    raise _HangupError() from None

    def _slow(self, conn: Conn, what: str) -> _HangupError:
        self.counters.conns_slow_closed += 1
        self._throttled.warning("slow", "closing %s: %s not complete within the read timeout of %.1fs",
                                conn.peer, what, self.opts.read_timeout_s)
        return _HangupError(Frame(FrameKind.ERROR, code=ErrorCode.TIMEOUT, error=(
            f"{what} was not complete within {self.opts.read_timeout_s:.1f}s of its first byte; closing the "
            "connection (send whole frames promptly, or raise --read-timeout on the stage)")))

    def _refused_frame(self, conn: Conn, code: ErrorCode, message: str) -> _HangupError:
        self.counters.frames_refused += 1
        self._throttled.warning("frame", "closing %s: %s", conn.peer, message)
        return _HangupError(Frame(FrameKind.ERROR, code=code, error=message))

    async def _read_inbound(self, conn: Conn) -> tuple[Frame, int]:
        """Read one frame, its whole length reserved from the stage's buffer budget before the body is read.

        Returns (frame, bytes reserved); the caller releases them once the frame is handled. Raises _HangupError when
        the connection must close (idle, too slow, framing lost, over a buffer cap, not authenticated) and
        WireError for a well-delimited bad frame.
        """
        first = await self._frame_start(conn)
        deadline = asyncio.get_running_loop().time() + self.opts.read_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                prefix = first + await conn.reader.readexactly(PREFIX.size - 1)
        except TimeoutError:
            raise self._slow(conn, "a frame prefix") from None
        try:
            h_len, p_len = parse_prefix(prefix, self.opts.max_frame_bytes)
        except FramingError as exc:  # framing lost: say why, then hang up on this peer only
            code = ErrorCode.TOO_LARGE if "exceeds" in str(exc) else ErrorCode.MALFORMED
            raise self._refused_frame(conn, code, str(exc)) from None
        n = h_len + p_len
        if not conn.authenticated and (p_len or n > MAX_HELLO_BYTES):
            raise _HangupError(self._unauthorized(conn, f"it opened with a {n}-byte frame, not a HELLO"))
        if n > self.opts.conn_buffer_bytes:
            raise self._refused_frame(conn, ErrorCode.TOO_LARGE, (
                f"frame of {n} bytes exceeds the cap of {self.opts.conn_buffer_bytes} bytes buffered per connection "
                f"at stage {self.name}; send a shorter sequence or raise --conn-buffer-mib"))
        try:
            async with asyncio.timeout_at(deadline):
                await self.budget.reserve(n)
        except TimeoutError:
            raise self._refused_frame(conn, ErrorCode.OVERLOADED, (
                f"no room to buffer a frame of {n} bytes at stage {self.name} within {self.opts.read_timeout_s:.1f}s "
                f"({self.budget.large_used} of the {self.budget.large_total} bytes for large frames in use); retry "
                "later or raise --buffer-mib")) from None
        try:
            async with asyncio.timeout_at(deadline):
                header = await conn.reader.readexactly(h_len)
                payload = await conn.reader.readexactly(p_len) if p_len else b""
            frame = decode_body(header, payload)
        except TimeoutError:
            self.budget.release(n)
            raise self._slow(conn, f"a frame of {n} bytes") from None
        except BaseException:
            self.budget.release(n)
            raise
        self.counters.frames_in += 1
        self.counters.bytes_in += PREFIX.size + n
        return frame, n

