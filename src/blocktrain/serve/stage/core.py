"""The state a stage server keeps, and the small helpers every part of it uses.

:class:`StageCore` holds the span, the options, the pending requests of the entry,
the custody map of frames passed on, the inbound connections and the shared byte
budget. The parts of the server build on it, one concept each:
:mod:`~blocktrain.serve.stage.entry` (requests given to the entry),
:mod:`~blocktrain.serve.stage.custody` (routing frames and keeping custody of them),
:mod:`~blocktrain.serve.stage.admission` (inbound connections and their limits) and
:mod:`~blocktrain.serve.stage.server` (lifecycle and the batching loop).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from blocktrain.errors import WireError
from blocktrain.serve.runtime import Span
from blocktrain.serve.stage.options import StageOptions, StageState
from blocktrain.serve.wire.frames import SMALL_FRAME_BYTES, ErrorCode, Frame, FrameKind, UnknownRequestError
from blocktrain.serve.wire.links import ByteBudget, Conn, Counters, Link

log = logging.getLogger("blocktrain.serve.stage")  # one logger for the whole stage server


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


class StageCore:
    """State of a stage server and the helpers its parts share (the server itself: :class:`~blocktrain.serve.stage.StageServer`)."""

    def __init__(self, span: Span, host: str, port: int, options: StageOptions | None = None) -> None:
        self.span = span
        self.host = host
        self.port = port
        self.opts = options or StageOptions()
        self.state = StageState.STARTING
        self.counters = Counters()
        self.name = f"{span.describe()['family']}[{span.lo}-{span.hi}]"
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

    def info(self) -> dict[str, Any]:
        return {"state": self.state.value, "name": self.name, **self.span.describe(),
                "pending": len(self.pending), "stats": asdict(self.counters), "connections": len(self.conns),
                "buffered_bytes": self.budget.used, "buffered_peak": self.budget.peak,
                "buffer_bytes": self.budget.total}

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    async def _reject(self, conn: Conn, frame: Frame, code: ErrorCode, message: str) -> None:
        err = frame.reply_error(code, message)
        if "tag" in frame.params:
            err.params = {"tag": frame.params["tag"]}
        await conn.send(err)

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

    async def _ack(self, origin: Conn | None, tag: int | None, rid: str) -> None:
        if origin is not None and tag is not None:
            await origin.send(Frame(FrameKind.ACK, rid, params={"tag": tag}))
