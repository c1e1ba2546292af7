"""The HTTP guard's bound on answers (:func:`blocktrain.protocol.guard.guarded_http`): a client that reads nothing of a
large answer is dropped after ``write_stall_s``, its unsent bytes with it; one that reads slowly is served whole."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from blocktrain.protocol.guard import guarded_http
from tests.serve_sockets import wait_until
from tests.serve_utils import free_ports

ANSWER = 4 << 20  # bytes of the answer: far past the transport's high-water mark (64 KiB)


async def big_answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(ANSWER).encode())]})
    await send({"type": "http.response.body", "body": b"x" * ANSWER})


@contextmanager
def serving(write_stall_s: float) -> Iterator[tuple[uvicorn.Server, int]]:
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(big_answer, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                                           timeout_keep_alive=1, http=guarded_http(write_stall_s=write_stall_s)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield server, port
    finally:
        server.should_exit = True
        thread.join(10)


def _ask(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def test_a_client_that_reads_nothing_of_a_large_answer_is_dropped() -> None:
    """A whole answer is written into the transport at once, and closing a connection waits for its unsent bytes: a
    client that never read held 4 MB and its connection slot until the process ended (the keep-alive close waited
    too). Past write_stall_s without reading, the connection is aborted."""
    with serving(write_stall_s=1.0) as (server, port), _ask(port) as s:
        wait_until(lambda: bool(server.server_state.connections), what="the connection to be accepted")
        wait_until(lambda: not server.server_state.connections, timeout_s=15, what="the stalled connection dropped")
        s.settimeout(5)
        got = 0
        try:
            while chunk := s.recv(1 << 16):
                got += len(chunk)
        except OSError:  # reset: the unsent bytes were dropped
            pass
        assert got < ANSWER


def test_a_client_that_reads_slowly_gets_its_whole_answer() -> None:
    """A client that reads all along is never dropped, though its unsent bytes stay past the high-water mark for
    longer than write_stall_s (they shrink at each look)."""
    with serving(write_stall_s=1.0) as (_, port), _ask(port) as s:
        s.settimeout(5)
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(4096)
        body = len(got) - got.index(b"\r\n\r\n") - 4
        while body < ANSWER:
            chunk = s.recv(1 << 20)
            assert chunk, "the connection was dropped while the client read"
            body += len(chunk)
            time.sleep(0.002)  # slow, but never 1 s without reading
        assert body == ANSWER
