"""TCP connections between stages: serialised writes, and a forwarding link with custody.

:class:`Conn` wraps one socket: writes are serialised and counted.

:class:`Link` is a stage's persistent connection to the next stage (one
address, or several replicas tried in order). Every WORK/RESULT frame it
forwards gets a ``tag`` and stays in custody until the next stage ACKs that
tag, which it does only once the request has left the whole rest of the
pipeline. When the connection drops, the frames in custody are resent on a
fresh connection (to the same address, or the next replica); when no address
answers within the bounded retries, each frame is handed back to the stage as
undeliverable, which turns it into an ERROR for the request's origin. A
one-way ``delay_s`` can be injected on the forward direction (benchmarks
without netem).
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
from blocktrain.serve.wire import DEFAULT_MAX_FRAME_BYTES, Frame, FrameKind, encode, read_frame

log = logging.getLogger(__name__)

Address = tuple[str, int]


def format_address(addr: Address) -> str:
    return f"{addr[0]}:{addr[1]}"


def parse_address(text: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r} must be HOST:PORT")
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


class Conn:
    """One TCP connection with serialised, counted writes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counters: Counters, max_frame: int):
        self.reader = reader
        self.writer = writer
        self.counters = counters
        self.max_frame = max_frame
        self._lock = asyncio.Lock()
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    async def send(self, frame: Frame) -> bool:
        """Write one frame; False if the connection is gone."""
        data = encode(frame, self.max_frame)
        async with self._lock:
            if self.writer.is_closing():
                return False
            try:
                self.writer.write(data)
                await self.writer.drain()
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

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


async def open_conn(addr: Address, counters: Counters, max_frame: int, timeout_s: float) -> Conn:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(addr[0], addr[1]), timeout_s)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        import socket

        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Conn(reader, writer, counters, max_frame)


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
        self.current = 0  # index of the target in use
        self.conn: Conn | None = None
        self.unacked: OrderedDict[int, tuple[Frame, float]] = OrderedDict()  # tag -> (frame, time sent)
        self.written: set[int] = set()  # tags written on the current connection
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
        self._queue.put_nowait((time.monotonic() + self.delay_s, tag, None if custody else frame))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_loop())
        return tag

    def release(self, tag: int) -> Frame | None:
        item = self.unacked.pop(tag, None)
        self.written.discard(tag)
        return item[0] if item else None

    async def close(self) -> None:
        for task in (self._sender, self._reader):
            if task is not None:
                task.cancel()
        if self.conn is not None:
            self.conn.close()
            self.conn = None

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
            if await conn.send(frame):
                if tag:
                    self.written.add(tag)
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
                    conn = await open_conn(self.targets[idx], self.counters, self.max_frame, self.connect_timeout_s)
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
        while not self._queue.empty():
            self._queue.get_nowait()
        for f in frames:
            await self.on_undeliverable(f, reason)

    def _broken(self, conn: Conn) -> None:
        """The connection died: resend every frame it carried that was not acknowledged."""
        conn.close()
        if self.conn is not conn:
            return
        self.conn = None
        resend = [t for t in self.unacked if t in self.written]
        self.written = set()
        if resend:
            log.warning("connection to %s lost with %d frame(s) in custody; resending", self.target, len(resend))
            self.current = (self.current + 1) % len(self.targets)  # prefer a replica, come back later
        for t in resend:
            self._queue.put_nowait((time.monotonic(), t, None))
        if resend and (self._sender is None or self._sender.done()):
            self._sender = asyncio.create_task(self._send_loop())

    # --- receiving -------------------------------------------------------------
    async def _read_loop(self, conn: Conn) -> None:
        try:
            while True:
                try:
                    frame = await conn.recv()
                except FramingError:
                    raise
                except WireError as exc:  # delimited but wrong inside: skip it, keep the connection
                    log.warning("bad frame from next stage %s: %s", conn.peer, exc)
                    continue
                await self.on_frame(frame)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, FramingError):
            pass
        finally:
            self._broken(conn)

    def expire(self, max_age_s: float) -> None:
        """Drop custody of frames older than ``max_age_s`` (their requests timed out long ago)."""
        now = time.monotonic()
        for tag in [t for t, (_, sent) in self.unacked.items() if now - sent > max_age_s]:
            self.release(tag)
