"""The entry stage's bookkeeping of the requests it was given.

The stage holding block/layer 0 is the *entry*: it keeps each request it was
given (``pending``) with a deadline. Deterministic requests (score, sweep, ar,
baseline prefill) are retried on a downstream failure up to ``retries`` times;
otherwise the client gets an ERROR saying which stage failed and what to do.
"""

from __future__ import annotations

import asyncio
import logging
import time

from blocktrain.serve.stage.core import Pending, StageCore, WorkItem
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, Mode
from blocktrain.serve.wire.links import Conn

log = logging.getLogger("blocktrain.serve.stage")  # one logger for the whole stage server


class EntryRequests(StageCore):
    """Requests submitted to this stage: admitted, timed, retried, answered."""

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

