"""HTTP layer of the coordinator (FastAPI on uvicorn).

Routes (all JSON unless noted; worker routes need ``Authorization: Bearer``):

    GET  /                           dashboard (HTML)
    GET  /v1/status                  status document
    GET  /metrics                    Prometheus text
    POST /v1/register                {"block": K|null, "dataset": fingerprint, "p2p_key": RSA key|null} ->
                                     assignment and config (409 "dataset" when the worker's data is not the
                                     run's); with p2p_key, "p2p": its token and the DHT to join (--hivemind)
    POST /v1/heartbeat               renew the lease
    POST /v1/p2p/token               a new DHT token for the key the worker registered with (--hivemind)
    POST /v1/leave                   give the lease back (clean shutdown)
    GET  /v1/work                    block, version, data stream, deadline
    GET  /v1/blocks/{k}/weights      safetensors: the current weights of block k
    GET  /v1/blocks/{k}/steps/{v}    safetensors: the encoded step from version v to v+1 (deflated on the
                                     wire when the client accepts it)
    GET  /v1/blocks/{k}/moments/{v}  safetensors: the inner moments published with version v (shared moments)
    GET  /v1/blocks/{k}/frozen       safetensors: the final weights of finished block k (409 before),
                                     the frozen input of later stack blocks; headers X-Block-Version, X-Weights-Sha
    POST /v1/blocks/{k}/updates      safetensors body: a delta against the current version (may be sent
                                     with Content-Encoding: deflate; inflated under the body cap)

Every byte of request and response bodies is counted as it crosses the wire, per worker and in total.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from blocktrain.coordinator.dashboard import DASHBOARD_HTML
from blocktrain.coordinator.inflight import UPLOAD_STALL_S, InFlight
from blocktrain.coordinator.polls import Generation, Snapshot
from blocktrain.coordinator.service import Coordinator
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.guard import guarded_http
from blocktrain.protocol.messages import (
    PROTOCOL_VERSION,
    AuditAnswer,
    ErrorBody,
    Heartbeat,
    Left,
    P2PToken,
    PushAnswer,
    RegisterRequest,
    Registration,
    WorkAnswer,
)
from blocktrain.protocol.status import Status
from blocktrain.protocol.transport import DEFLATE, accepts_deflate, decode_body, deflate

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SAFETENSORS = "application/octet-stream"
BINARY_BODY = {"requestBody": {"required": True, "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}}}}


def _bearer(header: str) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (None for another scheme or no token)."""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


SMALL_BODY_CAP = 64 * 1024  # bytes: cap on request bodies of every route but update uploads


def _uploads(path: str) -> bool:
    """Routes whose bodies are tensors: update pushes and audit uploads (capped by the coordinator, not SMALL_BODY_CAP)."""
    return path.endswith("/updates") or (path.startswith("/v1/blocks/") and "/audits/" in path)


READ_ONLY = frozenset({"/", "/v1/status", "/metrics"})  # routes that change nothing a status says (but their bytes)


def route_kind(path: str) -> str:
    """What a request moved, for the byte counters: "updates" (deltas and audited states in), "weights" (weights,
    steps and frozen blocks out) or "control" (registration, work, heartbeats, status)."""
    if _uploads(path):
        return "updates"
    return "weights" if path.startswith("/v1/blocks/") else "control"


class ByteCounter:
    """ASGI middleware: count request/response body bytes, attributed to the token's worker; when a worker's request
    (a valid token as it began) on a route that may change the coordinator's state (any but :data:`READ_ONLY`) has
    finished, bump ``generation``, so the status snapshots made before it are made again. A stranger's requests change
    only counters a snapshot shows a tick later: they never remake one."""

    def __init__(self, app: ASGIApp, coordinator: Coordinator, generation: Generation) -> None:
        self.app = app
        self.c = coordinator
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        n = [0, 0]
        headers = dict(scope.get("headers", []))
        token = _bearer(headers.get(b"authorization", b"").decode("latin-1"))
        worker = None if token is None else self.c.worker_for_token(token)
        # Only update and audit uploads may be large; every other body (register, heartbeat, ...) is small JSON.
        capped = not _uploads(scope.get("path", ""))
        length = headers.get(b"content-length", b"")
        if capped and length.isdigit() and int(length) > SMALL_BODY_CAP:
            await JSONResponse(
                {"error": "too_large",
                 "detail": f"body of {int(length)} bytes exceeds the cap of {SMALL_BODY_CAP} bytes for this route"},
                status_code=413,
            )(scope, receive, send)
            return

        deadline = asyncio.get_running_loop().time() + self.c.settings.head_timeout_s
        body_done = [False]  # the last body message arrived: later receives only wait for a disconnect

        async def recv() -> Message:
            if not capped or body_done[0]:
                msg = await receive()
            else:  # a small JSON body arrives within head_timeout_s, as its head did, or the request is cut
                try:
                    async with asyncio.timeout_at(deadline):
                        msg = await receive()
                except TimeoutError:
                    return {"type": "http.disconnect"}
            if msg["type"] == "http.request":
                body_done[0] = not msg.get("more_body", False)
                n[0] += len(msg.get("body", b""))
                if capped and n[0] > SMALL_BODY_CAP:  # chunked body without a length: stop reading it
                    return {"type": "http.disconnect"}
            return msg

        async def snd(msg: Message) -> None:
            if msg["type"] == "http.response.body":
                n[1] += len(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, recv, snd)
        finally:
            path = scope.get("path", "")
            self.c.count_bytes(worker, n[0], n[1], route_kind(path))
            if worker is not None and path not in READ_ONLY:  # after its bytes are counted
                self.generation.bump()


async def _read_capped(request: Request, cap: int, timeout_s: float, stall_s: float | None = None) -> bytes:
    """The request body: at most ``cap`` bytes (413), arrived within ``timeout_s`` seconds, with no pause longer than
    ``stall_s`` (default UPLOAD_STALL_S; 408: a connection whose path died holds nothing for long, its worker's upload
    slot included)."""
    stall_s = UPLOAD_STALL_S if stall_s is None else stall_s
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ProtocolError(413, f"body of {declared} bytes exceeds the cap of {cap} bytes", Reason.TOO_LARGE)
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    async with asyncio.timeout(stall_s):
                        chunk = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise ProtocolError(408, f"no byte of the body came for {stall_s:g} s after {size} bytes; push it "
                                        "again", Reason.SLOW) from None
                size += len(chunk)
                if size > cap:
                    raise ProtocolError(413, f"body exceeds the cap of {cap} bytes", Reason.TOO_LARGE)
                chunks.append(chunk)
    except TimeoutError:
        raise ProtocolError(
            408, f"{size} bytes of the body arrived in {timeout_s:g} s, the coordinator's upload_timeout_s; push it "
            "again over a faster link, or ask the operator for a longer --upload-timeout-s", Reason.SLOW,
        ) from None
    except ClientDisconnect:
        # The client went away mid-body (a worker that lost its network): an ordinary aborted upload.
        raise ProtocolError(
            400, f"the client closed the connection after {size} bytes of the update body; push it again", Reason.ABORTED
        ) from None
    return b"".join(chunks)


def _background(c: Coordinator, stop: threading.Event) -> list[threading.Thread]:
    def every_tick(job: Callable[[], object], what: str) -> Callable[[], None]:
        def loop() -> None:
            while not stop.wait(c.settings.tick_seconds):
                try:
                    job()
                except Exception:  # keep the service alive; the error is logged with its traceback
                    log.exception("%s failed", what)

        return loop

    threads = [threading.Thread(target=every_tick(c.tick, "tick"), name="tick", daemon=True),
               threading.Thread(target=every_tick(lambda: c.maybe_evaluate(force=c.finished()), "evaluation"),
                                name="eval", daemon=True)]
    for t in threads:
        t.start()
    return threads


def create_app(c: Coordinator, *, background: bool = True) -> FastAPI:
    """The ASGI app; ``background=False`` leaves ticking to the caller (tests)."""
    deflated: dict[tuple[int, int], bytes] = {}  # (block, from version) -> the deflated step, the newest few
    replays = asyncio.Semaphore(c.settings.audit_replays)  # audit uploads waiting for a replay wait here, holding no
    # thread of the pool that every other route runs in (waiting in it, 40 uploads held all of its threads)
    jobs: set[asyncio.Future[AuditAnswer]] = set()  # audit replays under way (held: a task is weakly referenced)
    uploading = InFlight()  # each worker's pushes and audit uploads in flight, a few of each

    async def replayed(name: str, k: int, v: int, body: bytes) -> AuditAnswer:
        """Take the audit (a resend is 404 from here, before its body is read), wait for a replay slot, replay and
        decide it."""
        case = await run_in_threadpool(c.take_audit, name, k, v)
        async with replays:
            return await run_in_threadpool(c.replay_audit, case, body)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        threads = _background(c, stop) if background else []
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
            c.flush_bytes()

    errors: dict[int | str, dict[str, Any]] = {"4XX": {"model": ErrorBody, "description": "a refusal: its reason and what to do"}}
    app = FastAPI(title="BlockTrain coordinator", version="1", lifespan=lifespan, responses=errors)
    generation = Generation()
    status = Snapshot(c.status, generation, c.settings.tick_seconds)
    metrics_text = Snapshot(c.metrics, generation, c.settings.tick_seconds)
    app.add_middleware(ByteCounter, coordinator=c, generation=generation)  # type: ignore[arg-type]

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(ErrorBody(error=exc.reason, detail=str(exc)).model_dump(), status_code=exc.status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A request its route's model refused: the token checked first, as every route checks it before reading the
        body (FastAPI parses the body before the handler runs), then answered as every refusal is, an ErrorBody."""
        try:
            await auth(request)
        except ProtocolError as refused:
            return await protocol_error(request, refused)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return await protocol_error(request, ProtocolError(
            422, f"the request's {where} is invalid ({first.get('msg', 'unreadable')}); send what this coordinator's "
            f"/docs lists for {request.url.path}", Reason.METADATA))

    async def auth(request: Request) -> str:
        """The worker a request's token names: from the cache on the event loop, else (an unknown or revoked token,
        which may re-read the token table) in a thread, so a stranger's request never stalls the loop."""
        token = _bearer(request.headers.get("authorization", ""))
        name = c.worker_for_token(token) if token else None
        return name if name is not None else await run_in_threadpool(c.authenticate, token)

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/v1/status", response_model=Status)
    async def get_status() -> Status:
        return await run_in_threadpool(status.get)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = await run_in_threadpool(metrics_text.get)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/register", response_model=Registration, response_model_exclude_none=True)
    async def register(request: Request, body: RegisterRequest) -> Registration:
        name = await auth(request)
        if body.protocol != PROTOCOL_VERSION:
            raise ProtocolError(426, f"this worker speaks protocol {body.protocol}, the coordinator {PROTOCOL_VERSION}; run the "
                                "same BlockTrain version on both sides", Reason.PROTOCOL)
        return await run_in_threadpool(c.register, name, body.block, body.dataset, body.p2p_key)

    @app.post("/v1/p2p/token", response_model=P2PToken)
    async def p2p_token(request: Request) -> P2PToken:
        return await run_in_threadpool(c.renew_p2p, await auth(request))

    @app.post("/v1/heartbeat", response_model=Heartbeat)
    async def heartbeat(request: Request) -> Heartbeat:
        return await run_in_threadpool(c.heartbeat, await auth(request))

    @app.post("/v1/leave", response_model=Left)
    async def leave(request: Request) -> Left:
        return await run_in_threadpool(c.leave, await auth(request))

    @app.get("/v1/work", response_model=WorkAnswer)
    async def work(request: Request) -> WorkAnswer:
        return await run_in_threadpool(c.work, await auth(request))

    @app.get("/v1/blocks/{k}/weights", response_class=Response,
             responses={200: {"content": {SAFETENSORS: {}}, "description": "safetensors weights"}})
    async def weights(request: Request, k: int) -> Response:
        await auth(request)
        v, payload = await run_in_threadpool(c.weights_bytes, k)
        return Response(payload, media_type=SAFETENSORS, headers={"X-Block-Version": str(v)})

    @app.get("/v1/blocks/{k}/steps/{v}", response_class=Response,
             responses={200: {"content": {SAFETENSORS: {}}, "description": "safetensors step v -> v+1 (int8 by default)"}})
    async def step(request: Request, k: int, v: int) -> Response:
        await auth(request)
        payload = await run_in_threadpool(c.step_bytes, k, v)
        if not accepts_deflate(request.headers.get("accept-encoding")):
            return Response(payload, media_type=SAFETENSORS)
        key = (k, v)
        body = deflated.get(key)
        if body is None:  # every replica of the block pulls the same step: deflate it once
            body = await run_in_threadpool(deflate, payload)
            deflated[key] = body
            while len(deflated) > 4 * c.n_blocks:
                deflated.pop(next(iter(deflated)))
        return Response(body, media_type=SAFETENSORS, headers={"Content-Encoding": DEFLATE})

    @app.get("/v1/blocks/{k}/moments/{v}", response_class=Response,
             responses={200: {"content": {SAFETENSORS: {}}, "description": "safetensors: the inner moments of version v"}})
    async def moments(request: Request, k: int, v: int) -> Response:
        await auth(request)
        payload = await run_in_threadpool(c.moments_bytes, k, v)
        return Response(payload, media_type=SAFETENSORS)

    @app.get("/v1/blocks/{k}/frozen", response_class=Response,
             responses={200: {"content": {SAFETENSORS: {}}, "description": "safetensors: finished block k"}})
    async def frozen(request: Request, k: int) -> Response:
        await auth(request)
        v, sha, payload = await run_in_threadpool(c.frozen_bytes, k)
        return Response(payload, media_type=SAFETENSORS, headers={"X-Block-Version": str(v), "X-Weights-Sha": sha})

    @app.post("/v1/blocks/{k}/updates", status_code=202, openapi_extra=BINARY_BODY, response_model=PushAnswer)
    async def update(request: Request, k: int) -> PushAnswer:
        try:
            name = await auth(request)
        except ProtocolError as exc:  # no valid token: counted in memory only, no lock, nothing written
            c.record_rejection(None, k, exc)
            raise
        with uploading.one(name, "update"):  # 503 past its few in flight, before anything is read or locked
            try:
                await run_in_threadpool(c.admit, name, k)  # quarantined, over its refusal rate: refused before its body
                body = await run_in_threadpool(  # is read
                    decode_body, await _read_capped(request, c.max_body_bytes, c.settings.upload_timeout_s),
                    request.headers.get("content-encoding"), c.max_body_bytes)
            except ProtocolError as exc:
                await run_in_threadpool(c.record_rejection, name, k, exc)
                raise
            return await run_in_threadpool(c.submit, name, k, body)

    @app.post("/v1/blocks/{k}/audits/{v}", openapi_extra=BINARY_BODY, response_model=AuditAnswer)
    async def audit(request: Request, k: int, v: int) -> AuditAnswer:
        """An audited worker's inner state at the start of round (k, v); the coordinator replays the round."""
        name = await auth(request)
        with uploading.one(name, "audit"):  # 503 past its few being read (each buffers up to 4x the block)
            body = await audit_body(request, name, k, v)
        job = asyncio.ensure_future(replayed(name, k, v, body))  # runs to its decision even if this request is
        jobs.add(job)  # cancelled: a case taken and never decided would hold its round for good
        job.add_done_callback(jobs.discard)
        job.add_done_callback(lambda j: j.cancelled() or j.exception())  # read, if its request has gone: not logged
        return await asyncio.shield(job)

    async def audit_body(request: Request, name: str, k: int, v: int) -> bytes:
        """The audit upload's body, read within its window and decoded."""
        # a stranger's upload is refused before its body is read; ``left``: seconds the audit's upload window has left
        upload, left = await run_in_threadpool(c.expect_audit, name, k, v)
        cap = 4 * c.block_fp32_bytes + 65536  # AdamW moments and the residual: three times the block, and names
        try:  # while its body arrives (within the window), the audit's deadline does not quarantine its worker
            read_s = max(1e-3, min(c.settings.upload_timeout_s, left))
            raw = await _read_capped(request, cap, read_s)
            c.audit_upload_received(name, k, v, upload)  # whole, in its window: decoding and the lock's wait are not late
            return await run_in_threadpool(decode_body, raw, request.headers.get("content-encoding"), cap)
        except BaseException:  # cut, late or malformed before its replay took it (no await here: cancelled)
            c.audit_upload_cut(name, k, v, upload)
            raise

    return app


def server_config(c: Coordinator, host: str, port: int, cert: str | None = None, key: str | None = None,
                  background: bool = True, **uvicorn_options: Any) -> Any:
    """The ``uvicorn.Config`` that serves ``c``: its app, and bounds on connections and on request heads
    (:mod:`blocktrain.protocol.guard`)."""
    import uvicorn

    options: dict[str, Any] = {"log_level": "warning", "timeout_keep_alive": 30,
                               "limit_concurrency": c.settings.max_connections, **uvicorn_options}
    return uvicorn.Config(create_app(c, background=background), host=host, port=port, ssl_certfile=cert,
                          ssl_keyfile=key, http=guarded_http(c.settings.head_timeout_s, drain_s=6 * c.settings.head_timeout_s),
                          **options)


async def serve_forever(c: Coordinator, host: str, port: int, cert: str | None, key: str | None) -> None:
    import uvicorn

    server = uvicorn.Server(server_config(c, host, port, cert, key))
    log.info("coordinator listening on %s://%s:%d", "https" if cert else "http", host, port)
    await server.serve()
    if getattr(server, "_captured_signals", None):
        # Stopped by a signal. uvicorn re-raises it after shutdown, but asyncio.run's own SIGINT handler can
        # miss it once the task has finished, and the run would then end as if nothing had stopped it.
        raise KeyboardInterrupt


def run_server(c: Coordinator, host: str, port: int, cert: str | None = None, key: str | None = None) -> None:
    asyncio.run(serve_forever(c, host, port, cert, key))
