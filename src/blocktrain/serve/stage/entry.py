"""The entry stage's bookkeeping of the requests it was given.

The stage holding block/layer 0 is the *entry*: it keeps each request it was
given (``pending``) with a deadline. Deterministic requests (score, sweep, ar,
baseline prefill) are retried on a downstream failure up to ``retries`` times;
otherwise the client gets an ERROR saying which stage failed and what to do.

A request id is the client's name for its request, and clients do not know each other's: the entry names each request
on its own (:meth:`Entry.inner`, a keyed hash of the client's connection and id) before anything keys on it, so a
client can neither evict, rewind nor read another client's KV caches by sending its id, nor answer its request with a
RESULT of its own. The stages after the entry only ever see these names; the client gets its own id back.

A client reuses its id for every step of a KV-cached request (ar on stack stages, spec, the baseline), and a retry
sends a step round again while its first copy may still be on its way: the entry numbers each step it is given
(each SUBMIT; its retries keep the number: every copy of a step computes the same answer) in ``params["seq"]``
(:func:`~blocktrain.serve.wire.frames.step_seq`), and a RESULT or ERROR answers a request only if it carries the
number of the step the entry waits for. A late answer to an earlier step (a retried step's second copy, a link's
resend) is dropped, never taken for the answer to the step after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import secrets
import time
import weakref
from collections.abc import Callable

from blocktrain.serve.runtime import Span
from blocktrain.serve.stage.core import Pending, Spawn, WorkItem, admit, log, reject, tensor_bytes
from blocktrain.serve.stage.options import StageOptions
from blocktrain.serve.wire.frames import SEQ_PARAM, ErrorCode, Frame, FrameKind, Mode, step_seq
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
        self.pending: dict[str, Pending] = {}  # the entry's name of a request (:meth:`inner`) -> the request
        self._secret = secrets.token_bytes(32)  # keys the names: nobody outside this process can derive one
        self._conn_keys: weakref.WeakKeyDictionary[Conn, bytes] = weakref.WeakKeyDictionary()  # a connection's salt
        self.pending_bytes = 0  # bytes of the pending requests' tensors
        self._seqs = itertools.count(1)  # step numbers: each SUBMIT gets the next one, its retries keep it
        self.last_seq = 0  # the newest step number issued (a RELEASE carries it on: no earlier step keeps a cache)

    def inner(self, conn: Conn, rid: str) -> str:
        """The entry's name of request ``rid`` of the client on ``conn``: the same for every frame of that request on
        that connection (its KV caches are found again), different for any other connection (another client's, or this
        client's after it reconnected: its caches are then missing, and it prefills again), and not derivable without
        this entry's secret. 32 hex digits, a valid request id on the wire."""
        salt = self._conn_keys.get(conn)
        if salt is None:
            salt = self._conn_keys[conn] = secrets.token_bytes(16)
        return hmac.new(self._secret, salt + rid.encode(), hashlib.sha256).hexdigest()[:32]

    def holds(self, rid: str) -> bool:
        """Whether the request the entry named ``rid`` was given to this stage and is not answered yet."""
        return rid in self.pending

    def accepts(self, frame: Frame) -> bool:
        """Whether ``frame`` (a RESULT, or WORK coming back for another sweep) belongs to the step its request waits
        for: an answer to an earlier step under the same id (a retry's late copy, a resend) is stale."""
        p = self.pending.get(frame.request_id)
        return p is not None and step_seq(frame) == p.seq

    def serves(self, conn: Conn) -> bool:
        """Whether a request that came in on ``conn`` is still pending."""
        return any(p.conn is conn for p in self.pending.values())

    async def submit(self, frame: Frame, conn: Conn) -> None:
        if not self.span.holds(0):
            await reject(conn, frame, ErrorCode.MISROUTED,
                         f"stage {self.name} is not the entry; send requests to the stage holding index 0")
            return
        if not frame.request_id:
            await reject(conn, frame, ErrorCode.BAD_REQUEST, "SUBMIT frames need a request id")
            return
        rid = self.inner(conn, frame.request_id)
        if rid in self.pending:
            await reject(conn, frame, ErrorCode.DUPLICATE_REQUEST,
                         f"request {frame.request_id!r} is already in flight; use a fresh id")
            return
        seq = self.last_seq = next(self._seqs)
        if not await admit(self.span, self._fresh(frame, rid, seq), conn, sent=frame):
            return
        n, mine = tensor_bytes(frame), sum(1 for p in self.pending.values() if p.conn is conn)
        if (len(self.pending) >= self.opts.max_pending or mine >= self.opts.max_pending_per_conn
                or self.pending_bytes + n > self.opts.buffer_bytes):
            await reject(conn, frame, ErrorCode.OVERLOADED, (
                f"stage {self.name} holds {len(self.pending)} requests ({mine} of this connection, "
                f"{self.pending_bytes} bytes; at most {self.opts.max_pending}, {self.opts.max_pending_per_conn} and "
                f"{self.opts.buffer_bytes}); send it again once fewer are in flight"))
            return
        p = Pending(conn, frame, nbytes=n, seq=seq)
        self.pending[rid] = p
        self.pending_bytes += n
        self._arm(rid, p)
        self.enqueue(WorkItem(self._fresh(frame, rid, seq), None, None))

    @staticmethod
    def _fresh(frame: Frame, rid: str, seq: int) -> Frame:
        """The client's ``frame`` as step ``seq`` of the entry's request ``rid`` (what the stages compute and key
        caches on); a ``seq`` the client sent is overwritten."""
        return Frame(FrameKind.SUBMIT, rid, frame.mode, 0, {**frame.params, SEQ_PARAM: seq}, dict(frame.tensors))

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
            f"no result for request {p.submit.request_id} within {self.opts.request_timeout_s:.1f}s after {self.name}; a "
            "later stage may have died or be overloaded: check each 'blocktrain serve' process and restart the dead one",
        ), p.seq)

    async def fail_or_retry(self, rid: str, err: Frame, seq: int | None) -> None:
        """Request ``rid``'s step ``seq`` failed with ``err``: retry it or answer the client with the error. An error
        of another step than the one pending (None: unknown) is stale and dropped."""
        p = self.pending.get(rid)
        if p is None:
            return
        if seq != p.seq:
            log.debug("request %s: dropped an error of step %s, it waits for step %d: %s", rid, seq, p.seq,
                      err.error)
            return
        stateless = p.submit.mode is not Mode.BASELINE or int(p.submit.params.get("pos", 0)) == 0
        transient = err.code in (ErrorCode.STAGE_UNAVAILABLE, ErrorCode.TIMEOUT)
        if stateless and transient and p.attempts < self.opts.retries:
            p.attempts += 1
            log.warning("request %s: %s; retry %d of %d", rid, err.error, p.attempts, self.opts.retries)
            self._arm(rid, p)
            self.enqueue(WorkItem(self._fresh(p.submit, rid, p.seq), None, None))
            return
        self._drop(rid)
        err.params = {}
        err.request_id = p.submit.request_id  # the client's id, in the message too (a later stage names the entry's)
        err.error = err.error.replace(rid, p.submit.request_id)
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
        own answers, never the stage's compute or its link's reader (which deliver results from later stages).

        A result of another step than the pending one (a retried step's late copy, a resend) is dropped."""
        if not self.accepts(result):
            log.debug("request %s: dropped a stale result of step %s", result.request_id, step_seq(result))
            return
        p = self._drop(result.request_id)
        result.request_id = p.submit.request_id  # the client's id
        result.params = {k: v for k, v in result.params.items() if k not in ("tag", SEQ_PARAM)}
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
