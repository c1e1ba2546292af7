"""A worker's uploads in flight are bounded before their bodies are read (real uvicorn on loopback)."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import httpx
import pytest

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
    rate limit saw none of them until they were refused. Past UPLOADS_PER_WORKER, the next is 503 at once (a worker's
    client retries a 5xx with backoff); another worker is not affected, and a slot is free again once its upload
    ends. (Sockets close before the server stops, which waits for the uploads it reads, and it before the store.)"""
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=3600, **NO_SCREEN)
    token, other = c.add_token("w"), c.add_token("v")
    try:
        with ThreadServer(c, background=False) as srv, contextlib.ExitStack() as sockets:
            for t in (token, other):
                r = httpx.post(f"{srv.url}/v1/register", json={"block": 0}, headers={"Authorization": f"Bearer {t}"})
                assert r.status_code == 200, r.text

            def upload(t: str) -> socket.socket:
                return sockets.enter_context(_open_upload(srv.port, t, c.max_body_bytes - 1))

            held = [upload(token) for _ in range(UPLOADS_PER_WORKER)]
            assert [_answer(s, 0.5) for s in held] == [None] * len(held)  # both are being read: no answer yet
            head = _answer(upload(token), 10.0)
            assert head is not None and head.startswith("HTTP/1.1 503") and "rate_limited" in head, head
            assert _answer(upload(other), 0.5) is None  # another worker's own slots
            held[0].close()  # its upload ends (cut): the slot is free again once the server sees it
            deadline = time.monotonic() + 10
            got: str | None = "HTTP/1.1 503"
            while got is not None and time.monotonic() < deadline:
                again = upload(token)
                got = _answer(again, 1.0)  # None: being read, it has a slot
                if got is not None:
                    again.close()
            assert got is None, got
    finally:
        c.close()


def test_an_upload_whose_body_stops_coming_is_cut_and_gives_its_slot_back(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection whose path died (a worker that changed networks) used to keep reading until upload_timeout_s
    (600 s), and now would hold one of its worker's two slots that long. A body that pauses for UPLOAD_STALL_S
    (here 1 s) is cut with a 408, and the worker's next upload is read."""
    from blocktrain.coordinator import app as app_module

    monkeypatch.setattr(app_module, "UPLOAD_STALL_S", 1.0, raising=False)  # (raising: the old code had none)
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=3600, **NO_SCREEN)
    token = c.add_token("w")
    try:
        with ThreadServer(c, background=False) as srv, contextlib.ExitStack() as sockets:
            r = httpx.post(f"{srv.url}/v1/register", json={"block": 0}, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
            held = [sockets.enter_context(_open_upload(srv.port, token, c.max_body_bytes - 1))
                    for _ in range(UPLOADS_PER_WORKER)]
            t0 = time.monotonic()
            answers = [_answer(s, 10.0) for s in held]
            assert all(a is not None and a.startswith("HTTP/1.1 408") for a in answers), answers
            assert time.monotonic() - t0 < 5.0
            got = _answer(sockets.enter_context(_open_upload(srv.port, token, c.max_body_bytes - 1)), 0.5)
            assert got is None or not got.startswith("HTTP/1.1 503"), got  # a slot: being read (or cut by now)
    finally:
        c.close()
