"""What the parts of a stage server share: the work queue's items, the entry's pending requests, and three
small helpers (reject a frame, ACK a custody tag, validate a frame against the span).

The server (:class:`~blocktrain.serve.stage.server.StageServer`) holds one object per part and hands each the
collaborators it needs: :class:`~blocktrain.serve.stage.entry.Entry` (requests given to the entry),
:class:`~blocktrain.serve.stage.custody.Router` (routing frames and keeping custody of them) and
:class:`~blocktrain.serve.stage.admission.Admission` (inbound connections and their limits).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from blocktrain.errors import WireError
from blocktrain.serve.runtime import Span
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, MisroutedError, UnknownRequestError
from blocktrain.serve.wire.links import Conn

log = logging.getLogger("blocktrain.serve.stage")  # one logger for the whole stage server

Spawn = Callable[[Coroutine[Any, Any, None]], None]  # run a coroutine as a task the server cancels on stop


class Throttled:
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
    nbytes: int = 0  # bytes of its tensors counted against the queue's cap until it is routed (0: not counted)


def tensor_bytes(frame: Frame) -> int:
    """Bytes of a frame's tensors (what a stage holds while it keeps the frame)."""
    return sum(t.numel() * t.element_size() for t in frame.tensors.values())


@dataclass
class Pending:
    conn: Conn  # the client's connection
    submit: Frame  # the original request, kept for retries
    nbytes: int = 0  # bytes of its tensors
    timer: asyncio.TimerHandle | None = None
    attempts: int = 0
    seq: int = 0  # the step the entry waits for (its retries keep it): only a RESULT or ERROR of it answers the request
    t0: float = field(default_factory=time.monotonic)


async def reject(conn: Conn, frame: Frame, code: ErrorCode, message: str) -> None:
    """Answer ``frame`` on ``conn`` with an ERROR (carrying its custody tag, so the sender releases it)."""
    await conn.send(frame.reply_error(code, message, keep_tag=True))


async def admit(span: Span, frame: Frame, conn: Conn, sent: Frame | None = None) -> bool:
    """Whether ``span`` can run ``frame``; if not, the sender got an ERROR saying why (in answer to ``sent``, the frame
    as it arrived, where the entry renamed its request)."""
    try:
        span.validate(frame)
    except WireError as exc:
        code = (ErrorCode.UNKNOWN_REQUEST if isinstance(exc, UnknownRequestError)
                else ErrorCode.MISROUTED if isinstance(exc, MisroutedError) else ErrorCode.BAD_REQUEST)
        message = str(exc) if sent is None else str(exc).replace(frame.request_id, sent.request_id)  # its own id
        await reject(conn, sent or frame, code, message)
        return False
    return True


async def ack(origin: Conn | None, tag: int | None, rid: str) -> None:
    """Release the sender's custody of a frame (nothing for frames submitted here)."""
    if origin is not None and tag is not None:
        await origin.send(Frame(FrameKind.ACK, rid, params={"tag": tag}))
