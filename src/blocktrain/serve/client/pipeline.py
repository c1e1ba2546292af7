"""Client of a serving pipeline: one persistent connection to the entry stage.

Many requests can be in flight on one connection (each has its own id); the
entry stage batches those that arrive together. The entry stage's description is read once, on connecting
(:attr:`PipelineClient.stage`). Generation runs the loops of :mod:`blocktrain.serve.client.decoding` over the
connection (:meth:`PipelineClient.decode`, for any mode; ``iter_*``/``generate_*`` per mode): ``generate_ar`` and
``generate_baseline`` reproduce :func:`blocktrain.evaluate.generate.generate`
(same seeds, same sampling), so a pipeline and a local model give the same text;
on a stack run's pipeline ``generate_ar`` keeps a KV cache per request in every
stage. ``generate_spec``/``iter_spec`` run speculative decoding on a stack or diffusion run; ``iter_ar`` and
``iter_spec`` yield bytes as they are accepted, for streaming.

When the stages share a token (``blocktrain serve`` with ``BLOCKTRAIN_SERVE_TOKEN``
or ``--token-file``), the client opens its connection with a HELLO frame carrying
it: ``token=`` or, by default, the ``BLOCKTRAIN_SERVE_TOKEN`` environment variable.
A connection the entry closed (e.g. after its idle timeout) is reopened on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch

from blocktrain.config import VOCAB_SIZE
from blocktrain.errors import FramingError, ServeError, StageUnavailableError, WireError
from blocktrain.serve.client.decoding import Sampling, SpecResult, answered, decode
from blocktrain.serve.client.stage_info import StageInfo
from blocktrain.serve.wire.frames import DEFAULT_MAX_FRAME_BYTES, ErrorCode, Frame, FrameKind, Mode, UnknownRequestError
from blocktrain.serve.wire.links import Address, Conn, Counters, open_conn, parse_address
from blocktrain.serve.wire.modes import generation_mode

log = logging.getLogger(__name__)

TOKEN_ENV = "BLOCKTRAIN_SERVE_TOKEN"  # shared serving token, read by `blocktrain serve` and by clients
_UNAVAILABLE = (ErrorCode.STAGE_UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.OVERLOADED)
_WIRE = (ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.UNKNOWN_REQUEST, ErrorCode.DUPLICATE_REQUEST,
         ErrorCode.MISROUTED, ErrorCode.BAD_REQUEST)
# ErrorCode.UNAUTHORIZED is a plain ServeError: the token is wrong or missing, retrying will not help


def error_from_frame(frame: Frame) -> ServeError:
    msg = f"pipeline error ({(frame.code or ErrorCode.INTERNAL).value}): {frame.error}"
    if frame.code in _UNAVAILABLE:
        return StageUnavailableError(msg)
    if frame.code is ErrorCode.UNKNOWN_REQUEST:
        return UnknownRequestError(msg)  # a WireError; KV-cached loops catch it and prefill again
    if frame.code in _WIRE:
        return WireError(msg)
    return ServeError(msg)


class PipelineClient:
    """Async client; use as ``async with PipelineClient(addr) as c: ...``."""

    def __init__(
        self,
        address: Address | str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        connect_attempts: int = 3,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        token: str | None = None,
    ) -> None:
        self.address = parse_address(address) if isinstance(address, str) else address
        self.token = os.environ.get(TOKEN_ENV, "") if token is None else token  # "" = the stages need none
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.connect_attempts = connect_attempts
        self.max_frame_bytes = max_frame_bytes
        self.counters = Counters()
        self.conn: Conn | None = None
        self._futures: dict[str, asyncio.Future[Frame]] = {}
        self.connects = 0  # connects finished, failed or not
        self._failure: ServeError | None = None  # why the last connect failed (None: it succeeded)
        self._releases: set[asyncio.Task[None]] = set()  # RELEASE frames being sent (held: a task is weakly referenced)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._reader: asyncio.Task[None] | None = None
        self._refusal: ServeError | None = None  # why the entry stage hung up on us, when it said so
        self._opened = False  # connect() succeeded and close() was not called: reopen a dropped connection
        self._reopen = asyncio.Lock()
        self._stage: StageInfo | None = None  # read on connecting

    async def __aenter__(self) -> PipelineClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    async def connect(self) -> None:
        """Open the connection and read the entry stage's description; StageUnavailableError when it cannot."""
        try:
            await self._connect()
        except ServeError as exc:
            self._failure = exc
            raise
        except BaseException:  # cancelled (its request's client left): no failure for the others to share
            self._failure = None
            raise
        else:
            self._failure = None
        finally:
            self.connects += 1

    def failed_since(self, seen: int) -> ServeError | None:
        """Why the last connect failed, if one finished after the caller saw ``seen`` connects (:attr:`connects`) and
        it failed: requests that waited for a connect (the first, or a reopen after the entry restarted) take its
        failure rather than connecting in turn, the k-th after k failures; a later request tries again."""
        failure = self._failure
        if self.connects == seen or failure is None:
            return None
        try:  # a copy for each waiter: one object raised in many tasks gathered their frames and contexts
            shared = copy.copy(failure)
        except Exception:
            shared = StageUnavailableError(str(failure))
        shared.__traceback__ = shared.__context__ = shared.__cause__ = None
        return shared

    async def _connect(self) -> None:
        delay = 0.1
        last: Exception | None = None
        for _ in range(self.connect_attempts):
            try:
                self.conn = await open_conn(self.address, self.counters, self.max_frame_bytes, self.connect_timeout_s,
                                            token=self.token, write_timeout_s=self.timeout_s)  # a hung stage: dropped
                break
            except (TimeoutError, OSError) as exc:
                last = exc
                await asyncio.sleep(delay)
                delay *= 2
        else:
            raise StageUnavailableError(
                f"cannot reach the entry stage at {self.where} after {self.connect_attempts} attempts ({last}); "
                "start it with 'blocktrain serve --blocks 0-.. --listen HOST:PORT' or check --pipeline"
            )
        self._refusal = None
        self._reader = asyncio.create_task(self._read_loop(self.conn))
        try:
            pong = await self.call(Frame(FrameKind.PING, self.new_id()), self.connect_timeout_s, reopen=False)
            self._stage = StageInfo.from_pong(pong.params)  # a PING is answered at once: a silent port is no stage
        except BaseException:  # no PONG, or not a stage's: its reader must not outlive it and fail a later connection's calls
            await self._drop()
            raise
        self._opened = True

    @property
    def stage(self) -> StageInfo:
        """The entry stage's description, read when the client connected; ServeError before that."""
        if self._stage is None:
            raise ServeError(f"not connected to {self.where}; call connect() first")
        return self._stage

    async def close(self) -> None:
        self._opened = False
        if self._releases:  # the last RELEASEs go out before the connection closes
            await asyncio.wait(set(self._releases), timeout=1.0)
        await self._drop()

    async def _drop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    async def _read_loop(self, conn: Conn) -> None:
        reason = "the entry stage closed the connection"
        try:
            while True:
                try:
                    frame = await conn.recv()
                except FramingError:
                    raise
                except WireError as exc:
                    log.warning("bad frame from the entry stage: %s", exc)
                    bad = self._futures.pop(exc.request_id, None) if exc.request_id else None
                    if bad is not None and not bad.done():  # its request fails now, not at its timeout
                        bad.set_exception(WireError(f"the entry stage at {self.where} answered request "
                                                    f"{exc.request_id} with a bad frame: {exc}"))
                    continue
                if (frame.kind is FrameKind.ERROR and not frame.request_id
                        and frame.code in (ErrorCode.UNAUTHORIZED, ErrorCode.OVERLOADED)):
                    # the connection refused (no request's id): the stage hangs up next, fail every request with it
                    # (a request's own OVERLOADED leaves the connection open, and later failures their own reasons)
                    self._refusal = error_from_frame(frame)
                fut = self._futures.pop(frame.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frame)
                elif frame.kind is FrameKind.ERROR:
                    log.warning("entry stage error: %s", frame.error)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, FramingError) as exc:
            reason = f"connection to the entry stage lost ({exc!r})"
        finally:
            conn.close()  # so that the next call reconnects
            for rid, fut in list(self._futures.items()):
                if not fut.done():
                    fut.set_exception(self._refusal or StageUnavailableError(
                        f"request {rid}: {reason} at {self.where}; restart that stage and retry"))
            self._futures.clear()

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def call(self, frame: Frame, timeout_s: float | None = None, *, reopen: bool = True) -> Frame:
        """Send one frame and wait for the frame answering its id (RESULT/PONG); raise on ERROR."""
        if reopen and self._opened and (self.conn is None or self.conn.closed):
            seen = self.connects
            async with self._reopen:  # the entry closed the connection (idle timeout, restart): open a fresh one
                if self.conn is None or self.conn.closed:
                    failed = self.failed_since(seen)
                    if failed is not None:
                        raise failed
                    await self._drop()
                    await self.connect()
        if self.conn is None or self.conn.closed:
            raise self._refusal or StageUnavailableError(f"not connected to {self.where}; the entry stage went away")
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._futures[frame.request_id] = fut
        if not await self.conn.send(frame):
            self._futures.pop(frame.request_id, None)
            if self._reader is not None:  # let the read loop take in what the stage said before it hung up
                await asyncio.wait([self._reader], timeout=1.0)
            raise self._refusal or StageUnavailableError(
                f"sending to the entry stage at {self.where} failed; is it running?")
        timeout = timeout_s or self.timeout_s
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise StageUnavailableError(
                f"request {frame.request_id} got no answer from the pipeline at {self.where} within {timeout:.1f}s; "
                "a stage may be down or overloaded: check each 'blocktrain serve' process"
            ) from None
        finally:  # answered, timed out or cancelled (its HTTP client left): no future is left behind
            self._futures.pop(frame.request_id, None)
        if reply.kind is FrameKind.ERROR:
            raise error_from_frame(reply)
        return reply

    async def ping(self) -> dict[str, Any]:
        return (await self.call(Frame(FrameKind.PING, self.new_id()))).params

    # --- modes ------------------------------------------------------------------------
    async def score(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Teacher-forced logits (b, t, 256) of bytes x (b, t): one traversal."""
        f = Frame(FrameKind.SUBMIT, self.new_id(), Mode.SCORE, params={"seed": seed}, tensors={"x": x.to(torch.uint8)})
        return answered(await self.call(f), "logits", (*x.shape, VOCAB_SIZE))

    async def release(self, request_id: str, mode: Mode) -> None:
        """Ask the stages to drop a request's KV caches; nothing when the connection is gone (they expire them).

        Sent in a task of its own, not awaited: a generation's ``finally`` calls this as its task is cancelled (its
        HTTP client left, its stream's cancel scope cancelling every await again), and a send awaited there when it
        has to wait for the connection was cancelled too, or held the cancelled task, so the caches were kept until
        their idle timeout."""
        conn = self.conn
        if conn is not None and not conn.closed:
            task = asyncio.get_running_loop().create_task(self._release(conn, Frame(FrameKind.RELEASE, request_id, mode)))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    @staticmethod
    async def _release(conn: Conn, frame: Frame) -> None:
        with contextlib.suppress(ServeError):
            await conn.send(frame)

    def decode(self, mode: Mode, prompt: bytes, n_new: int, sampling: Sampling,
               stats: SpecResult | None = None) -> AsyncIterator[bytes]:
        """The ``n_new`` bytes after ``prompt`` in ``mode``, in chunks as they come (:func:`~.decoding.decode`)."""
        return decode(mode, self, prompt, n_new, sampling, stats)

    async def generate(self, mode: Mode, prompt: bytes, n_new: int, sampling: Sampling) -> bytes:
        """The ``n_new`` bytes after ``prompt`` in ``mode``, whole."""
        return b"".join([chunk async for chunk in self.decode(mode, prompt, n_new, sampling)])

    # ``sampling`` below: the fields of :class:`~.decoding.Sampling` (temperature, top_k, top_p, seed, and the mode's own)
    def iter_ar(self, prompt: bytes, n_new: int, **sampling: Any) -> AsyncIterator[bytes]:
        """One byte per traversal, yielded as it is sampled (KV-cached on stack and E2E pipelines).

        With top_p = 1 the bytes equal ``generate(local model, ...)`` at the same seed.
        """
        return self.decode(Mode.AR, prompt, n_new, Sampling(**sampling))

    async def generate_ar(self, prompt: bytes, n_new: int, **sampling: Any) -> bytes:
        """Same bytes as ``generate(assembled_model, ...)``: one traversal per byte."""
        return await self.generate(Mode.AR, prompt, n_new, Sampling(**sampling))

    async def generate_baseline(self, prompt: bytes, n_new: int, **sampling: Any) -> bytes:
        """E2E baseline: prefill the prompt, then one token per traversal with a KV cache in every stage."""
        return await self.generate(Mode.BASELINE, prompt, n_new, Sampling(**sampling))

    async def sweep(self, prompt: bytes, n_new: int, **sampling: Any) -> bytes:
        """A whole n_new-byte continuation from one traversal (per sweep)."""
        return await self.generate(Mode.SWEEP, prompt, n_new, Sampling(**sampling))

    def iter_spec(self, prompt: bytes, n_new: int, **sampling: Any) -> AsyncIterator[bytes]:
        """Speculative decoding: yields the bytes each traversal accepts."""
        return self.decode(Mode.SPEC, prompt, n_new, Sampling(**sampling))

    async def generate_spec(self, prompt: bytes, n_new: int, **sampling: Any) -> SpecResult:
        """Speculative decoding: n_new bytes drafted by the entry stage and verified one traversal per draft."""
        result = SpecResult(b"")
        async for _ in self.decode(Mode.SPEC, prompt, n_new, Sampling(**sampling), result):
            pass
        return result


async def generate_with(client: PipelineClient, mode: str, prompt: bytes, n: int, **sampling: Any) -> bytes:
    """``n`` bytes after ``prompt`` in the mode named ``mode``; ``sampling``: the fields of
    :class:`~.decoding.Sampling` (a mode ignores those it does not take; ServeError for top_p < 1 where none is)."""
    return await client.generate(generation_mode(mode), prompt, n, Sampling(**sampling))


def generate_remote(
    pipeline: str, mode: str, prompt_bytes: bytes, n_bytes: int, *, timeout_s: float = 60.0, token: str | None = None,
    **sampling: Any,
) -> bytes:
    """``blocktrain generate --pipeline HOST:PORT --mode {ar,sweep,spec,baseline}``: ``n_bytes`` after the prompt.

    ``sampling``: temperature, top_k, seed, and the mode's own (sweeps; draft_min, draft_max); ``token`` None reads
    $BLOCKTRAIN_SERVE_TOKEN, if set.
    """

    async def run() -> bytes:
        async with PipelineClient(pipeline, timeout_s=timeout_s, token=token) as client:
            return await generate_with(client, mode, prompt_bytes, n_bytes, **sampling)

    try:
        return asyncio.run(run())
    except ValueError as exc:  # a malformed --pipeline address
        raise ServeError(str(exc)) from exc
