"""Serving a validated request from the pipeline: its bytes, as a whole answer or as server-sent events.

The gateway's one path from a request model (:mod:`~blocktrain.serve.gateway.protocol`) to the pipeline and back.
:class:`Gateway` connects to the entry stage, checks the model's name and settles the request against the pipeline
(:class:`~blocktrain.serve.gateway.generation.Generation`); each choice's bytes come from the client's one mode
dispatcher (:meth:`~blocktrain.serve.client.pipeline.PipelineClient.decode`), stop
sequences cut (:class:`~blocktrain.serve.gateway.logprobs.StopScanner`). Bytes cross HTTP twice: as text (invalid
UTF-8 replaced, decoded incrementally so that a character split across chunks is kept whole: :class:`Utf8Stream`)
and raw, base64-encoded, in ``raw_bytes``. A pipeline failure is a 502, an unreachable pipeline a 503, and a request
past the gateway's time limit a 504 (in a stream: its last event).
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from blocktrain.errors import ServeError, StageUnavailableError
from blocktrain.sampling import EMPTY_PROMPT
from blocktrain.serve.client.decoding import SpecResult, runnable_modes
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.client.stage_info import StageInfo
from blocktrain.serve.gateway.checks import RequestError
from blocktrain.serve.gateway.generation import Generation, max_tokens_of
from blocktrain.serve.gateway.logprobs import (
    StopScanner,
    byte_log_probs,
    chat_logprobs,
    completion_logprobs,
    token_str,
    windows_per_call,
)
from blocktrain.serve.gateway.options import GatewayOptions
from blocktrain.serve.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from blocktrain.serve.gateway.responses import (
    AssistantMessage,
    BlocktrainInfo,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    Delta,
    DetokenizeResponse,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfo,
)
from blocktrain.serve.wire.frames import Mode

Events = AsyncIterator[bytes]  # server-sent events: ``data: <json>`` each
Choice = TypeVar("Choice", bound=BaseModel)  # CompletionChoice or ChatChoice
Whole = TypeVar("Whole", bound=BaseModel)  # CompletionResponse or ChatCompletionResponse
Rows = Callable[[bytes], Awaitable[torch.Tensor]]  # log-probs (n, 256) of the history and a choice's bytes
Shape = Callable[[Generation, int, bytes, FinishReason, Rows], Awaitable[Choice]]  # a choice from its bytes


class Utf8Stream:
    """Bytes in chunks -> text: invalid bytes become U+FFFD, a character split across chunks is kept whole."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, chunk: bytes) -> str:
        return str(self._decoder.decode(chunk, final=False))

    def finish(self) -> str:
        """The text of bytes still held back (an incomplete character at the end becomes U+FFFD)."""
        return str(self._decoder.decode(b"", final=True))


def unavailable(exc: Exception) -> RequestError:
    """A pipeline failure as the 5xx the HTTP client sees."""
    if isinstance(exc, StageUnavailableError):
        return RequestError(503, f"the pipeline is unavailable: {exc}", "pipeline_unavailable")
    return RequestError(502, f"the pipeline failed this request: {exc}", "pipeline_error")


def sse(event: BaseModel) -> bytes:
    """One server-sent event carrying ``event`` as JSON."""
    return f"data: {json.dumps(event.model_dump(mode='json'))}\n\n".encode()


def b64(data: bytes) -> str:
    """``raw_bytes``: bytes as base64 text."""
    return base64.b64encode(data).decode()


def finish_reason(g: Generation, scan: StopScanner, got: int) -> FinishReason:
    """Why a choice of ``got`` bytes ended: a stop sequence (or the pipeline) ended it early, or max_tokens."""
    return "stop" if scan.stopped or got < g.max_tokens else "length"


def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
    """``POST /detokenize``: the tokens' bytes as text (invalid UTF-8 replaced)."""
    return DetokenizeResponse(prompt=req.tokens.decode("utf-8", errors="replace"))


class Gateway:
    """Answers validated requests from one pipeline, through a client connected on first use (and reopened by the
    client when the entry stage drops it)."""

    def __init__(self, opts: GatewayOptions, client: PipelineClient | None = None) -> None:
        self.opts = opts
        self.client = client or PipelineClient(opts.pipeline, timeout_s=opts.request_timeout_s, token=opts.pipeline_token)
        self.created = int(time.time())  # unix seconds: the model card's ``created``
        self._connected = False
        self._lock = asyncio.Lock()
        # scored requests at once: each holds its text's (bytes, 256) float32 rows, 1 KiB a byte (64 MiB for the most
        # one may ask, MAX_SCORED_BYTES, and as much again for a second choice's), where 256 connections could hold
        # 16 GiB and more
        self._scoring = asyncio.Semaphore(opts.max_scoring)

    async def stage(self) -> StageInfo:
        """The entry stage's description, connecting first if needed (a 503 or 502 when that fails; requests that
        waited for a connect that failed share its failure: :meth:`PipelineClient.failed_since`)."""
        try:
            if not self._connected:
                seen = self.client.connects
                async with self._lock:
                    if not self._connected:
                        failed = self.client.failed_since(seen)
                        if failed is not None:
                            raise failed
                        await self.client.connect()
                        self._connected = True
            return self.client.stage
        except ServeError as exc:
            raise unavailable(exc) from exc

    async def close(self) -> None:
        """Close the pipeline connection (when the app shuts down)."""
        if self._connected:
            await self.client.close()
            self._connected = False

    def model_id(self, stage: StageInfo) -> str:
        """The served model's name: ``--model-name``, else one from the stage's description, e.g. diffusion-n4-d32-ctx32."""
        return self.opts.model_name or f"{stage.family}-n{stage.n}-d{stage.d_model}-ctx{stage.context}"

    async def models(self) -> ModelList:
        """``GET /v1/models``: the one model, its context and the modes the pipeline runs (its default first)."""
        stage = await self.stage()
        return ModelList(data=[ModelCard(id=self.model_id(stage), created=self.created, context_length=stage.context,
                                         modes=[m.value for m in runnable_modes(stage)])])

    async def model(self, name: str) -> ModelCard:
        """``GET /v1/models/{name}``: the model's card, 404 for any other name."""
        card = (await self.models()).data[0]
        if name != card.id:
            raise RequestError(404, f"the model {name!r} does not exist; this gateway serves {card.id!r}",
                               "model_not_found", "model")
        return card

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize``: the text's bytes as tokens, and the model's window."""
        data = req.data
        context = (await self.stage()).context
        return TokenizeResponse(count=len(data), max_model_len=context, tokens=list(data),
                                token_strs=[token_str(b) for b in data] if req.return_token_strs else None)

    async def tokenizer_info(self) -> TokenizerInfo:
        """``GET /tokenizer_info``: bytes as tokens, and the model's window."""
        return TokenizerInfo(model_max_length=(await self.stage()).context)

    async def complete(self, req: CompletionRequest) -> CompletionResponse | Events:
        """``/v1/completions``: the whole answer, or its events when the request streams."""
        return await self.answer(req, self.completion_choice, CompletionResponse)

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | Events:
        """``/v1/chat/completions``: the same generation as ``complete``, chat-shaped."""
        return await self.answer(req, self.chat_choice, ChatCompletionResponse)

    async def answer(self, req: CompletionRequest | ChatCompletionRequest, shape: Shape[Choice],
                     kind: type[Whole]) -> Whole | Events:
        """A whole answer of type ``kind`` (its choices shaped by ``shape``), or its events when the request streams."""
        g, stage, head = await self.settle(req)
        if g.stream:
            return self.events(g, head)
        choices, info, n_out = await self.whole(g, stage, shape)
        return kind(**head, choices=choices, usage=g.usage(n_out), blocktrain=info)

    async def settle(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[Generation, StageInfo, dict[str, Any]]:
        """The request as the pipeline serves it, the pipeline's description, and the answer's id, time and model."""
        max_tokens = max_tokens_of(req, self.opts.max_tokens_cap)
        stage = await self.stage()
        name = self.model_id(stage)
        if req.model is not None and req.model != name:
            raise RequestError(404, f"the model {req.model!r} does not exist; this gateway serves {name!r} "
                                    "(GET /v1/models)", "model_not_found", "model")
        g = Generation.of(req, max_tokens, stage)
        head = {"id": f"{'chatcmpl' if g.chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        return g, stage, head

    def too_slow(self) -> RequestError:
        """The 504 of a request past the gateway's time limit."""
        return RequestError(504, f"the pipeline did not finish within {self.opts.request_timeout_s:.0f}s; ask for fewer "
                                 "bytes or raise the gateway's --timeout", "timeout")

    async def whole(self, g: Generation, stage: StageInfo,
                    shape: Shape[Choice]) -> tuple[list[Choice], BlocktrainInfo, int]:
        """The ``n`` choices of a whole answer (each shaped by ``shape``), its ``blocktrain`` info, and the bytes
        generated in all; within the gateway's time limit."""
        async def run() -> tuple[list[Choice], BlocktrainInfo, int]:
            choices: list[Choice] = []
            counters: dict[str, int] = {}
            n_out = 0
            rows = self.rows(g, stage)
            for i in range(g.n):
                c = g.choice(i)
                data, counted, finish = await self.one(c)
                counters = counters or counted
                n_out += len(data)
                choices.append(await shape(c, i, data, finish, rows))
            seeds = [g.choice(i).sampling.seed for i in range(g.n)] if g.n > 1 else None
            return choices, BlocktrainInfo(mode=g.mode.value, seed=g.sampling.seed, **counters, seeds=seeds), n_out

        async def scoring() -> tuple[list[Choice], BlocktrainInfo, int]:
            if g.logprobs is None:
                return await run()
            async with self._scoring:
                return await run()

        try:
            return await asyncio.wait_for(scoring(), self.opts.request_timeout_s)
        except TimeoutError:
            raise self.too_slow() from None
        except ServeError as exc:
            raise unavailable(exc) from exc

    async def one(self, g: Generation) -> tuple[bytes, dict[str, int], FinishReason]:
        """One choice: its bytes, cut before a stop sequence; spec's counters (of a generation no stop sequence cuts
        short); why it finished."""
        if g.max_tokens == 0:
            return b"", {}, "length"
        stats, scan, out = SpecResult(b""), StopScanner(g.stop), bytearray()
        async for piece in self.pieces(g, scan, stats):
            out += piece
        counters = {"traversals": stats.traversals, "drafted": stats.drafted, "accepted": stats.accepted}
        return bytes(out), counters if g.mode is Mode.SPEC and not g.stop else {}, finish_reason(g, scan, len(out))

    async def pieces(self, g: Generation, scan: StopScanner, stats: SpecResult | None = None) -> AsyncIterator[bytes]:
        """The choice's bytes in chunks as the pipeline produces them, stop sequences cut (``scan.stopped`` tells
        whether one was met); spec counts its traversals in ``stats``."""
        chunks = self.client.decode(g.mode, g.prompt, g.max_tokens, g.sampling, stats)
        try:
            async for chunk in chunks:
                piece = scan.feed(chunk)
                if piece:
                    yield piece
                if scan.stopped:
                    return
            tail = scan.finish()
            if tail:
                yield tail
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def completion_choice(self, g: Generation, i: int, data: bytes, finish: FinishReason, scored: Rows
                                ) -> CompletionChoice:
        shown = g.prompt + data if g.echo else data
        logprobs = None
        if g.logprobs is not None:  # the prompt's rows never depend on the generated bytes (prefix-stable)
            history = g.prompt or EMPTY_PROMPT  # what the bytes were generated after (shown only if it is the prompt)
            rows = await scored(history + data)
            skip = len(history) - len(g.prompt) if g.echo else len(history)
            logprobs = await asyncio.to_thread(completion_logprobs, history + data, rows, g.logprobs, skip)  # off the loop
        return CompletionChoice(index=i, finish_reason=finish, raw_bytes=b64(shown), logprobs=logprobs,
                                text=shown.decode("utf-8", errors="replace"))

    async def chat_choice(self, g: Generation, i: int, data: bytes, finish: FinishReason, scored: Rows) -> ChatChoice:
        logprobs = None
        if g.logprobs is not None:
            history = g.prompt or EMPTY_PROMPT  # what the bytes were generated after
            rows = await scored(history + data)
            logprobs = await asyncio.to_thread(chat_logprobs, history + data, rows, g.logprobs, len(history))
        return ChatChoice(index=i, finish_reason=finish, raw_bytes=b64(data), logprobs=logprobs,
                          message=AssistantMessage(content=data.decode("utf-8", errors="replace")))

    async def log_probs(self, data: bytes, stage: StageInfo, seed: int, known: torch.Tensor | None = None,
                        wanted: int = 0) -> Any:
        """Log-probs (len(data), 256) of each byte of ``data`` given the bytes before it (row 0: NaN); ``known``: its
        first rows, scored before; ``wanted``: the first row read (those before it are NaN, unscored)."""
        per_call = windows_per_call(stage.context, stage.d_model, stage.frame_cap(self.client.max_frame_bytes))
        return await byte_log_probs(data, stage.context, lambda x: self.client.score(x, seed=seed), per_call, known,
                                    wanted)

    def rows(self, g: Generation, stage: StageInfo) -> Rows:
        """The log-probs of the history and each choice's bytes, for the choices of ``g`` one after another: the
        history's rows depend on it alone (prefix-stable), so they are scored once, with the first choice."""
        history = g.prompt or EMPTY_PROMPT
        known: list[torch.Tensor] = []
        wanted = 0 if g.echo and not g.chat else len(history)  # without echo, only the continuation's rows are listed

        async def scored(text: bytes) -> torch.Tensor:
            out = await self.log_probs(text, stage, g.score_seed, known[0] if known else None, wanted)
            if not known:
                known.append(out[: len(history)].clone())  # its own storage: a view held the whole first text's rows
            return out
        return scored

    async def events(self, g: Generation, head: dict[str, Any]) -> Events:
        """The answer as server-sent events: per choice, a chunk per piece of bytes and a last chunk (with
        ``blocktrain``); then usage (with ``include_usage``) and [DONE]. Chat chunks carry ``delta``
        ({"role": "assistant"} first, then {"content": piece}) instead of ``text``. With ``n`` > 1 the choices stream
        one after another, each chunk naming its ``index``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.opts.request_timeout_s
        n_out = 0

        def chunk(i: int, piece: str, raw: bytes, finish: FinishReason | None, info: BlocktrainInfo | None = None) -> bytes:
            if g.chat:
                delta = Delta(content=piece) if piece or finish is None else Delta()
                choice = ChatChunkChoice(index=i, finish_reason=finish, raw_bytes=b64(raw), delta=delta)
                return sse(ChatCompletionChunk(**head, choices=[choice], blocktrain=info))
            return sse(CompletionChunk(**head, choices=[CompletionChoice(index=i, finish_reason=finish, raw_bytes=b64(raw),
                                                                         text=piece)], blocktrain=info))

        try:
            for i in range(g.n):
                c = g.choice(i)
                text, scan, got = Utf8Stream(), StopScanner(c.stop), 0
                if g.chat:
                    role = ChatChunkChoice(index=i, finish_reason=None, delta=Delta(role="assistant", content=""))
                    yield sse(ChatCompletionChunk(**head, choices=[role]))
                pieces = self.pieces(c, scan)
                try:
                    while True:
                        try:
                            data = await asyncio.wait_for(anext(pieces), max(deadline - loop.time(), 0.0))
                        except StopAsyncIteration:
                            break
                        got += len(data)
                        yield chunk(i, text.feed(data), data, None)
                finally:
                    with contextlib.suppress(Exception):
                        await pieces.aclose()  # type: ignore[attr-defined]
                n_out += got
                yield chunk(i, text.finish(), b"", finish_reason(c, scan, got),
                            BlocktrainInfo(mode=c.mode.value, seed=c.sampling.seed))
            if g.include_usage:
                yield sse((ChatCompletionChunk if g.chat else CompletionChunk)(**head, choices=[], usage=g.usage(n_out)))
            yield b"data: [DONE]\n\n"
        except TimeoutError:
            yield sse(ErrorResponse.of(self.too_slow()))
        except ServeError as exc:
            yield sse(ErrorResponse.of(unavailable(exc)))
