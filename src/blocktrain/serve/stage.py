"""The stage server: holds a span, batches frames that arrive together, passes them on.

Flow of one request through a ring of three stages (the last stage's
``--next`` points back at the first)::

    client --SUBMIT--> stage 0 --WORK--> stage 1 --WORK--> stage 2 --RESULT--> stage 0 --RESULT--> client

The stage holding block/layer 0 is the *entry*: it keeps each request it was
given (``pending``) with a deadline. Deterministic requests (score, sweep, ar,
baseline prefill) are retried on a downstream failure up to ``retries`` times;
otherwise the client gets an ERROR saying which stage failed and what to do.
A stage without ``--next`` answers on the connection the frame came in on.

Custody: each forwarded frame is ACKed by the next stage only after it left the
rest of the pipeline, so a stage that dies mid-request is noticed by its
neighbour (connection drop), which resends to a replica or reports upstream.

Hostile or broken peers cannot starve a stage: inbound connections are capped
(``max_connections``); one on which no frame starts within ``idle_timeout_s``
(and that has nothing in flight) is closed, and so is one whose started frame
is not complete within ``read_timeout_s``; a frame's whole length is reserved
from a shared :class:`~blocktrain.serve.links.ByteBudget` (``buffer_bytes``,
at most ``conn_buffer_bytes`` per connection) when its prefix is read, before
its body is buffered, and released once it has been handled; 64 KiB of it per
connection is kept for small frames, so that large frames held by slow peers
cannot stop requests and control frames; with a shared ``token`` a connection
must open with a HELLO frame carrying it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from blocktrain.errors import ConfigError, FramingError, StageUnavailableError, WireError
from blocktrain.serve.compute import BlockSpan, E2ESpan
from blocktrain.serve.links import Address, ByteBudget, Conn, Counters, Link, format_address
from blocktrain.serve.stackspan import StackSpan
from blocktrain.serve.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_HELLO_BYTES,
    PREFIX,
    SMALL_FRAME_BYTES,
    ErrorCode,
    Frame,
    FrameKind,
    Mode,
    UnknownRequestError,
    decode_body,
    encode,
    parse_prefix,
    token_matches,
)

log = logging.getLogger(__name__)

Span = BlockSpan | E2ESpan | StackSpan


class StageState(enum.Enum):
    """Lifecycle of a stage server."""

    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class StageOptions:
    next_stages: tuple[Address, ...] = ()  # the next stage and its replicas, tried in order
    link_delay_s: float = 0.0  # injected one-way delay on the forward link (benchmarks without netem)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # cap on header + payload of any frame
    max_batch: int = 16  # frames run together at most
    batch_window_s: float = 0.0  # wait this long after the first frame for others to join its batch
    request_timeout_s: float = 60.0  # entry: deadline of a request (per attempt)
    retries: int = 1  # entry: re-runs of a deterministic request after a downstream failure
    connect_timeout_s: float = 2.0  # per connection attempt to the next stage
    connect_attempts: int = 3  # rounds over all replicas before giving up
    backoff_s: float = 0.1  # first pause between rounds (doubles)
    idle_timeout_s: float = 300.0  # seconds: close a connection on which no frame starts (and none of whose work is in flight)
    read_timeout_s: float = 30.0  # seconds: a frame whose first byte arrived must be complete (room to buffer it included)
    write_timeout_s: float = 30.0  # seconds: close a connection whose peer reads nothing of a pending write for this long
    max_connections: int = 256  # inbound connections held at once; more get an ERROR (overloaded) and are closed
    conn_buffer_bytes: int = DEFAULT_MAX_FRAME_BYTES  # bytes: the largest frame one connection may have buffered
    # bytes: frames buffered at once over all inbound connections, SMALL_FRAME_BYTES per connection set aside
    buffer_bytes: int = 4 * DEFAULT_MAX_FRAME_BYTES + 256 * SMALL_FRAME_BYTES
    token: str = field(default="", repr=False)  # shared secret a connection must send first in a HELLO ("" = none)

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "read_timeout_s", "write_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}; set {flag}")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {self.max_connections}; set --max-connections")
        if self.conn_buffer_bytes < 12 + MAX_HEADER_BYTES:
            raise ConfigError(
                f"conn_buffer_bytes ({self.conn_buffer_bytes}) must hold at least a frame with a full header "
                f"({12 + MAX_HEADER_BYTES} bytes); raise --conn-buffer-mib"
            )
        small = self.max_connections * SMALL_FRAME_BYTES
        if self.buffer_bytes < self.conn_buffer_bytes + small:
            raise ConfigError(
                f"buffer_bytes ({self.buffer_bytes}) must hold conn_buffer_bytes ({self.conn_buffer_bytes}) plus "
                f"{SMALL_FRAME_BYTES // 1024} KiB set aside for small frames on each of max_connections "
                f"({self.max_connections}), {self.conn_buffer_bytes + small} bytes in all; raise --buffer-mib, or "
                "lower --conn-buffer-mib or --max-connections"
            )
        if self.token and not (16 <= len(self.token) <= 512 and all(33 <= ord(c) <= 126 for c in self.token)):
            raise ConfigError(
                "the serving token must be 16-512 printable ASCII characters without spaces; make one with "
                "`python -c 'import secrets; print(secrets.token_hex(16))'`"
            )


class _HangupError(Exception):
    """Close this inbound connection, after sending ``error`` when there is one."""

    def __init__(self, error: Frame | None = None) -> None:
        super().__init__(error.error if error is not None else "")
        self.error = error


class _Throttled:
    """Warnings logged at most once per ``every_s`` seconds per key, saying how many were held back."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = defaultdict(int)

    def warning(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) < self.every_s:
            self._held[key] += 1
            return
        self._last[key] = now
        held = self._held.pop(key, 0)
        log.warning(message + (f" ({held} more like this since the last report)" if held else ""), *args)


@dataclass
class WorkItem:
    frame: Frame
    origin: Conn | None  # connection it came in on (None: submitted here or re-entered locally)
    in_tag: int | None  # custody tag on that connection


@dataclass
class Pending:
    conn: Conn  # the client's connection
    submit: Frame  # the original request, kept for retries
    timer: asyncio.TimerHandle | None = None
    attempts: int = 0
    t0: float = field(default_factory=time.monotonic)


class StageServer:
    """An asyncio TCP server for one span of blocks (or E2E layers)."""

    def __init__(self, span: Span, host: str, port: int, options: StageOptions | None = None) -> None:
        self.span = span
        self.host = host
        self.port = port
        self.opts = options or StageOptions()
        self.state = StageState.STARTING
        self.counters = Counters()
        self.name = f"{span.family}[{span.lo}-{span.hi}]"
        self.pending: dict[str, Pending] = {}
        self.upstream: dict[int, tuple[Conn | None, int | None, float]] = {}  # link tag -> origin of the frame
        self.conns: set[Conn] = set()
        self.link: Link | None = None
        # bytes of inbound frames buffered now (and at most), with room set aside for a small frame per connection
        self.budget = ByteBudget(self.opts.buffer_bytes, SMALL_FRAME_BYTES, self.opts.max_connections)
        self._server: asyncio.base_events.Server | None = None
        self._queue: asyncio.Queue[WorkItem] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[Any]] = set()  # one per inbound connection
        self._aux: set[asyncio.Task[Any]] = set()  # request timeouts in progress
        self._throttled = _Throttled()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")

    # --- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.opts.next_stages:
            self.link = Link(
                list(self.opts.next_stages), self.counters, self._from_downstream, self._undeliverable,
                delay_s=self.opts.link_delay_s, max_frame=self.opts.max_frame_bytes,
                connect_timeout_s=self.opts.connect_timeout_s, connect_attempts=self.opts.connect_attempts,
                backoff_s=self.opts.backoff_s, token=self.opts.token, write_timeout_s=self.opts.write_timeout_s,
            )
        self._tasks = [asyncio.create_task(self._batcher()), asyncio.create_task(self._janitor())]
        self.state = StageState.SERVING
        log.info("stage %s serving on %s:%d, next %s", self.name, self.host, self.port,
                 ", ".join(map(format_address, self.opts.next_stages)) or "(answers its sender)")

    async def stop(self) -> None:
        """Close everything at once (also what a crash looks like to the neighbours).

        Every task of the stage (connection handlers included) has ended when this returns, so stopping
        with peers connected logs no traceback.
        """
        if self.state is StageState.STOPPED:
            return
        self.state = StageState.STOPPING
        if self._server is not None:
            self._server.close()
        conns = list(self.conns)
        for conn in conns:
            conn.close()
        if self.link is not None:
            await self.link.close()
        for p in self.pending.values():
            if p.timer is not None:
                p.timer.cancel()
        me = asyncio.current_task()
        tasks = [t for t in (*self._tasks, *self._handlers, *self._aux) if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in conns:  # writes a peer never read: drop them rather than hold the socket open
            conn.close(abort=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.state = StageState.STOPPED
        log.info("stage %s stopped", self.name)

    def info(self) -> dict[str, Any]:
        return {"state": self.state.value, "name": self.name, **self.span.describe(),
                "pending": len(self.pending), "stats": asdict(self.counters), "connections": len(self.conns),
                "buffered_bytes": self.budget.used, "buffered_peak": self.budget.peak,
                "buffer_bytes": self.budget.total}

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    # --- inbound connections ------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.state is not StageState.SERVING or len(self.conns) >= self.opts.max_connections:
            self._refuse(writer)
            return
        conn = Conn(reader, writer, self.counters, self.opts.max_frame_bytes, self.opts.write_timeout_s)
        conn.authenticated = not self.opts.token
        task = asyncio.current_task()
        self.conns.add(conn)
        if task is not None:
            self._handlers.add(task)
        try:
            await self._serve_conn(conn)
        except asyncio.CancelledError:
            if self.state is StageState.SERVING:
                raise
            # stop() ends this handler: return quietly (asyncio logs a cancelled connection handler as an error)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.conns.discard(conn)
            if task is not None:
                self._handlers.discard(task)
            conn.close()

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """Hang up on a connection beyond the cap at once (one small ERROR frame, no reading)."""
        peer = writer.get_extra_info("peername")
        if self.state is StageState.SERVING:
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
                await conn.send(Frame(FrameKind.ERROR, code=ErrorCode.MALFORMED, error=str(exc)))
                continue
            try:
                if conn.authenticated:
                    if frame.kind is not FrameKind.HELLO:
                        await self._on_frame(frame, conn)
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

    def _busy(self, conn: Conn) -> bool:
        """Whether work that came in on ``conn`` is still in this stage (queued, running, or in custody downstream)."""
        return (conn.inflight > 0 or any(p.conn is conn for p in self.pending.values())
                or any(origin is conn for origin, _, _ in self.upstream.values()))

    async def _frame_start(self, conn: Conn) -> bytes:
        """The first byte of the next frame; _HangupError once the connection has been idle for idle_timeout_s."""
        while True:
            try:
                async with asyncio.timeout(self.opts.idle_timeout_s):
                    return await conn.reader.readexactly(1)
            except TimeoutError:
                if not self._busy(conn):
                    self.counters.conns_idle_closed += 1
                    log.debug("closing %s: no frame for %.1fs", conn.peer, self.opts.idle_timeout_s)
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

    async def _reject(self, conn: Conn, frame: Frame, code: ErrorCode, message: str) -> None:
        err = frame.reply_error(code, message)
        if "tag" in frame.params:
            err.params = {"tag": frame.params["tag"]}
        await conn.send(err)

    async def _on_frame(self, frame: Frame, conn: Conn) -> None:
        kind = frame.kind
        if kind is FrameKind.PING:
            await conn.send(Frame(FrameKind.PONG, request_id=frame.request_id, params=self.info()))
        elif kind is FrameKind.SUBMIT:
            await self._on_submit(frame, conn)
        elif kind is FrameKind.WORK:
            if not self.span.holds(frame.sigma_index):
                await self._reject(conn, frame, ErrorCode.MISROUTED,
                                   f"stage {self.name} does not run index {frame.sigma_index}; check the --next chain")
            elif frame.sigma_index == 0 and frame.request_id not in self.pending:
                await self._reject(conn, frame, ErrorCode.UNKNOWN_REQUEST,
                                   f"request {frame.request_id!r} is not in flight at {self.name}")
            elif await self._validate(frame, conn):
                conn.inflight += 1  # until the batch it joins has been emitted (keeps the idle timeout off)
                self._queue.put_nowait(WorkItem(frame, conn, frame.params.get("tag")))
        elif kind is FrameKind.RESULT:
            if frame.request_id in self.pending:
                tag = frame.params.get("tag")
                await self._deliver(frame)
                await conn.send(Frame(FrameKind.ACK, frame.request_id, params={"tag": tag}))
            else:
                await self._reject(conn, frame, ErrorCode.UNKNOWN_REQUEST,
                                   f"no request {frame.request_id!r} is pending at {self.name}")
        elif kind is FrameKind.RELEASE:
            found = self.span.release(frame.request_id)
            if self.link is not None and not self.span.is_last:
                self.link.send(frame, custody=False)
            if not found and self.span.holds(0):
                await self._reject(conn, frame, ErrorCode.UNKNOWN_REQUEST,
                                   f"request {frame.request_id!r} holds no KV cache at {self.name}")
        else:
            log.debug("ignoring a %s frame from %s", kind.value, conn.peer)

    async def _validate(self, frame: Frame, conn: Conn) -> bool:
        try:
            self.span.validate(frame)
        except UnknownRequestError as exc:
            await self._reject(conn, frame, ErrorCode.UNKNOWN_REQUEST, str(exc))
            return False
        except WireError as exc:
            await self._reject(conn, frame, ErrorCode.BAD_REQUEST, str(exc))
            return False
        return True

    async def _on_submit(self, frame: Frame, conn: Conn) -> None:
        if not self.span.holds(0):
            await self._reject(conn, frame, ErrorCode.MISROUTED,
                               f"stage {self.name} is not the entry; send requests to the stage holding index 0")
            return
        if frame.request_id in self.pending:
            await self._reject(conn, frame, ErrorCode.DUPLICATE_REQUEST,
                               f"request {frame.request_id!r} is already in flight; use a fresh id")
            return
        if not frame.request_id or not await self._validate(frame, conn):
            if not frame.request_id:
                await self._reject(conn, frame, ErrorCode.BAD_REQUEST, "SUBMIT frames need a request id")
            return
        p = Pending(conn, frame)
        self.pending[frame.request_id] = p
        self._arm(frame.request_id, p)
        self._queue.put_nowait(WorkItem(self._fresh(frame), None, None))

    @staticmethod
    def _fresh(frame: Frame) -> Frame:
        return Frame(FrameKind.SUBMIT, frame.request_id, frame.mode, 0, dict(frame.params), dict(frame.tensors))

    def _arm(self, rid: str, p: Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
        loop = asyncio.get_running_loop()
        p.timer = loop.call_later(self.opts.request_timeout_s, lambda: self._spawn(self._timeout(rid, p)))

    async def _timeout(self, rid: str, p: Pending) -> None:
        if self.pending.get(rid) is not p:
            return
        await self._fail_or_retry(rid, p.submit.reply_error(
            ErrorCode.TIMEOUT,
            f"no result for request {rid} within {self.opts.request_timeout_s:.1f}s after {self.name}; a later stage "
            "may have died or be overloaded: check each 'blocktrain serve' process and restart the dead one",
        ))

    async def _fail_or_retry(self, rid: str, err: Frame) -> None:
        p = self.pending.get(rid)
        if p is None:
            return
        stateless = p.submit.mode is not Mode.BASELINE or int(p.submit.params.get("pos", 0)) == 0
        transient = err.code in (ErrorCode.STAGE_UNAVAILABLE, ErrorCode.TIMEOUT)
        if stateless and transient and p.attempts < self.opts.retries:
            p.attempts += 1
            log.warning("request %s: %s; retry %d of %d", rid, err.error, p.attempts, self.opts.retries)
            self._arm(rid, p)
            self._queue.put_nowait(WorkItem(self._fresh(p.submit), None, None))
            return
        del self.pending[rid]
        if p.timer is not None:
            p.timer.cancel()
        err.params = {}
        await p.conn.send(err)

    async def _deliver(self, result: Frame) -> None:
        p = self.pending.pop(result.request_id)
        if p.timer is not None:
            p.timer.cancel()
        result.params = {k: v for k, v in result.params.items() if k != "tag"}
        result.params["stage_seconds"] = time.monotonic() - p.t0
        if not await p.conn.send(result):
            log.info("client of request %s went away before its result", result.request_id)

    # --- compute ----------------------------------------------------------------
    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self._queue.get()]
            if self.opts.batch_window_s > 0:
                await asyncio.sleep(self.opts.batch_window_s)
            while len(items) < self.opts.max_batch and not self._queue.empty():
                items.append(self._queue.get_nowait())
            groups: dict[tuple[Any, ...], list[WorkItem]] = defaultdict(list)
            for it in items:
                groups[self.span.batch_key(it.frame)].append(it)
            for group in groups.values():
                frames = [it.frame for it in group]
                try:
                    outs = await loop.run_in_executor(self._executor, self.span.run, frames)
                except Exception as exc:  # a bug or bad input in compute: fail these requests, keep serving
                    log.exception("stage %s failed on %d frame(s)", self.name, len(frames))
                    outs = [f.reply_error(ErrorCode.INTERNAL, f"stage {self.name} failed: {exc!r}") for f in frames]
                self.counters.batches += 1
                self.counters.batched_frames += len(frames)
                self.counters.max_batch = max(self.counters.max_batch, len(frames))
                for it, out in zip(group, outs, strict=True):
                    try:
                        await self._emit(it, out)
                    finally:
                        if it.origin is not None:
                            it.origin.inflight -= 1

    async def _ack(self, origin: Conn | None, tag: int | None, rid: str) -> None:
        if origin is not None and tag is not None:
            await origin.send(Frame(FrameKind.ACK, rid, params={"tag": tag}))

    async def _emit(self, item: WorkItem, out: Frame) -> None:
        rid = out.request_id
        if out.kind is FrameKind.ERROR:
            await self._route_error(rid, item.origin, item.in_tag, out)
            return
        local = out.kind is FrameKind.RESULT and rid in self.pending and self.span.holds(0) and self.span.is_last
        local |= out.kind is FrameKind.WORK and self.span.holds(out.sigma_index)
        if local:
            if out.kind is FrameKind.RESULT:
                await self._deliver(out)
            elif rid in self.pending:
                self._queue.put_nowait(WorkItem(out, None, None))
            await self._ack(item.origin, item.in_tag, rid)
        elif self.link is not None:
            tag = self.link.send(out)
            self.upstream[tag] = (item.origin, item.in_tag, time.monotonic())
        elif out.kind is FrameKind.RESULT and item.origin is not None:
            out.params = {**out.params, "tag": item.in_tag}
            await item.origin.send(out)  # no --next: answer the sender (also releases its custody)
        else:
            await self._route_error(rid, item.origin, item.in_tag, out.reply_error(
                ErrorCode.STAGE_UNAVAILABLE, f"stage {self.name} has no --next stage for index {out.sigma_index}"))

    async def _route_error(self, rid: str, origin: Conn | None, in_tag: int | None, err: Frame) -> None:
        if rid in self.pending:
            await self._fail_or_retry(rid, err)
            await self._ack(origin, in_tag, rid)
        elif origin is not None:
            fwd = Frame(FrameKind.ERROR, rid, err.mode, code=err.code, error=err.error, params={"tag": in_tag})
            await origin.send(fwd)
        else:
            log.warning("request %s failed and nobody waits for it: %s", rid, err.error)

    # --- frames coming back from the next stage -------------------------------------
    async def _from_downstream(self, frame: Frame) -> None:
        tag = frame.params.get("tag")
        if frame.kind in (FrameKind.ACK, FrameKind.ERROR, FrameKind.RESULT) and isinstance(tag, int):
            assert self.link is not None
            sent = self.link.release(tag)
            origin, in_tag, _ = self.upstream.pop(tag, (None, None, 0.0))
            if sent is None and frame.kind is not FrameKind.RESULT:
                return  # already settled (duplicate after a resend)
            if frame.kind is FrameKind.ACK:
                await self._ack(origin, in_tag, frame.request_id)
            elif frame.kind is FrameKind.ERROR:
                await self._route_error(frame.request_id, origin, in_tag, frame)
            elif frame.request_id in self.pending:  # RESULT answered back to us (the next stage has no --next)
                await self._deliver(frame)
                await self._ack(origin, in_tag, frame.request_id)
            elif origin is not None:
                frame.params = {**frame.params, "tag": in_tag}
                await origin.send(frame)
        elif frame.kind is FrameKind.ERROR:
            log.warning("next stage reported: %s", frame.error)

    async def _undeliverable(self, frame: Frame, reason: str) -> None:
        tag = frame.params.get("tag")
        origin, in_tag, _ = self.upstream.pop(tag, (None, None, 0.0)) if isinstance(tag, int) else (None, None, 0.0)
        assert self.link is not None
        err = frame.reply_error(
            ErrorCode.STAGE_UNAVAILABLE,
            f"stage {self.name} could not pass request {frame.request_id} on to {self.link.target} ({reason}); "
            "restart that stage on the same address (its neighbours need no restart) or list replicas in --next",
        )
        await self._route_error(frame.request_id, origin, in_tag, err)

    async def _janitor(self) -> None:
        horizon = 2 * self.opts.request_timeout_s
        while True:
            await asyncio.sleep(min(5.0, horizon))
            now = time.monotonic()
            for tag in [t for t, (_, _, ts) in self.upstream.items() if now - ts > horizon]:
                del self.upstream[tag]
            if self.link is not None:
                self.link.expire(horizon)
            if isinstance(self.span, StackSpan):
                self.span.expire_idle()  # KV caches idle past their timeout (also checked whenever the stage computes)


# --- running a stage ---------------------------------------------------------------
async def serve_until_stopped(server: StageServer, stop: asyncio.Event) -> None:
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop()


class StageThread:
    """A stage server on its own event loop in a background thread (tests, local pipelines)."""

    def __init__(self, span: Span, host: str = "127.0.0.1", port: int = 0, options: StageOptions | None = None):
        self.server = StageServer(span, host, port, options)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stage-{self.server.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self.server.state is not StageState.SERVING:
            raise StageUnavailableError(f"stage {self.server.name} did not start on {host}:{port}")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.server.start())
        self._ready.set()
        self.loop.run_forever()

    @property
    def address(self) -> Address:
        return self.server.host, self.server.port

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop)
        with contextlib.suppress(Exception):
            fut.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
