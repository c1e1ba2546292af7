"""A worker's uploads in flight are bounded before their bodies are read (real uvicorn on loopback)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from blocktrain.coordinator.inflight import UPLOADS_PER_WORKER
from tests.distributed_utils import NO_SCREEN, FakeClock, ThreadServer, make_coordinator


def _open_upload(port: int, token: str, length: int) -> socket.socket:
    """A push whose head promises ``length`` bytes and whose body never comes whole."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST /v1/blocks/0/updates HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n".encode() + b"\0" * 16)
    return s


def _answer(s: socket.socket, wait_s: float) -> str | None:
    """What the server answered on ``s`` within ``wait_s`` (None: nothing yet, its body is still being read)."""
    s.settimeout(wait_s)
    try:
        return s.recv(4096).decode(errors="replace")
    except TimeoutError:
        return None


def test_a_worker_s_third_upload_at_once_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    """Nothing bounded one worker's uploads in flight: 200 sockets each promising the body cap were all admitted and
    buffered (a review's repro: 68.6 MB on the tiny preset, about 700 MB each on the paper preset), and the refusal
    rate limit saw none of them until they were refused. Past UPLOADS_PER_WORKER, the next is 429 at once; another
    worker is not affected, and a slot is free again once its upload ends."""
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=3600, **NO_SCREEN)
    token, other = c.add_token("w"), c.add_token("v")
    held: list[socket.socket] = []
    try:
        with ThreadServer(c, background=False) as srv:
            for t in (token, other):
                r = httpx.post(f"{srv.url}/v1/register", json={"block": 0}, headers={"Authorization": f"Bearer {t}"})
                assert r.status_code == 200, r.text
            length = c.max_body_bytes - 1
            held = [_open_upload(srv.port, token, length) for _ in range(UPLOADS_PER_WORKER)]
            assert [_answer(s, 0.5) for s in held] == [None] * len(held)  # both are being read: no answer yet
            extra = _open_upload(srv.port, token, length)
            head = _answer(extra, 10.0)
            extra.close()
            assert head is not None and head.startswith("HTTP/1.1 429") and "rate_limited" in head, head
            others = _open_upload(srv.port, other, length)  # another worker's own slots
            assert _answer(others, 0.5) is None
            others.close()
            held.pop().close()  # its upload ends (cut): the slot is free again once the server sees it
            deadline = time.monotonic() + 10
            got: str | None = "HTTP/1.1 429"
            while got is not None and time.monotonic() < deadline:
                again = _open_upload(srv.port, token, length)
                got = _answer(again, 1.0)  # None: being read, it has a slot
                again.close()
            assert got is None, got
            for s in held:  # before the server stops: it waits for the uploads it reads
                s.close()
    finally:
        for s in held:
            s.close()
        c.close()
