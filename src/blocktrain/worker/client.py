"""HTTP client of the coordinator, with timeouts and bounded exponential backoff.

Connection errors, timeouts and 5xx answers are retried with delays
``base * 2^i`` (capped at ``max_delay``, with jitter) until ``give_up_s``
seconds have passed without success; then :class:`ProtocolError` is raised.
A 4xx answer is not retried: it is raised at once as a ProtocolError carrying
the coordinator's message; but a 408 or 429 after a sending whose answer was
lost is retried too (refused before its body was read, it does not say whether
the first sending was taken; a worker that undid a round the coordinator kept
would fail its next audit, coordinator.lineage). An answer is read up to ``max_response_bytes`` after
decoding (a deflate bomb or a runaway body ends the request, 502 ``too_large``):
small before registration, then sized by the worker from its block. An audit upload waits up to ``replay_wait_s``
for its answer: the coordinator replays the round, and the earlier rounds its moments came from, before answering.
Such a long wait ends within a second of ``stop`` (the second signal: the worker abandons its round); a worker that is
only leaving (the first) finishes its round, the audit's upload and wait included.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.messages import (
    AuditAnswer,
    P2PToken,
    PushAnswer,
    RegisterRequest,
    Registration,
    WorkAnswer,
    parse,
)
from blocktrain.protocol.transport import DEFLATE, deflate

log = logging.getLogger(__name__)
LEAVING_GIVE_UP_S = 10.0  # seconds a leaving worker (SIGTERM) keeps retrying a coordinator that is gone
UNSIZED_RESPONSE_BYTES = 16 * 2**20  # bytes an answer may have until the worker knows its block (JSON answers)
MIN_ANSWER_BYTES_PER_S = 16 * 2**10  # bytes/s an answer must average once it has come for timeout_s (a trickle ends)
UNSETTLED = (408, 429)  # refusals before a body is read: after a lost sending, they do not say whether it was taken


class CoordinatorClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 60.0,
        base_delay: float = 0.5,
        max_delay: float = 15.0,
        give_up_s: float = 600.0,
        verify: bool | str = True,
        stop: threading.Event | None = None,
        leaving: threading.Event | None = None,
        deflate_pushes: bool = True,
        replay_wait_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.give_up_s = give_up_s
        self.stop = stop or threading.Event()  # abandon: no more retries at all
        self.waiting: Callable[[], None] = lambda: None  # called about every second of a long wait (the heartbeat)
        self.leaving = leaving or threading.Event()  # the worker is leaving: retry at most LEAVING_GIVE_UP_S more
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            verify=ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify,
        )
        self.timeout_s = timeout_s  # seconds to wait for a read, a write or a pool slot (connect: 10)
        self.replay_wait_s = replay_wait_s  # seconds to wait for the answer to an audit upload (the replay's time)
        self.deflate_pushes = deflate_pushes  # send update bodies with Content-Encoding: deflate
        self.max_response_bytes = UNSIZED_RESPONSE_BYTES  # bytes of an answer, decoded (set from the block's size)
        self.bytes_sent = 0  # request body bytes, as sent on the wire
        self.bytes_received = 0  # response body bytes, as received on the wire (before any decoding)
        self._leave_seen: float | None = None  # when a retry loop first saw ``leaving`` set

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, content: bytes | None = None, json: Any = None,
                retry: bool = True, encoding: str | None = None, read_s: float | None = None,
                timed: Callable[[float], None] | None = None) -> httpx.Response:
        """``read_s``: seconds to wait for the answer, where the coordinator works before answering (default the
        client's ``timeout_s``); ``timed``: given the seconds of the sending that was answered (not the retries).
        A coordinator that answers 503 ``audits_busy`` until ``give_up_s`` raises that, not ``unreachable``."""
        timeout = httpx.Timeout(self.timeout_s, connect=10.0, read=max(read_s or 0.0, self.timeout_s))
        start = time.monotonic()
        attempt = 0
        while True:
            sent_at, busy = time.monotonic(), None
            try:
                headers = {"Content-Type": "application/octet-stream"} if content is not None else {}
                if encoding is not None:
                    headers["Content-Encoding"] = encoding
                request = self.http.build_request(method, path, content=content, json=json, headers=headers or None,
                                                  timeout=timeout)
                resp = self._watched(request) if read_s is not None and read_s > self.timeout_s else self._capped(request)
                if resp.status_code < 500:
                    if resp.status_code < 400:
                        if timed is not None:
                            timed(time.monotonic() - sent_at)
                        return resp
                    if not (attempt > 0 and resp.status_code in UNSETTLED):
                        raise _protocol_error(resp)
                # a sending went out whose answer never came, and this one was refused before its body was read:
                # the first may have been taken, so the same request goes again until an answer settles it (a
                # byte-identical resend of a push is answered as its first sending was)
                problem = f"{resp.status_code} {resp.text[:200]}"
                busy = _protocol_error(resp) if resp.status_code == 503 else None
                busy = busy if busy is not None and busy.reason == Reason.AUDITS_BUSY else None
            except (httpx.TransportError, httpx.DecodingError) as exc:  # unreachable, cut, or an answer garbled on the way
                problem = f"{type(exc).__name__}: {exc}"
            elapsed = time.monotonic() - start
            if not retry or elapsed > self.give_up_s or self.stop.is_set() or self._left_long_ago():
                if busy is not None:  # it is there, with no room to audit the push: not unreachable
                    raise busy
                raise ProtocolError(503, f"coordinator at {self.url} unreachable ({problem}); check it is running",
                                    Reason.UNREACHABLE)
            backoff = self.base_delay * 2 ** min(attempt, 30)  # the exponent capped: 2**1024 overflows a float
            delay = min(self.max_delay, backoff) * (0.5 + random.random() / 2)
            log.warning("%s %s failed (%s); retrying in %.1fs", method, path, problem, delay)
            attempt += 1
            until = time.monotonic() + delay
            while (left := until - time.monotonic()) > 0:  # woken within a second by abandon or a long leave
                if busy is not None:  # it answers, busy: the worker stays live while it waits for room
                    self.waiting()
                if self.stop.wait(min(left, 1.0)):
                    raise ProtocolError(503, "stopped while waiting for the coordinator", Reason.STOPPED)
                if self._left_long_ago():
                    raise ProtocolError(503, f"coordinator at {self.url} unreachable ({problem}) while leaving",
                                        Reason.UNREACHABLE)

    def _watched(self, request: httpx.Request) -> httpx.Response:
        """:meth:`_capped` in a thread of its own, for an answer that may take minutes: given up within a second of
        ``stop``. The thread goes on until its request ends (answered, or its read timeout); the bytes it moves after
        are counted then, if the process is still there."""
        done = threading.Event()
        got: list[httpx.Response | BaseException] = []

        def send() -> None:
            try:
                got.append(self._capped(request))
            except BaseException as exc:  # handed to the caller's thread as it is
                got.append(exc)
            finally:
                done.set()

        threading.Thread(target=send, name=f"{request.method} {request.url.path}", daemon=True).start()
        while not done.wait(1.0):
            self.waiting()  # the replay may outlast the lease: the worker stays live meanwhile
            if self.stop.is_set():
                raise ProtocolError(503, f"stopped while waiting for the answer to {request.method} {request.url.path}",
                                    Reason.STOPPED)
        if isinstance(got[0], BaseException):
            raise got[0]
        return got[0]

    def _capped(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and read its answer, at most ``max_response_bytes`` of it after decoding. httpx's read
        timeout bounds each read, not the answer: a peer that sends a byte just inside it would hold the worker (and
        its lease) for as long as it liked. So an answer must average ``MIN_ANSWER_BYTES_PER_S`` once ``timeout_s``
        has passed since its headers came; one slower is cut as a read timeout (then retried like one)."""
        cap = self.max_response_bytes
        resp = self.http.send(request, stream=True)
        try:
            self.bytes_sent += len(request.content) if request.content else 0
            chunks: list[bytes] = []
            size = 0
            began = time.monotonic()  # the answer's headers came: from here it must keep coming
            for chunk in resp.iter_bytes():
                if chunks and self.stop.is_set():  # a second Ctrl-C cuts a long answer short (a short one is read)
                    raise ProtocolError(503, f"stopped while reading the answer to {request.method} {request.url.path}",
                                        Reason.STOPPED)
                late = time.monotonic() - began - self.timeout_s
                if late > 0 and resp.num_bytes_downloaded < MIN_ANSWER_BYTES_PER_S * late:
                    raise httpx.ReadTimeout(f"the answer to {request.method} {request.url.path} came at "
                                            f"{resp.num_bytes_downloaded} bytes in {late + self.timeout_s:.0f}s, under "
                                            f"{MIN_ANSWER_BYTES_PER_S} bytes/s", request=request)
                size += len(chunk)
                if size > cap:
                    raise ProtocolError(502, f"the coordinator's answer to {request.method} {request.url.path} exceeds "
                                        f"{cap} bytes; check the coordinator URL and that it runs the same BlockTrain "
                                        "version", Reason.TOO_LARGE)
                chunks.append(chunk)
        finally:
            self.bytes_received += resp.num_bytes_downloaded
            resp.close()
        headers = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in ("content-encoding", "content-length")]
        return httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks), request=request)

    def _left_long_ago(self) -> bool:
        """The worker was told to leave (SIGTERM) more than LEAVING_GIVE_UP_S ago: a gone coordinator ends it."""
        if not self.leaving.is_set():
            self._leave_seen = None
            return False
        if self._leave_seen is None:
            self._leave_seen = time.monotonic()
        return time.monotonic() - self._leave_seen > LEAVING_GIVE_UP_S

    # --- protocol calls --------------------------------------------------------
    def register(self, block: int | None, dataset: str | None = None, p2p_key: str | None = None) -> Registration:
        """``p2p_key``: the hivemind engine; the coordinator answers with a token for this key."""
        body = RegisterRequest(block=block, dataset=dataset, p2p_key=p2p_key).model_dump(exclude_none=True)
        return parse(Registration, _json(self.request("POST", "/v1/register", json=body)), "the registration answer", 502)

    def work(self) -> WorkAnswer:
        return parse(WorkAnswer, _json(self.request("GET", "/v1/work")), "the work answer", 502)

    def p2p_token(self) -> P2PToken:
        """A new DHT token for the key this worker registered with (hivemind engine), its session going on."""
        return parse(P2PToken, _json(self.request("POST", "/v1/p2p/token")), "the p2p token answer", 502)

    def heartbeat(self) -> None:
        self.request("POST", "/v1/heartbeat", retry=False)

    def leave(self) -> None:
        self.request("POST", "/v1/leave", retry=False)

    def weights(self, k: int) -> bytes:
        return self.request("GET", f"/v1/blocks/{k}/weights").content

    def step(self, k: int, from_version: int) -> bytes:
        return self.request("GET", f"/v1/blocks/{k}/steps/{from_version}").content

    def moments(self, k: int, v: int) -> bytes:
        return self.request("GET", f"/v1/blocks/{k}/moments/{v}").content

    def frozen(self, k: int) -> bytes:
        """The finished block k's weights (safetensors), the frozen input of later stack blocks."""
        return self.request("GET", f"/v1/blocks/{k}/frozen").content

    def push(self, k: int, payload: bytes, timed: Callable[[float], None] | None = None) -> PushAnswer:
        """Send an update (safetensors bytes), deflated on the wire unless ``deflate_pushes`` is off; ``timed`` is
        given the seconds its deflating and answered sending took."""
        t0 = time.monotonic()
        body, encoding = (deflate(payload), DEFLATE) if self.deflate_pushes else (payload, None)
        packed = time.monotonic() - t0
        resp = self.request("POST", f"/v1/blocks/{k}/updates", content=body, encoding=encoding,
                            timed=None if timed is None else lambda s: timed(packed + s))
        return parse(PushAnswer, _json(resp), "the coordinator's push answer", status=502)

    def audit(self, k: int, v: int, payload: bytes) -> AuditAnswer:
        """Upload the inner state an audited push committed to; the coordinator replays the round before it answers
        (waited for up to ``replay_wait_s``: a resend after a timeout would find the audit taken, 404)."""
        resp = self.request("POST", f"/v1/blocks/{k}/audits/{v}", content=deflate(payload), encoding=DEFLATE,
                            read_s=self.replay_wait_s)
        return parse(AuditAnswer, _json(resp), "the coordinator's audit answer", status=502)


def _json(resp: httpx.Response) -> Any:
    """A successful answer's JSON body; 502 for one that is not JSON (a proxy's or a captive portal's page)."""
    try:
        return resp.json()
    except ValueError:
        raise ProtocolError(502, f"the coordinator's answer to {resp.request.method} {resp.request.url.path} is not "
                            f"JSON ({resp.headers.get('content-type', 'no content type')}: {resp.text[:100]!r}); check "
                            "--url points at the coordinator", Reason.INVALID) from None


def _protocol_error(resp: httpx.Response) -> ProtocolError:
    """The refusal ``resp`` carries: the coordinator's JSON (detail, error), or a proxy's page or JSON of another
    shape as text (a JSON string or list was an AttributeError that escaped the client)."""
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        detail, reason = str(doc.get("detail", doc))[:2000], str(doc.get("error", "http"))[:64]
    else:
        detail, reason = resp.text[:300], "http"
    return ProtocolError(resp.status_code, f"coordinator answered {resp.status_code}: {detail}", reason)
