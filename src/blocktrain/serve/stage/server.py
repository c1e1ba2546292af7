"""The stage server: holds a span, batches frames that arrive together, passes them on.

Flow of one request through a ring of three stages (the last stage's
``--next`` points back at the first)::

    client --SUBMIT--> stage 0 --WORK--> stage 1 --WORK--> stage 2 --RESULT--> stage 0 --RESULT--> client

The server holds one object per part and passes each the collaborators it
needs: its options (:mod:`~blocktrain.serve.stage.options`), the entry's
pending requests with deadlines and retries (:class:`~blocktrain.serve.stage.entry.Entry`),
routing and custody of forwarded frames (:class:`~blocktrain.serve.stage.custody.Router`)
and admission of inbound connections with their limits
(:class:`~blocktrain.serve.stage.admission.Admission`); this module adds the
lifecycle and the batching loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from blocktrain.errors import StageUnavailableError
from blocktrain.serve.runtime import Span
from blocktrain.serve.stage.admission import Admission
from blocktrain.serve.stage.core import WorkItem, log
from blocktrain.serve.stage.custody import Router
from blocktrain.serve.stage.entry import Entry
from blocktrain.serve.stage.options import StageOptions, StageState
from blocktrain.serve.wire.frames import SMALL_FRAME_BYTES, ErrorCode, Frame
from blocktrain.serve.wire.links import Address, ByteBudget, Conn, Counters, Link, format_address

__all__ = ["StageOptions", "StageServer", "StageState", "StageThread", "serve_until_stopped"]


class StageServer:
    """An asyncio TCP server for one span of blocks (or E2E layers)."""

    def __init__(self, span: Span, host: str, port: int, options: StageOptions | None = None) -> None:
        self.span = span
        self.host = host
        self.port = port
        self.opts = options or StageOptions()
        self.state = StageState.STARTING
        self.counters = Counters()
        self.name = f"{span.describe()['family']}[{span.lo}-{span.hi}]"
        # bytes of inbound frames buffered now (and at most), with room set aside for a small frame per connection
        self.budget = ByteBudget(self.opts.buffer_bytes, SMALL_FRAME_BYTES, self.opts.max_connections)
        self._queue: asyncio.Queue[WorkItem] = asyncio.Queue()
        self.entry = Entry(span, self.opts, self.name, self._queue.put_nowait, self._spawn)
        self.router = Router(span, self.entry, self.name, self._queue.put_nowait, self._spawn, self.info,
                             self.opts.max_pending, self.opts.buffer_bytes)
        self.admission = Admission(self.opts, self.counters, self.budget, self.name, self.router.on_frame, self._busy,
                                   lambda: self.state is StageState.SERVING)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._aux: set[asyncio.Task[Any]] = set()  # request timeouts and computed frames' routing in progress
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")

    @property
    def conns(self) -> set[Conn]:
        return self.admission.conns

    def info(self) -> dict[str, Any]:
        return {"state": self.state.value, "name": self.name, **self.span.describe(),
                "pending": len(self.entry.pending), "stats": asdict(self.counters), "connections": len(self.conns),
                "buffered_bytes": self.budget.used, "buffered_peak": self.budget.peak,
                "buffer_bytes": self.budget.total, "max_frame_bytes": self.opts.max_frame_bytes}

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    def _busy(self, conn: Conn) -> bool:
        """Whether work that came in on ``conn`` is still in this stage (queued, running, or in custody downstream)."""
        return conn.inflight > 0 or self.entry.serves(conn) or self.router.serves(conn)

    # --- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        self._server = await asyncio.start_server(self.admission.accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.opts.next_stages:
            self.router.link = Link(
                list(self.opts.next_stages), self.counters, self.router.from_downstream, self.router.undeliverable,
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
        if self.router.link is not None:
            await self.router.link.close()
        self.entry.stop()
        me = asyncio.current_task()
        tasks = [t for t in (*self._tasks, *self.admission.handlers, *self._aux) if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in conns:  # writes a peer never read: drop them rather than hold the socket open
            conn.close(abort=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.state = StageState.STOPPED
        log.info("stage %s stopped", self.name)

    async def _janitor(self) -> None:
        horizon = 2 * self.opts.request_timeout_s
        while True:
            await asyncio.sleep(min(5.0, horizon))
            self.router.expire(horizon)
            self.span.expire_idle()  # KV caches idle past their timeout (also checked whenever the stage computes)

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
            for group in (part for g in groups.values() for part in _by_rows(g, self.opts.max_batch_rows)):
                frames = [it.frame for it in group]
                try:
                    outs = await loop.run_in_executor(self._executor, self.span.run, frames)
                except Exception as exc:  # a bug or bad input in compute: each frame alone, so one fails only itself
                    log.exception("stage %s failed on a batch of %d frame(s)", self.name, len(frames))
                    outs = ([await self._alone(loop, f) for f in frames] if len(frames) > 1
                            else [frames[0].reply_error(ErrorCode.INTERNAL, f"stage {self.name} failed: {exc!r}")])
                self.counters.batches += 1
                self.counters.batched_frames += len(frames)
                self.counters.max_batch = max(self.counters.max_batch, len(frames))
                for it, out in zip(group, outs, strict=True):
                    # routed in a task of its own: a client that reads slowly (up to write_timeout_s) holds its own
                    # answer, not the next batch of every other client (each connection's writes stay in order)
                    self._spawn(self._emit(it, out))

    async def _alone(self, loop: asyncio.AbstractEventLoop, frame: Frame) -> Frame:
        """``frame`` run by itself after its batch failed: its own answer, or its own error."""
        try:
            return (await loop.run_in_executor(self._executor, self.span.run, [frame]))[0]
        except Exception as exc:
            log.exception("stage %s failed on request %s", self.name, frame.request_id)
            return frame.reply_error(ErrorCode.INTERNAL, f"stage {self.name} failed: {exc!r}")

    async def _emit(self, it: WorkItem, out: Frame) -> None:
        try:
            await self.router.emit(it, out)
        except Exception:  # one frame's routing failed: logged, the stage serves on (its compute loop died before)
            log.exception("stage %s could not route the %s of request %s", self.name, out.kind.value, out.request_id)
        finally:
            self.router.queued_bytes -= it.nbytes
            if it.origin is not None:
                it.origin.inflight -= 1


def _by_rows(group: list[WorkItem], max_rows: int) -> Iterator[list[WorkItem]]:
    """``group`` in runs of at most ``max_rows`` sequences (a frame with more runs alone)."""
    part: list[WorkItem] = []
    rows = 0
    for it in group:
        n = max((t.shape[0] for t in it.frame.tensors.values() if t.dim() > 0), default=1)
        if part and rows + n > max_rows:
            yield part
            part, rows = [], 0
        part.append(it)
        rows += n
    if part:
        yield part


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
