"""Routing frames through a stage, and custody of the frames it passes on.

Custody: each forwarded frame is ACKed by the next stage only after it left the
rest of the pipeline, so a stage that dies mid-request is noticed by its
neighbour (connection drop), which resends to a replica or reports upstream.
A stage without ``--next`` answers on the connection the frame came in on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from blocktrain.serve.runtime import Span
from blocktrain.serve.stage.core import Spawn, WorkItem, ack, admit, log, reject, tensor_bytes
from blocktrain.serve.stage.entry import Entry
from blocktrain.serve.wire.frames import SEQ_PARAM, ErrorCode, Frame, FrameKind, custody_tag, step_seq
from blocktrain.serve.wire.links import Conn, Link


class Router:
    """Frames in from a connection, results and errors out to where they belong, frames on to the next stage.

    ``entry`` holds the requests given to this stage, ``enqueue`` hands a frame to the compute queue, ``spawn``
    runs a task the server cancels on stop (what the link's reader sends upstream is sent in one: a peer that reads
    slowly holds its own frames, not every ACK, ERROR and RESULT coming back through the link) and ``info`` is what a
    PING is answered with; ``link`` (to the next stage) is set once the server has started.
    """

    def __init__(self, span: Span, entry: Entry, name: str, enqueue: Callable[[WorkItem], None], spawn: Spawn,
                 info: Callable[[], dict[str, Any]], max_queued: int = 1 << 30, max_queued_bytes: int = 1 << 62) -> None:
        self.span = span
        self.max_queued = max_queued  # frames one connection may have queued or running here
        self.max_queued_bytes = max_queued_bytes  # bytes of the frames queued from connections, all together
        self.queued_bytes = 0
        self.entry = entry
        self.name = name
        self.enqueue = enqueue
        self.spawn = spawn
        self.info = info
        self.link: Link | None = None
        self.upstream: dict[int, tuple[Conn | None, int | None, float]] = {}  # link tag -> origin of the frame

    def serves(self, conn: Conn) -> bool:
        """Whether a frame that came in on ``conn`` is in custody downstream."""
        return any(origin is conn for origin, _, _ in self.upstream.values())

    async def on_frame(self, frame: Frame, conn: Conn) -> None:
        kind = frame.kind
        if kind is FrameKind.PING:
            await conn.send(Frame(FrameKind.PONG, request_id=frame.request_id, params=self.info()))
        elif kind is FrameKind.SUBMIT:
            await self.entry.submit(frame, conn)
        elif kind is FrameKind.WORK:
            if not self.span.holds(frame.sigma_index):
                await reject(conn, frame, ErrorCode.MISROUTED,
                             f"stage {self.name} does not run index {frame.sigma_index}; check the --next chain")
            elif frame.sigma_index == 0 and not self.entry.accepts(frame):  # another sweep, of the pending step
                await reject(conn, frame, ErrorCode.UNKNOWN_REQUEST,
                             f"request {frame.request_id!r} (step {step_seq(frame)}) is not in flight at {self.name}")
            elif await admit(self.span, frame, conn):
                n = tensor_bytes(frame)
                if conn.inflight >= self.max_queued or self.queued_bytes + n > self.max_queued_bytes:
                    await reject(conn, frame, ErrorCode.OVERLOADED, (
                        f"stage {self.name} has {conn.inflight} frames of this connection and {self.queued_bytes} "
                        "bytes queued; send it again once fewer are in flight"))
                    return
                conn.inflight += 1  # until the batch it joins has been emitted (keeps the idle timeout off)
                self.queued_bytes += n
                self.enqueue(WorkItem(frame, conn, custody_tag(frame), n))
        elif kind is FrameKind.RESULT:
            if self.entry.holds(frame.request_id):  # delivered if of the pending step, else dropped; ACKed
                tag = custody_tag(frame)
                await self.entry.deliver(frame)
                await conn.send(Frame(FrameKind.ACK, frame.request_id, params={"tag": tag}))
            else:
                await reject(conn, frame, ErrorCode.UNKNOWN_REQUEST,
                             f"no request {frame.request_id!r} is pending at {self.name}")
        elif kind is FrameKind.RELEASE:
            # passed on bare (its tensors, if a peer sent any, would bypass the byte budget in the link's queue); at
            # the entry, a client's release of its own request, by the entry's name for it
            # with the newest step the entry has issued: a step of the request still queued (or not yet checked out)
            # at a stage stores no cache once it runs
            at_entry = self.span.holds(0)
            rid = self.entry.inner(conn, frame.request_id) if at_entry else frame.request_id
            seq = self.entry.last_seq if at_entry else step_seq(frame)
            frame = Frame(FrameKind.RELEASE, rid, frame.mode, params={} if seq is None else {SEQ_PARAM: seq})
            found = self.span.release(frame.request_id, seq)
            if self.link is not None and not self.span.is_last:
                self.link.send(frame, custody=False)
            if not found:  # a release is idempotent: a request that slid its window or only scored holds nothing
                log.debug("release of %r at %s: it holds no KV cache", frame.request_id, self.name)
        else:
            log.debug("ignoring a %s frame from %s", kind.value, conn.peer)

    async def emit(self, item: WorkItem, out: Frame) -> None:
        """Send a computed frame where it belongs: this stage again, the next stage, the sender or the client."""
        rid, seq = out.request_id, step_seq(item.frame)  # the step the computed frame belongs to
        if out.kind is FrameKind.ERROR:
            await self._route_error(rid, item.origin, item.in_tag, out, seq)
            return
        held = self.entry.holds(rid)
        local = out.kind is FrameKind.RESULT and held and self.span.holds(0) and self.span.is_last
        local |= out.kind is FrameKind.WORK and self.span.holds(out.sigma_index)
        if local:
            if out.kind is FrameKind.RESULT:
                await self.entry.deliver(out)  # dropped there if it answers an earlier step
            elif self.entry.accepts(out):
                self.enqueue(WorkItem(out, None, None))
            await ack(item.origin, item.in_tag, rid)
        elif self.link is not None:
            tag = self.link.send(out)
            self.upstream[tag] = (item.origin, item.in_tag, time.monotonic())
        elif out.kind is FrameKind.RESULT and item.origin is not None:
            out.params = {**out.params, "tag": item.in_tag}
            await item.origin.send(out)  # no --next: answer the sender (also releases its custody)
        else:
            await self._route_error(rid, item.origin, item.in_tag, out.reply_error(
                ErrorCode.STAGE_UNAVAILABLE, f"stage {self.name} has no --next stage for index {out.sigma_index}"), seq)

    async def _route_error(self, rid: str, origin: Conn | None, in_tag: int | None, err: Frame,
                           seq: int | None) -> None:
        """Fail request ``rid``'s step ``seq`` (the ``seq`` of the frame that failed) at the entry, or pass the
        error back to where the frame came from."""
        if self.entry.holds(rid):
            await self.entry.fail_or_retry(rid, err, seq)
            await ack(origin, in_tag, rid)
        elif origin is not None:
            fwd = Frame(FrameKind.ERROR, rid, err.mode, code=err.code, error=err.error, params={"tag": in_tag})
            await origin.send(fwd)
        else:
            log.warning("request %s failed and nobody waits for it: %s", rid, err.error)

    # --- frames coming back from the next stage (the link's callbacks) ---------------
    async def from_downstream(self, frame: Frame) -> None:
        tag = custody_tag(frame)  # an int, never a bool (True would release tag 1)
        if frame.kind in (FrameKind.ACK, FrameKind.ERROR, FrameKind.RESULT) and tag is not None:
            assert self.link is not None
            sent = self.link.release(tag)
            origin, in_tag, _ = self.upstream.pop(tag, (None, None, 0.0))
            if sent is None and frame.kind is not FrameKind.RESULT:
                return  # already settled (duplicate after a resend)
            # this runs in the link's reader: every send upstream goes in a task of its own
            if frame.kind is FrameKind.ACK:
                self.spawn(ack(origin, in_tag, frame.request_id))
            elif frame.kind is FrameKind.ERROR:  # of the step of the frame it answers (an ERROR carries no params)
                self.spawn(self._route_error(frame.request_id, origin, in_tag, frame, step_seq(sent)))
            elif self.entry.holds(frame.request_id):  # RESULT answered back to us (the next stage has no --next)
                await self.entry.deliver(frame)  # sent in a task of its own; dropped if it answers an earlier step
                self.spawn(ack(origin, in_tag, frame.request_id))
            elif origin is not None:
                frame.params = {**frame.params, "tag": in_tag}
                self.spawn(self._send(origin, frame))
        elif frame.kind is FrameKind.ERROR:
            log.warning("next stage reported: %s", frame.error)

    async def undeliverable(self, frame: Frame, reason: str) -> None:
        tag = frame.params.get("tag")
        origin, in_tag, _ = self.upstream.pop(tag, (None, None, 0.0)) if isinstance(tag, int) else (None, None, 0.0)
        assert self.link is not None
        err = frame.reply_error(
            ErrorCode.STAGE_UNAVAILABLE,
            f"stage {self.name} could not pass request {frame.request_id} on to {self.link.target} ({reason}); "
            "restart that stage on the same address (its neighbours need no restart) or list replicas in --next",
        )
        self.spawn(self._route_error(frame.request_id, origin, in_tag, err, step_seq(frame)))  # in a task of its own

    @staticmethod
    async def _send(conn: Conn, frame: Frame) -> None:
        await conn.send(frame)

    def expire(self, horizon_s: float) -> None:
        """Forget custody older than ``horizon_s`` (its requests have long timed out); a next stage that held a frame
        half that long without answering is taken for hung (:meth:`Link.stalled`)."""
        now = time.monotonic()
        for tag in [t for t, (_, _, ts) in self.upstream.items() if now - ts > horizon_s]:
            del self.upstream[tag]
        if self.link is not None:
            self.link.stalled(horizon_s / 2)
            self.link.expire(horizon_s)
