"""An OpenAI-style HTTP front door to a serving pipeline (``blocktrain gateway``): its routes.

Existing clients (the ``openai`` package, curl, anything that speaks vLLM's or llama.cpp's server) reach a
pipeline through ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain JSON, or
server-sent events ending with ``data: [DONE]`` when ``stream`` is true). A chat is sent to the model as a plain
transcript, one ``Role: content`` line per message and then ``Assistant:`` (:func:`.protocol.chat_prompt`);
the answer comes back as ``choices[0].message`` (or ``delta`` chunks). Tokens are bytes: ``max_tokens`` and the usage counts are in bytes.
The text is the continuation decoded as UTF-8 (invalid bytes replaced by U+FFFD); ``choices[0].raw_bytes`` holds
the exact bytes, base64-encoded. Extra request fields: ``mode`` (spec, the default; ar; sweep; baseline),
``top_k`` and ``sweeps``; without ``mode``, the pipeline's default (spec on a stack run, ar on diffusion blocks,
baseline on the E2E reference). Errors are ``{"error": {"message", "type", "param", "code"}}`` with a 4xx for a bad
request and a 5xx when the pipeline fails. Request bodies are capped in size, requests in time, and a bearer
token, when set, is compared in constant time.

The shapes are the models of :mod:`~blocktrain.serve.gateway.protocol` and :mod:`.responses` (each route declares its answer's; the
schema is ``make_app(...).openapi()``); a request goes from its route to :mod:`~blocktrain.serve.gateway.serving`
and back in one call. Every route runs behind :class:`GuardedRoute` (the token, then the body's limits); a body that
fails validation is answered by one handler, ``param`` naming the field at fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from blocktrain.protocol.guard import guarded_http
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.gateway.checks import RequestError, refusal
from blocktrain.serve.gateway.options import GatewayOptions
from blocktrain.serve.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from blocktrain.serve.gateway.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfo,
)
from blocktrain.serve.gateway.serving import Events, Gateway, detokenize

log = logging.getLogger(__name__)

TOKEN_ENV = "BLOCKTRAIN_GATEWAY_TOKEN"  # bearer token HTTP clients must send, when --token is not given
ROUTES = ("GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize and "
          "GET /tokenizer_info")
CHUNKS = (CompletionChunk, ChatCompletionChunk)  # the events of the streaming routes
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "a refused request; for a bad field, param names it"},
    "5XX": {"model": ErrorResponse, "description": "the pipeline failed (502), is unreachable (503) or too slow (504)"},
}
Answer = TypeVar("Answer", bound=BaseModel)


def streamed(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The answers of a route that streams ``chunk`` events when the request sets ``stream``."""
    name = chunk.__name__
    return {**ERRORS, 200: {"description": f"the answer; with stream, server-sent events, each a {name}, then "
                                           "data: [DONE]",
                            "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}}


DISCONNECT_POLL_S = 0.5  # seconds between looks for a whole answer's client having gone
CLIENT_GONE = 499  # the status logged for a request whose client left before its answer (nginx's)
SEND_GRACE_S = 10.0  # seconds a stream may wait on a slow reader beyond the request's own time limit


class BoundedStream(StreamingResponse):
    """Server-sent events that end within ``timeout_s`` however slowly the client reads: a stream waits on the
    client's socket at every event (the server's flow control), where the request's deadline, checked around the
    pipeline's answers, cannot reach, so a client that stops reading held its connection and its KV caches until
    they expired. Past the limit the stream is closed (its pipeline requests released) and the connection dropped."""

    def __init__(self, content: Events, timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.timeout_s = timeout_s  # seconds the whole stream may take, its writes included

    async def stream_response(self, send: Callable[[Any], Coroutine[Any, Any, None]]) -> None:  # type: ignore[override]
        limit = asyncio.timeout(self.timeout_s)
        try:
            async with limit:
                await super().stream_response(send)
        except TimeoutError:
            if not limit.expired():  # another timeout, raised inside: not this limit's to handle
                raise
            log.warning("a stream's client read too slowly: closed after %.0f s", self.timeout_s)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # the events themselves (an async iterator)


def http(answer: Answer | Events, timeout_s: float) -> Answer | Response:
    """A whole answer as itself (FastAPI writes it through the route's response model), a stream as SSE that ends
    within ``timeout_s`` (:class:`BoundedStream`)."""
    if isinstance(answer, BaseModel):
        return answer
    return BoundedStream(answer, timeout_s)


def error_response(exc: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(ErrorResponse.of(exc).model_dump(mode="json"), status_code=exc.status, headers=headers)


def authorize(request: Request, token: str) -> None:
    """401 unless the request carries ``Authorization: Bearer <token>`` (compared in constant time); any without one."""
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise RequestError(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>' with the "
                                "gateway's --token", "invalid_api_key")


class JsonRequest(Request):
    """A request whose body was read and parsed as JSON already (:func:`read_json`), labelled as JSON whatever
    content type the client named: FastAPI validates its body from here."""

    def __init__(self, request: Request, raw: bytes, parsed: Any) -> None:
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
        super().__init__({**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}, request.receive)
        self.raw = raw  # the body's bytes
        self.parsed = parsed  # the body, parsed

    async def body(self) -> bytes:
        return self.raw

    async def json(self) -> Any:
        return self.parsed


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 as soon as they (or the declared length) exceed ``limit``."""
    too_large = RequestError(413, f"the request body exceeds {limit} bytes; send a shorter prompt", "request_too_large")
    length = request.headers.get("content-length", "")
    if length and (not length.isdigit() or int(length) > limit):
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def read_json(request: Request, opts: GatewayOptions) -> JsonRequest:
    """The request with its body read within the size and time limits and parsed: 413, 408, or 400 (invalid_json)."""
    try:
        raw = await asyncio.wait_for(read_body(request, opts.max_body_bytes), opts.request_timeout_s)
    except TimeoutError:
        raise RequestError(408, "the request body did not arrive in time", "request_timeout") from None
    try:
        return JsonRequest(request, raw, json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc}); send a JSON object", "invalid_json") from exc
    except ValueError:  # an integer literal past Python's digit limit
        raise RequestError(400, "the request body holds a number too long to read; send ordinary numbers",
                           "invalid_json") from None
    except RecursionError:  # nesting deeper than the parser's recursion limit
        raise RequestError(400, "the request body is nested too deeply; send a flat JSON object", "invalid_json") from None


class GuardedRoute(APIRoute):
    """A gateway route: the bearer token checked first, then a POST body read within the gateway's limits and
    parsed as JSON, before FastAPI validates it against the route's request model."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            opts: GatewayOptions = request.app.state.options
            authorize(request, opts.token)
            if request.method != "POST":
                return await handle(request)
            return await until_gone(request, handle(await read_json(request, opts)))

        return guarded


def _retrieved(task: asyncio.Future[Response]) -> None:
    """Read a finished handler's exception (an unread one is logged as never retrieved)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a request handler ended with %r", task.exception())


async def until_gone(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """``work``'s response, or its cancellation once the HTTP client has gone (Starlette watches only for a streamed
    response's client: a whole answer went on generating, holding its pipeline slot and KV caches, up to the
    request's time limit); the client is looked for every DISCONNECT_POLL_S."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_retrieved)  # an outcome no one reads (the client gone, the server stopping) is not logged
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                log.info("%s %s: the client went away; its generation is cancelled", request.method, request.url.path)
                task.cancel()
                await asyncio.wait({task})  # its generation's finally blocks have run (RELEASEs sent)
                return Response(status_code=CLIENT_GONE)
        return task.result()
    finally:
        if not task.done():  # this request itself cancelled (the server stopping)
            task.cancel()


class GatewayApp(FastAPI):
    """The gateway's FastAPI app; its OpenAPI schema also lists the stream chunk models the routes name."""

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()  # built on the first call, then kept
        _, defs = models_json_schema([(m, "serialization") for m in CHUNKS], ref_template="#/components/schemas/{model}")
        schema["components"]["schemas"].update(defs["$defs"])
        return schema


def make_app(opts: GatewayOptions, client: PipelineClient | None = None) -> FastAPI:
    """The FastAPI app; ``client`` (unconnected) replaces the PipelineClient built from ``opts``."""
    gw = Gateway(opts, client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await gw.close()

    app = GatewayApp(title="BlockTrain gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = GuardedRoute
    app.state.options = opts

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(refusal(exc.errors()))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        msg = f"{request.method} {request.url.path}: {exc.detail}; this gateway serves {ROUTES}"
        return error_response(RequestError(exc.status_code, msg, code))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(RequestError(500, f"internal gateway error ({type(exc).__name__}); see the gateway's log",
                                           "internal_error"))

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models() -> ModelList:
        return await gw.models()

    @app.get("/v1/models/{name}", response_model=ModelCard, responses=ERRORS)
    async def get_model(name: str) -> ModelCard:
        return await gw.model(name)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=streamed(CompletionChunk))
    async def completions(req: CompletionRequest) -> CompletionResponse | Response:
        return http(await gw.complete(req), gw.opts.request_timeout_s + SEND_GRACE_S)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=streamed(ChatCompletionChunk))
    async def chat_completions(req: ChatCompletionRequest) -> ChatCompletionResponse | Response:
        return http(await gw.chat(req), gw.opts.request_timeout_s + SEND_GRACE_S)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await gw.tokenize(req)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize_route(req: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(req)

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS)
    async def tokenizer_info() -> TokenizerInfo:
        return await gw.tokenizer_info()

    return app


def run_gateway(opts: GatewayOptions, host: str, port: int) -> None:
    """Serve until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    import uvicorn

    if not opts.token and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the gateway on %s:%d accepts requests without a token; set --token or $%s", host, port, TOKEN_ENV)
    log.info("gateway on http://%s:%d/v1 in front of the pipeline at %s", host, port, opts.pipeline)
    uvicorn.run(make_app(opts), host=host, port=port, log_level="info", timeout_keep_alive=30,
                limit_concurrency=opts.max_connections, http=guarded_http())  # request heads bounded in time and bytes
