"""Client of a serving pipeline: one persistent connection to the entry stage.

Many requests can be in flight on one connection (each has its own id); the
entry stage batches those that arrive together. ``generate_ar`` and
``generate_baseline`` reproduce :func:`blocktrain.evaluate.generate.generate`
(same seeds, same sampling), so a pipeline and a local model give the same text;
on a stack run's pipeline ``generate_ar`` keeps a KV cache per request in every
stage. ``generate_spec``/``iter_spec`` run speculative decoding on a stack or diffusion run
(the loop runs here, see :mod:`blocktrain.serve.client.decoding`); ``iter_ar`` and
``iter_spec`` yield bytes as they are accepted, for streaming.

When the stages share a token (``blocktrain serve`` with ``BLOCKTRAIN_SERVE_TOKEN``
or ``--token-file``), the client opens its connection with a HELLO frame carrying
it: ``token=`` or, by default, the ``BLOCKTRAIN_SERVE_TOKEN`` environment variable.
A connection the entry closed (e.g. after its idle timeout) is reopened on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch

from blocktrain.errors import FramingError, ServeError, StageUnavailableError, WireError
from blocktrain.serve.client.decoding import SpecResult, iter_ar, spec_steps
from blocktrain.serve.wire.frames import DEFAULT_MAX_FRAME_BYTES, ErrorCode, Frame, FrameKind, Mode, UnknownRequestError
from blocktrain.serve.wire.links import Address, Conn, Counters, open_conn, parse_address
from blocktrain.serve.wire.modes import MODE_RULES, generation_mode, modes_taking
from blocktrain.serve.wire.speculative import SpecOptions

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


LEGACY_FAMILIES = {"blocktrain": "diffusion"}  # family names stages once used -> today's

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
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._reader: asyncio.Task[None] | None = None
        self._refusal: ServeError | None = None  # why the entry stage hung up on us, when it said so
        self._opened = False  # connect() succeeded and close() was not called: reopen a dropped connection
        self._reopen = asyncio.Lock()
        self.entry: dict[str, Any] = {}

    async def __aenter__(self) -> PipelineClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    async def connect(self) -> None:
        delay = 0.1
        last: Exception | None = None
        for _ in range(self.connect_attempts):
            try:
                self.conn = await open_conn(self.address, self.counters, self.max_frame_bytes, self.connect_timeout_s,
                                            token=self.token)
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
        self.entry = (await self.call(Frame(FrameKind.PING, self.new_id()), reopen=False)).params
        if self.entry.get("family") in LEGACY_FAMILIES:  # a stage of an older release names its family the old way
            self.entry["family"] = LEGACY_FAMILIES[self.entry["family"]]
        self._opened = True

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes the pipeline runs, its default first, as the entry stage reports them."""
        known = {m.value for m in Mode}
        return tuple(Mode(m) for m in self.entry.get("modes", ()) if m in known)

    async def close(self) -> None:
        self._opened = False
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
                    continue
                if frame.kind is FrameKind.ERROR and frame.code in (ErrorCode.UNAUTHORIZED, ErrorCode.OVERLOADED):
                    self._refusal = error_from_frame(frame)  # the stage hangs up next: fail every request with it
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
            async with self._reopen:  # the entry closed the connection (idle timeout, restart): open a fresh one
                if self.conn is None or self.conn.closed:
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
            self._futures.pop(frame.request_id, None)
            raise StageUnavailableError(
                f"request {frame.request_id} got no answer from the pipeline at {self.where} within {timeout:.1f}s; "
                "a stage may be down or overloaded: check each 'blocktrain serve' process"
            ) from None
        if reply.kind is FrameKind.ERROR:
            raise error_from_frame(reply)
        return reply

    async def ping(self) -> dict[str, Any]:
        return (await self.call(Frame(FrameKind.PING, self.new_id()))).params

    # --- modes ------------------------------------------------------------------------
    async def score(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Teacher-forced logits (b, t, 256) of bytes x (b, t): one traversal."""
        f = Frame(FrameKind.SUBMIT, self.new_id(), Mode.SCORE, params={"seed": seed}, tensors={"x": x.to(torch.uint8)})
        return (await self.call(f)).tensors["logits"]

    async def ar_logits(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """Logits (b, 256) of the byte after x (b, t): one traversal, B block steps."""
        f = Frame(FrameKind.SUBMIT, self.new_id(), Mode.AR, params={"seed": seed}, tensors={"x": x.to(torch.uint8)})
        return (await self.call(f)).tensors["logits"]

    async def sweep(
        self, prompt: bytes, n_new: int, *, sweeps: int = 1, temperature: float = 0.8, top_k: int = 40, seed: int = 0
    ) -> bytes:
        """A whole n_new-byte continuation from one traversal (per sweep)."""
        context = int(self.entry.get("context", 0)) or len(prompt) + n_new
        if n_new < 1 or n_new >= context:
            raise ServeError(f"sweep needs 1 <= bytes < context ({context}), got {n_new}")
        p = (prompt or b"\n")[-(context - n_new) :]
        params = {"seed": seed, "n_new": n_new, "prompt_len": len(p), "sweeps": sweeps,
                  "temperature": float(temperature), "top_k": int(top_k)}
        x = torch.tensor(list(p), dtype=torch.uint8).unsqueeze(0)
        f = Frame(FrameKind.SUBMIT, self.new_id(), Mode.SWEEP, params=params, tensors={"x": x})
        return bytes((await self.call(f)).tensors["bytes"][0].tolist())

    def iter_ar(
        self, prompt: bytes, n_new: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
        top_p: float = 1.0,
    ) -> AsyncIterator[bytes]:
        """One byte per traversal, yielded as it is sampled (KV-cached on stack and E2E pipelines).

        With top_p = 1 the bytes equal ``generate(local model, ...)`` at the same seed.
        """
        return iter_ar(self, prompt, n_new, temperature=temperature, top_k=top_k, seed=seed, top_p=top_p)

    async def generate_ar(
        self, prompt: bytes, n_new: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
        top_p: float = 1.0,
    ) -> bytes:
        """Same bytes as ``generate(assembled_model, ...)``: one traversal per byte."""
        return b"".join([b async for b in self.iter_ar(prompt, n_new, temperature=temperature, top_k=top_k, seed=seed,
                                                       top_p=top_p)])

    def iter_baseline(
        self, prompt: bytes, n_new: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
        top_p: float = 1.0,
    ) -> AsyncIterator[bytes]:
        """E2E baseline: prefill the prompt, then one token per traversal with a KV cache in every stage."""
        return iter_ar(self, prompt, n_new, temperature=temperature, top_k=top_k, seed=seed, top_p=top_p,
                       mode=Mode.BASELINE)

    async def generate_baseline(
        self, prompt: bytes, n_new: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
        top_p: float = 1.0,
    ) -> bytes:
        """E2E baseline: prefill the prompt, then one token per traversal with a KV cache in every stage."""
        return b"".join([b async for b in self.iter_baseline(prompt, n_new, temperature=temperature, top_k=top_k,
                                                             seed=seed, top_p=top_p)])

    def iter_spec(
        self, prompt: bytes, n_new: int, *, temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
        seed: int = 0, draft_min: int = 1, draft_max: int = 16,
    ) -> AsyncIterator[bytes]:
        """Speculative decoding: yields the bytes each traversal accepts (see serve.decoding)."""
        opts = SpecOptions(temperature, top_k, top_p, seed, draft_min, draft_max)
        return spec_steps(self, prompt, n_new, opts, SpecResult(b""))

    async def generate_spec(
        self, prompt: bytes, n_new: int, *, temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
        seed: int = 0, draft_min: int = 1, draft_max: int = 16,
    ) -> SpecResult:
        """Speculative decoding: n_new bytes drafted by the entry stage and verified one traversal per draft."""
        result = SpecResult(b"")
        opts = SpecOptions(temperature, top_k, top_p, seed, draft_min, draft_max)
        async for _ in spec_steps(self, prompt, n_new, opts, result):
            pass
        return result


async def generate_with(client: PipelineClient, mode: str, prompt: bytes, n: int, **kw: Any) -> bytes:
    """``n`` bytes after ``prompt`` in ``mode``; ``kw``: temperature, top_k, seed, top_p, and the settings the mode's
    rules (:data:`~blocktrain.serve.wire.modes.MODE_RULES`) let it take (sweeps; draft_min, draft_max); the others
    are ignored."""
    which = generation_mode(mode)
    rules = MODE_RULES[which]
    draft = {k: kw.pop(k) for k in ("draft_min", "draft_max") if k in kw}  # the CLI passes its defaults in any mode
    sweeps = int(kw.pop("sweeps", 1))
    top_p = float(kw.pop("top_p", 1.0))
    if top_p < 1 and not rules.top_p:
        raise ServeError(f"top_p < 1 is sampled by modes {modes_taking('top_p')}, not {mode}")
    if which is Mode.SWEEP:
        return await client.sweep(prompt, n, sweeps=sweeps, **kw)
    if which is Mode.SPEC:
        return (await client.generate_spec(prompt, n, **kw, **draft, top_p=top_p)).data
    if which is Mode.AR:
        return await client.generate_ar(prompt, n, **kw, top_p=top_p)
    return await client.generate_baseline(prompt, n, **kw, top_p=top_p)


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
