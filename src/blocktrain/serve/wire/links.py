"""TCP connections between stages: serialised writes, and a forwarding link with custody.

:class:`Conn` wraps one socket: writes are serialised and counted.

:class:`Link` is a stage's persistent connection to the next stage (one
address, or several replicas tried in order). Every WORK/RESULT frame it
forwards gets a ``tag`` and stays in custody until the next stage ACKs that
tag, which it does only once the request has left the whole rest of the
pipeline. When the connection drops, or the next stage holds a frame past a
bound without answering (a hung stage keeps its socket open: :meth:`Link.stalled`),
the frames in custody are resent on a
fresh connection (to the same address, or the next replica); when no address
answers within the bounded retries, each frame is handed back to the stage as
undeliverable, which turns it into an ERROR for the request's origin. A
one-way ``delay_s`` can be injected on the forward direction (benchmarks
without netem). With a shared ``token`` every new connection opens with a
HELLO frame carrying it.

:class:`ByteBudget` is the bytes of inbound frames a stage may hold buffered at
once over all its connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from blocktrain.errors import FramingError, WireError
from blocktrain.serve.wire.frames import DEFAULT_MAX_FRAME_BYTES, ErrorCode, Frame, FrameKind, encode, hello, read_frame

log = logging.getLogger(__name__)

Address = tuple[str, int]


def format_address(addr: Address) -> str:
    return f"{addr[0]}:{addr[1]}"


def parse_address(text: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:  # past it: OverflowError
        raise ValueError(f"address {text!r} must be HOST:PORT, the port a number up to 65535")
    return host, int(port)


@dataclass
class Counters:
    """Traffic and batching counters of one stage (application bytes, frames included)."""

    frames_in: int = 0
    bytes_in: int = 0
    frames_out: int = 0
    bytes_out: int = 0
    batches: int = 0
    batched_frames: int = 0
    max_batch: int = 0
    errors_sent: int = 0
    conns_refused: int = 0  # connections closed at once because the stage already held its maximum
    conns_idle_closed: int = 0  # connections closed after the idle timeout (no frame, nothing in flight)
    conns_slow_closed: int = 0  # connections closed because a started frame did not finish within the read timeout
    auth_failures: int = 0  # connections closed because they did not open with the stage's token
    frames_refused: int = 0  # frames refused from their prefix (over a buffer cap, or no room within the read timeout)
    writes_timed_out: int = 0  # connections closed because the peer read nothing within the write timeout


class Conn:
    """One TCP connection with serialised, counted writes (each bounded by ``write_timeout_s``; None: unbounded)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counters: Counters, max_frame: int,
        write_timeout_s: float | None = None, max_unsent: int | None = None,
    ):
        self.reader = reader
        self.writer = writer
        self.counters = counters
        self.max_frame = max_frame
        self.write_timeout_s = write_timeout_s
        self.authenticated = False  # a stage's inbound connection: HELLO with the right token seen
        self.inflight = 0  # a stage's inbound connection: frames from it queued or running in the stage
        self.unsent = 0  # bytes of frames waiting to be written (answers to a peer that reads slowly)
        self.max_unsent = max_unsent  # more than this waiting: the peer is dropped (None: no cap)
        self._lock = asyncio.Lock()
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    async def send(self, frame: Frame, substitute: bool = True) -> bool:
        """Write one frame; False if the connection is gone. A frame over the cap is answered by an ERROR in its place
        (a result too large for the frame cap, an echoed parameter too long), so its receiver learns why; with
        ``substitute`` False (a link's frame in custody, failed back to its origin instead) the WireError is raised."""
        try:
            data = encode(frame, self.max_frame)
        except WireError as exc:
            if not substitute:
                raise
            log.warning("could not send a %s frame of request %s to %s: %s", frame.kind.value, frame.request_id,
                        self.peer, exc)
            if frame.kind is FrameKind.ERROR:
                return False
            return await self.send(frame.reply_error(ErrorCode.TOO_LARGE, (
                f"the {frame.kind.value} frame exceeds the frame cap ({exc}); ask for fewer rows or bytes, or raise "
                "--max-frame-mib on both sides"), keep_tag=True))
        if self.max_unsent is not None and self.unsent and self.unsent + len(data) > self.max_unsent:
            log.warning("closing %s: %d bytes of answers wait for it to read (at most %d)", self.peer,
                        self.unsent + len(data), self.max_unsent)
            self.counters.writes_timed_out += 1
            self.close(abort=True)
            return False
        self.unsent += len(data)
        try:
            return await self._write(frame, data)
        finally:
            self.unsent -= len(data)

    async def _write(self, frame: Frame, data: bytes) -> bool:
        async with self._lock:
            if self.writer.is_closing():
                return False
            try:
                self.writer.write(data)
                async with asyncio.timeout(self.write_timeout_s):
                    await self.writer.drain()
            except TimeoutError:  # the peer stopped reading: drop it rather than stall every sender behind it
                log.warning("closing %s: it read nothing for %.1fs (write timeout)", self.peer, self.write_timeout_s)
                self.counters.writes_timed_out += 1
                self.close(abort=True)
                return False
            except (ConnectionError, OSError) as exc:
                log.debug("write to %s failed: %s", self.peer, exc)
                self.close()
                return False
        self.counters.frames_out += 1
        self.counters.bytes_out += len(data)
        if frame.kind is FrameKind.ERROR:
            self.counters.errors_sent += 1
        return True

    async def recv(self) -> Frame:
        frame, n = await read_frame(self.reader, self.max_frame)
        self.counters.frames_in += 1
        self.counters.bytes_in += n
        return frame

    def close(self, abort: bool = False) -> None:
        """Close after the buffered writes are flushed, or at once (``abort``: the peer is not reading)."""
        with contextlib.suppress(Exception):
            if abort:
                self.writer.transport.abort()
            else:
                self.writer.close()


async def open_conn(
    addr: Address, counters: Counters, max_frame: int, timeout_s: float, *, token: str = "",
    write_timeout_s: float | None = None,
) -> Conn:
    """Connect to a stage; with a shared ``token``, open with the HELLO frame that carries it."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(addr[0], addr[1]), timeout_s)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        import socket

        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Conn(reader, writer, counters, max_frame, write_timeout_s)
    if token and not await conn.send(hello(token)):
        conn.close()
        raise ConnectionError(f"{format_address(addr)} closed the connection before the token could be sent")
    return conn


class ByteBudget:
    """Bytes of inbound frames a stage may hold buffered at once, over all its connections.

    A stage reserves a frame's whole length as soon as its 12-byte prefix is read (before any of the body
    is buffered) and releases it once the frame has been handled, so ``used`` never exceeds ``total``.
    ``small_slots`` x ``small_frame`` bytes are set aside for frames of at most ``small_frame`` bytes; with one
    slot per connection (a connection reads one frame at a time) such a frame never waits, so control frames
    and short requests get through even while large frames have taken all the rest.
    """

    def __init__(self, total: int, small_frame: int = 0, small_slots: int = 0) -> None:
        if small_frame * small_slots > total:
            raise ValueError(f"{small_slots} slots of {small_frame} bytes do not fit a budget of {total} bytes")
        self.total = total  # bytes
        self.small_frame = small_frame  # bytes: frames up to this size may use the set-aside slots
        self.large_total = total - small_frame * small_slots  # bytes larger frames may hold together
        self.used = 0  # bytes reserved now
        self.large_used = 0  # of which by frames larger than small_frame
        self.peak = 0  # most bytes ever reserved at once
        self._waiters: list[asyncio.Future[None]] = []

    def fits(self, n: int) -> bool:
        """Whether ``n`` bytes could ever be reserved."""
        return n <= (self.total if n <= self.small_frame else self.large_total)

    def try_reserve(self, n: int) -> bool:
        large = n > self.small_frame
        if self.used + n > self.total or (large and self.large_used + n > self.large_total):
            return False
        self.used += n
        if large:
            self.large_used += n
        self.peak = max(self.peak, self.used)
        return True

    async def reserve(self, n: int) -> None:
        """Wait until ``n`` bytes fit (bound the wait with a timeout); ValueError if they never can."""
        if not self.fits(n):
            raise ValueError(f"{n} bytes can never fit a buffer budget of {self.total} bytes")
        while not self.try_reserve(n):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)

    def release(self, n: int) -> None:
        self.used -= n
        if n > self.small_frame:
            self.large_used -= n
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)


MAX_RESENDS = 3  # times a frame is resent after the connection carrying it was lost, before it is failed


class Link:
    """Persistent, custody-keeping connection to the next stage (with optional replicas)."""

    def __init__(
        self,
        targets: list[Address],
        counters: Counters,
        on_frame: Callable[[Frame], Awaitable[None]],
        on_undeliverable: Callable[[Frame, str], Awaitable[None]],
        *,
        delay_s: float = 0.0,
        max_frame: int = DEFAULT_MAX_FRAME_BYTES,
        connect_timeout_s: float = 2.0,
        connect_attempts: int = 3,
        backoff_s: float = 0.1,
        token: str = "",
        write_timeout_s: float | None = None,
    ) -> None:
        if not targets:
            raise ValueError("a link needs at least one target address")
        self.targets = targets
        self.counters = counters
        self.on_frame = on_frame  # ACK/ERROR/RESULT frames coming back from the next stage
        self.on_undeliverable = on_undeliverable
        self.delay_s = delay_s
        self.max_frame = max_frame
        self.connect_timeout_s = connect_timeout_s
        self.connect_attempts = connect_attempts
        self.backoff_s = backoff_s
        self.token = token  # shared token sent in a HELLO frame on every new connection ("" = none)
        self.write_timeout_s = write_timeout_s
        self.closed = False
        self.current = 0  # index of the target in use
        self.conn: Conn | None = None
        self.unacked: OrderedDict[int, tuple[Frame, float]] = OrderedDict()  # tag -> (frame, time sent)
        self.written: set[int] = set()  # tags written on the current connection
        self.resends: dict[int, int] = {}  # tag -> times resent after a connection carrying it was lost
        self._failing: set[asyncio.Future[None]] = set()  # frames resent too often, being failed
        self._tags = itertools.count(1)
        self._queue: asyncio.Queue[tuple[float, int, Frame | None]] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def target(self) -> str:
        return format_address(self.targets[self.current])

    def send(self, frame: Frame, custody: bool = True) -> int:
        """Queue a frame; returns its tag (0 for frames without custody, e.g. RELEASE)."""
        tag = 0
        if custody:
            tag = next(self._tags)
            frame.params = {**frame.params, "tag": tag}
            self.unacked[tag] = (frame, time.monotonic())
        if self.closed:
            return tag
        self._queue.put_nowait((time.monotonic() + self.delay_s, tag, None if custody else frame))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_loop())
        return tag

    def release(self, tag: int) -> Frame | None:
        item = self.unacked.pop(tag, None)
        self.written.discard(tag)
        self.resends.pop(tag, None)
        return item[0] if item else None

    async def close(self) -> None:
        self.closed = True
        tasks = [t for t in (self._sender, self._reader) if t is not None and t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- sending -------------------------------------------------------------
    async def _send_loop(self) -> None:
        while True:
            due, tag, plain = await self._queue.get()
            frame = plain if tag == 0 else (self.unacked.get(tag) or (None, 0.0))[0]
            if frame is None:
                continue  # acked or failed meanwhile
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                await self._write(tag, frame)
            except WireError as exc:  # the frame itself cannot be encoded (too large): fail just this one
                if tag and self.release(tag) is not None:
                    await self.on_undeliverable(frame, str(exc))

    async def _write(self, tag: int, frame: Frame) -> None:
        for _ in range(2):  # the current connection, then one fresh connection
            conn = await self._connect()
            if conn is None:
                await self._give_up(f"no answer from {', '.join(map(format_address, self.targets))}")
                return
            if await conn.send(frame, substitute=False):  # one it cannot encode fails back (WireError: _send_loop)
                if tag and tag in self.unacked:
                    self.written.add(tag)
                    self.unacked[tag] = (frame, time.monotonic())  # held by this connection from now (stalled())
                return
            self._broken(conn)
        await self._give_up(f"writes to {self.target} keep failing")

    async def _connect(self) -> Conn | None:
        if self.conn is not None and not self.conn.closed:
            return self.conn
        delay = self.backoff_s
        for attempt in range(self.connect_attempts):
            for i in range(len(self.targets)):
                idx = (self.current + i) % len(self.targets)
                try:
                    conn = await open_conn(self.targets[idx], self.counters, self.max_frame, self.connect_timeout_s,
                                           token=self.token, write_timeout_s=self.write_timeout_s)
                except (TimeoutError, OSError) as exc:
                    log.warning("next stage %s unreachable (attempt %d): %s",
                                format_address(self.targets[idx]), attempt + 1, exc)
                    continue
                if idx != self.current:
                    log.warning("failing over to replica %s", format_address(self.targets[idx]))
                self.current = idx
                self.conn = conn
                self.written = set()
                self._reader = asyncio.create_task(self._read_loop(conn))
                return conn
            await asyncio.sleep(delay)
            delay *= 2
        return None

    async def _give_up(self, reason: str) -> None:
        frames = [f for f, _ in self.unacked.values()]
        self.unacked.clear()
        self.written.clear()
        self.resends.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        for f in frames:
            await self.on_undeliverable(f, reason)

    def _broken(self, conn: Conn, resend: bool = True) -> None:
        """The connection died: resend every frame it carried that was not acknowledged."""
        conn.close()
        if self.conn is not conn or self.closed:
            return
        self.conn = None
        if not resend:
            return
        tags = [t for t in self.unacked if t in self.written]
        self.written = set()
        if tags:
            log.warning("connection to %s lost with %d frame(s) in custody; resending", self.target, len(tags))
            self.current = (self.current + 1) % len(self.targets)  # prefer a replica, come back later
        for t in tags:
            n = self.resends[t] = self.resends.get(t, 0) + 1
            if n > MAX_RESENDS:  # the next stage hangs up on this frame (it refuses it and closes): fail it
                frame = self.release(t)
                if frame is not None:
                    task: asyncio.Future[None] = asyncio.ensure_future(self.on_undeliverable(
                        frame, f"{self.target} closed the connection {n} times while it held the frame"))
                    self._failing.add(task)
                    task.add_done_callback(self._failing.discard)
                continue
            self._queue.put_nowait((time.monotonic() + self.backoff_s * (2 ** (n - 1) - 1), t, None))
        if tags and (self._sender is None or self._sender.done()):
            self._sender = asyncio.create_task(self._send_loop())

    # --- receiving -------------------------------------------------------------
    async def _read_loop(self, conn: Conn) -> None:
        refused = ""
        try:
            while True:
                try:
                    frame = await conn.recv()
                except FramingError:
                    raise
                except WireError as exc:  # delimited but wrong inside: skip it, keep the connection
                    log.warning("bad frame from next stage %s: %s", conn.peer, exc)
                    continue
                if frame.kind is FrameKind.ERROR and frame.code is ErrorCode.UNAUTHORIZED:
                    refused = (f"{self.target} refused this stage's token ({frame.error}); "
                               "start every stage with the same BLOCKTRAIN_SERVE_TOKEN / --token-file")
                    log.error("%s", refused)
                    break
                try:
                    await self.on_frame(frame)
                except Exception:  # a bug handling one frame from the next stage: logged, the link goes on
                    log.exception("handling a %s frame from next stage %s failed", frame.kind.value, conn.peer)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, FramingError):
            pass
        finally:
            self._broken(conn, resend=not refused)
        if refused and not self.closed:  # resending would be refused again: fail the frames in custody now
            await self._give_up(refused)

    def stalled(self, stall_s: float) -> bool:
        """Whether the next stage has held a frame written to it for more than ``stall_s`` seconds without answering:
        a stage that hangs (stopped, or stuck on its device) keeps its socket open, so no connection drop tells. The
        connection is then dropped as if it had been, and its frames resent, to a replica first."""
        conn = self.conn
        if conn is None or self.closed:
            return False
        held = [sent for tag, (_, sent) in self.unacked.items() if tag in self.written]
        if not held or time.monotonic() - min(held) <= stall_s:
            return False
        log.warning("next stage %s has held %d frame(s) for more than %.0f s without an answer; dropping the connection",
                    self.target, len(held), stall_s)
        self._broken(conn)
        return True

    def expire(self, max_age_s: float) -> None:
        """Drop custody of frames older than ``max_age_s`` (their requests timed out long ago)."""
        now = time.monotonic()
        for tag in [t for t, (_, sent) in self.unacked.items() if now - sent > max_age_s]:
            self.release(tag)
