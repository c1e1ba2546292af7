"""An OpenAI-style HTTP front door to a serving pipeline (``blocktrain gateway``).

Existing clients (the ``openai`` package, curl, anything that speaks vLLM's or llama.cpp's server) reach a
pipeline through ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain JSON, or
server-sent events ending with ``data: [DONE]`` when ``stream`` is true). A chat is sent to the model as a plain
transcript, one ``Role: content`` line per message and then ``Assistant:`` (:func:`.gateway_backend.chat_prompt`);
the answer comes back as ``choices[0].message`` (or ``delta`` chunks). Tokens are bytes: ``max_tokens`` and the usage counts are in bytes.
The text is the continuation decoded as UTF-8 (invalid bytes replaced by U+FFFD); ``choices[0].raw_bytes`` holds
the exact bytes, base64-encoded. Extra request fields: ``mode`` (spec, the default; ar; sweep; baseline),
``top_k`` and ``sweeps``; without ``mode``, the pipeline's default (spec on a stack run, ar on diffusion blocks,
baseline on the E2E reference). Errors are ``{"error": {"message", "type", "param", "code"}}`` with a 4xx for a bad
request and a 5xx when the pipeline fails. Request bodies are capped in size, requests in time, and a bearer
token, when set, is compared in constant time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from blocktrain.errors import ServeError
from blocktrain.seeds import Seed
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.gateway.backend import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    VOCAB,
    CompletionRequest,
    PipelineBackend,
    RequestError,
    Utf8Stream,
    detokenize_body,
    parse_chat,
    parse_completion,
    tokenize_body,
    unavailable,
)
from blocktrain.serve.gateway.logprobs import Logprobs, StopScanner, chat_logprobs, token_str
from blocktrain.serve.gateway.options import GatewayOptions

log = logging.getLogger(__name__)

TOKEN_ENV = "BLOCKTRAIN_GATEWAY_TOKEN"  # bearer token HTTP clients must send, when --token is not given


def model_id(entry: dict[str, Any]) -> str:
    """A model id from the entry stage's description, e.g. ``blocktrain-n4-d32-ctx32``."""
    return f"{entry.get('family', 'pipeline')}-n{entry.get('n', 0)}-d{entry.get('d_model', 0)}-ctx{entry.get('context', 0)}"


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.status, str(exc), exc.reason, exc.param), status_code=exc.status, headers=headers)


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class Gateway:
    """Request handling, independent of the HTTP framework's routing."""

    def __init__(self, opts: GatewayOptions, client: PipelineClient | None = None) -> None:
        self.opts = opts
        self.backend = PipelineBackend(client or PipelineClient(opts.pipeline, timeout_s=opts.request_timeout_s,
                                                                token=opts.pipeline_token))
        self.created = int(time.time())

    def authorize(self, request: Request) -> None:
        if not self.opts.token:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.opts.token.encode()):
            raise RequestError(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>' with the "
                                    "gateway's --token", "invalid_api_key")

    async def read_json(self, request: Request) -> Any:
        limit = self.opts.max_body_bytes
        too_large = RequestError(413, f"the request body exceeds {limit} bytes; send a shorter prompt", "request_too_large")
        length = request.headers.get("content-length", "")
        if length and (not length.isdigit() or int(length) > limit):
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the request body is not valid JSON ({exc}); send a JSON object",
                               "invalid_json") from exc
        except ValueError:  # an integer literal past Python's digit limit
            raise RequestError(400, "the request body holds a number too long to read; send ordinary numbers",
                               "invalid_json") from None
        except RecursionError:  # nesting deeper than the parser's recursion limit
            raise RequestError(400, "the request body is nested too deeply; send a flat JSON object",
                               "invalid_json") from None

    async def entry(self) -> dict[str, Any]:
        try:
            return await self.backend.entry()
        except ServeError as exc:
            raise unavailable(exc) from exc

    async def models(self) -> dict[str, Any]:
        entry = await self.entry()
        card = {"id": self.opts.model_name or model_id(entry), "object": "model", "created": self.created,
                "owned_by": "blocktrain", "context_length": context(entry),
                "modes": [m.value for m in self.backend.modes(entry)]}
        return {"object": "list", "data": [card]}

    async def body(self, request: Request) -> Any:
        """The request's JSON body, read within the request's time limit."""
        try:
            return await asyncio.wait_for(self.read_json(request), self.opts.request_timeout_s)
        except TimeoutError:
            raise RequestError(408, "the request body did not arrive in time", "request_timeout") from None

    async def completion(self, request: Request, chat: bool = False) -> Response:
        """``/v1/completions``, or ``/v1/chat/completions`` with ``chat`` (the same generation, chat-shaped)."""
        body = await self.body(request)
        req = (parse_chat if chat else parse_completion)(body, self.opts.max_tokens_cap)
        entry = await self.entry()
        name = self.opts.model_name or model_id(entry)
        if req.model is not None and req.model != name:
            raise RequestError(404, f"the model {req.model!r} does not exist; this gateway serves {name!r} "
                                    "(GET /v1/models)", "model_not_found", "model")
        req = self.backend.resolve(req, entry)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": name}
        if req.stream:
            if chat:
                head["object"] = "chat.completion.chunk"
            return StreamingResponse(self.events(req, head, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            choices, stats, n_out = await asyncio.wait_for(self.choices(req, entry, chat), self.opts.request_timeout_s)
        except TimeoutError:
            raise RequestError(504, f"the pipeline did not finish within {self.opts.request_timeout_s:.0f}s; ask for "
                                    "fewer bytes or raise the gateway's --timeout", "timeout") from None
        except ServeError as exc:
            raise unavailable(exc) from exc
        return JSONResponse({**head, "choices": choices, "usage": usage(req, n_out),
                             "blocktrain": {"mode": mode_name(req), "seed": req.seed, **stats}})

    async def choices(self, req: CompletionRequest, entry: dict[str, Any], chat: bool
                      ) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
        """The ``n`` choices of a whole answer, the first choice's counters, and the bytes generated in all."""
        out: list[dict[str, Any]] = []
        stats: dict[str, Any] = {}
        n_out = 0
        for i in range(req.n):
            r = choice_request(req, i)
            data, counters, finish = await self.backend.complete(r)
            stats = stats or counters
            n_out += len(data)
            shown = req.prompt + data if req.echo else data
            text = shown.decode("utf-8", errors="replace")
            choice = new_choice(i, shown, finish, {"message": {"role": "assistant", "content": text}} if chat
                                else {"text": text})
            if req.logprobs is not None:  # the prompt's rows never depend on the generated bytes (prefix-stable)
                lp = await self.backend.log_probs(req.prompt + data, context(entry), r.seed)
                choice["logprobs"] = (chat_logprobs(req.prompt + data, lp, req.logprobs, skip=len(req.prompt)) if chat
                                      else Logprobs.of(req.prompt + data, lp, req.logprobs,
                                                       skip=0 if req.echo else len(req.prompt)).to_dict())
            out.append(choice)
        if req.n > 1:
            stats["seeds"] = [choice_request(req, i).seed for i in range(req.n)]
        return out, stats, n_out

    async def events(self, req: CompletionRequest, head: dict[str, Any], chat: bool = False) -> AsyncIterator[bytes]:
        """The completion as server-sent events: per choice, a chunk per piece of bytes and a last chunk; then usage
        and [DONE]. Chat chunks carry ``delta`` ({"role": "assistant"} first, then {"content": piece}) instead of
        ``text``. With ``n`` > 1 the choices stream one after another, each chunk naming its ``index``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.opts.request_timeout_s
        n_out = 0

        def chunk(i: int, piece: str, raw: bytes, finish: str | None, extra: dict[str, Any] | None = None) -> bytes:
            text = {"delta": {"content": piece} if piece or finish is None else {}} if chat else {"text": piece}
            return sse({**head, "choices": [new_choice(i, raw, finish, text)], **(extra or {})})

        try:
            for i in range(req.n):
                r = choice_request(req, i)
                text, scan, got = Utf8Stream(), StopScanner(r.stop), 0
                pieces = self.backend.pieces(r, scan)
                if chat:
                    yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
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
                finish = "stop" if scan.stopped or got < r.max_tokens else "length"
                yield chunk(i, text.finish(), b"", finish, {"blocktrain": {"mode": mode_name(r), "seed": r.seed}})
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(req, n_out)})
            yield sse("[DONE]")
        except TimeoutError:
            yield sse(error_body(504, f"the pipeline did not finish within {self.opts.request_timeout_s:.0f}s", "timeout"))
        except ServeError as exc:
            err = unavailable(exc)
            yield sse(error_body(err.status, str(err), err.reason))


def new_choice(i: int, raw: bytes, finish: str | None, text: dict[str, Any]) -> dict[str, Any]:
    """Choice ``i`` of an answer or chunk: its bytes (base64), finish reason and text (``text``, ``message`` or ``delta``)."""
    return {"index": i, "logprobs": None, "finish_reason": finish, "raw_bytes": base64.b64encode(raw).decode(), **text}


def context(entry: dict[str, Any]) -> int:
    return int(entry.get("context", 0))


def mode_name(req: CompletionRequest) -> str | None:
    return None if req.mode is None else req.mode.value


def choice_request(req: CompletionRequest, i: int) -> CompletionRequest:
    """The request of choice ``i``: choice 0 is the request itself, choice i > 0 samples with its own seed."""
    return req if i == 0 else replace(req, seed=Seed.GATEWAY_CHOICE.derive(req.seed, i))


def usage(req: CompletionRequest, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": n_out, "total_tokens": len(req.prompt) + n_out}


def make_app(opts: GatewayOptions, client: PipelineClient | None = None) -> FastAPI:
    """The FastAPI app; ``client`` (unconnected) replaces the PipelineClient built from ``opts``."""
    gw = Gateway(opts, client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await gw.backend.close()

    app = FastAPI(title="BlockTrain gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(gw.authorize)])
    app.state.gateway = gw

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        msg = (f"{request.method} {request.url.path}: {exc.detail}; this gateway serves GET /v1/models, "
               "POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize and "
               "GET /tokenizer_info")
        return JSONResponse(error_body(exc.status_code, msg, code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal gateway error ({type(exc).__name__}); see the gateway's log",
                                       "internal_error"), status_code=500)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return await gw.models()

    @app.get("/v1/models/{name}")
    async def get_model(name: str) -> dict[str, Any]:
        listed = (await gw.models())["data"][0]
        if name != listed["id"]:
            raise RequestError(404, f"the model {name!r} does not exist; this gateway serves {listed['id']!r}",
                               "model_not_found", "model")
        return dict(listed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gw.completion(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await gw.body(request)
        data = tokenize_body(body)
        entry = await gw.entry()
        strs = [token_str(b) for b in data] if isinstance(body, dict) and body.get("return_token_strs") else None
        return {"count": len(data), "max_model_len": context(entry), "tokens": list(data),
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return {"prompt": detokenize_body(await gw.body(request)).decode("utf-8", errors="replace")}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        entry = await gw.entry()
        return {"tokenizer_class": "ByteTokenizer", "vocab_size": VOCAB, "model_max_length": context(entry),
                "bos_token": BOS_TOKEN, "eos_token": None, "pad_token": None, "unk_token": None,
                "token_ids": "each byte of the UTF-8 text is one token, its id the byte's value (0-255)",
                "token_strs": "a byte below 0x80 is its character; any other byte is 'bytes:\\xNN'",
                "chat_template": CHAT_TEMPLATE}

    return app


def run_gateway(opts: GatewayOptions, host: str, port: int) -> None:
    """Serve until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    import uvicorn

    if not opts.token and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the gateway on %s:%d accepts requests without a token; set --token or $%s", host, port, TOKEN_ENV)
    log.info("gateway on http://%s:%d/v1 in front of the pipeline at %s", host, port, opts.pipeline)
    uvicorn.run(make_app(opts), host=host, port=port, log_level="info", timeout_keep_alive=30,
                limit_concurrency=opts.max_connections)
