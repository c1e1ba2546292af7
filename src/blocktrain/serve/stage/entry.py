"""The entry stage's bookkeeping of the requests it was given.

The stage holding block/layer 0 is the *entry*: it keeps each request it was
given (``pending``) with a deadline. Deterministic requests (score, sweep, ar,
baseline prefill) are retried on a downstream failure up to ``retries`` times;
otherwise the client gets an ERROR saying which stage failed and what to do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from blocktrain.serve.runtime import Span
from blocktrain.serve.stage.core import Pending, Spawn, WorkItem, admit, log, reject, tensor_bytes
from blocktrain.serve.stage.options import StageOptions
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, Mode
from blocktrain.serve.wire.links import Conn


class Entry:
    """Requests submitted to this stage: admitted, timed, retried, answered.

    ``enqueue`` hands a frame to the stage's compute queue; ``spawn`` runs a task the server cancels on stop.
    """

    def __init__(self, span: Span, opts: StageOptions, name: str, enqueue: Callable[[WorkItem], None],
                 spawn: Spawn) -> None:
        self.span = span
        self.opts = opts
        self.name = name
        self.enqueue = enqueue
        self.spawn = spawn
        self.pending: dict[str, Pending] = {}
        self.pending_bytes = 0  # bytes of the pending requests' tensors

    def holds(self, rid: str) -> bool:
        """Whether request ``rid`` was given to this stage and is not answered yet."""
        return rid in self.pending

    def serves(self, conn: Conn) -> bool:
        """Whether a request that came in on ``conn`` is still pending."""
        return any(p.conn is conn for p in self.pending.values())

    async def submit(self, frame: Frame, conn: Conn) -> None:
        if not self.span.holds(0):
            await reject(conn, frame, ErrorCode.MISROUTED,
                         f"stage {self.name} is not the entry; send requests to the stage holding index 0")
            return
        if frame.request_id in self.pending:
            await reject(conn, frame, ErrorCode.DUPLICATE_REQUEST,
                         f"request {frame.request_id!r} is already in flight; use a fresh id")
            return
        if not frame.request_id:
            await reject(conn, frame, ErrorCode.BAD_REQUEST, "SUBMIT frames need a request id")
            return
        if not await admit(self.span, frame, conn):
            return
        n, mine = tensor_bytes(frame), sum(1 for p in self.pending.values() if p.conn is conn)
        if (len(self.pending) >= self.opts.max_pending or mine >= self.opts.max_pending_per_conn
                or self.pending_bytes + n > self.opts.buffer_bytes):
            await reject(conn, frame, ErrorCode.OVERLOADED, (
                f"stage {self.name} holds {len(self.pending)} requests ({mine} of this connection, "
                f"{self.pending_bytes} bytes; at most {self.opts.max_pending}, {self.opts.max_pending_per_conn} and "
                f"{self.opts.buffer_bytes}); send it again once fewer are in flight"))
            return
        p = Pending(conn, frame, nbytes=n)
        self.pending[frame.request_id] = p
        self.pending_bytes += n
        self._arm(frame.request_id, p)
        self.enqueue(WorkItem(self._fresh(frame), None, None))

    @staticmethod
    def _fresh(frame: Frame) -> Frame:
        return Frame(FrameKind.SUBMIT, frame.request_id, frame.mode, 0, dict(frame.params), dict(frame.tensors))

    def _arm(self, rid: str, p: Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
        loop = asyncio.get_running_loop()
        p.timer = loop.call_later(self.opts.request_timeout_s, lambda: self.spawn(self._timeout(rid, p)))

    async def _timeout(self, rid: str, p: Pending) -> None:
        if self.pending.get(rid) is not p:
            return
        await self.fail_or_retry(rid, p.submit.reply_error(
            ErrorCode.TIMEOUT,
            f"no result for request {rid} within {self.opts.request_timeout_s:.1f}s after {self.name}; a later stage "
            "may have died or be overloaded: check each 'blocktrain serve' process and restart the dead one",
        ))

    async def fail_or_retry(self, rid: str, err: Frame) -> None:
        p = self.pending.get(rid)
        if p is None:
            return
        stateless = p.submit.mode is not Mode.BASELINE or int(p.submit.params.get("pos", 0)) == 0
        transient = err.code in (ErrorCode.STAGE_UNAVAILABLE, ErrorCode.TIMEOUT)
        if stateless and transient and p.attempts < self.opts.retries:
            p.attempts += 1
            log.warning("request %s: %s; retry %d of %d", rid, err.error, p.attempts, self.opts.retries)
            self._arm(rid, p)
            self.enqueue(WorkItem(self._fresh(p.submit), None, None))
            return
        self._drop(rid)
        err.params = {}
        self.spawn(self._answer(p.conn, err))  # in a task: a slow client holds neither compute nor a link's reader

    def _drop(self, rid: str) -> Pending:
        """Request ``rid`` answered (or failed): no longer pending, its timer off, its bytes no longer held."""
        p = self.pending.pop(rid)
        self.pending_bytes -= p.nbytes
        if p.timer is not None:
            p.timer.cancel()
        return p

    async def deliver(self, result: Frame) -> None:
        """Answer a request with its result: sent in a task of its own, so a client that reads slowly holds only its
        own answers, never the stage's compute or its link's reader (which deliver results from later stages)."""
        p = self._drop(result.request_id)
        result.params = {k: v for k, v in result.params.items() if k != "tag"}
        result.params["stage_seconds"] = time.monotonic() - p.t0
        self.spawn(self._answer(p.conn, result))

    @staticmethod
    async def _answer(conn: Conn, result: Frame) -> None:
        if not await conn.send(result):
            log.info("client of request %s went away before its result", result.request_id)

    def stop(self) -> None:
        for p in self.pending.values():
            if p.timer is not None:
                p.timer.cancel()
