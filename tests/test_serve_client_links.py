"""The pipeline client against an entry stage that hangs: a connection whose PING is never answered leaves nothing
running, and a stage that stops reading cannot hold a request past the client's timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import torch

from blocktrain.errors import StageUnavailableError
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.wire.frames import Frame, FrameKind
from blocktrain.serve.wire.links import Conn, Counters

pytestmark = [pytest.mark.timeout(60)]
BIG = 64 << 20  # bytes a frame may have here: more than a loopback socket buffers


async def _serve(handle: Callable[[Conn], Awaitable[None]]) -> tuple[asyncio.Server, tuple[str, int]]:
    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await handle(Conn(reader, writer, Counters(), BIG))

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[:2]


def test_a_ping_never_answered_leaves_no_reader_behind() -> None:
    """connect() fails when the stage never answers its PING; before, its read loop went on, and when that stage
    later closed the connection it failed the requests of the client's next connection."""
    async def silent(conn: Conn) -> None:
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(silent)
        client = PipelineClient(addr, timeout_s=0.5, connect_attempts=1)
        with pytest.raises(StageUnavailableError):
            await client.connect()
        assert client._reader is None and client.conn is None
        server.close()

    asyncio.run(main())


def test_a_stage_that_stops_reading_cannot_hold_a_request_past_the_timeout() -> None:
    """The entry stage answers its PING, then reads nothing: a request's frame larger than the socket buffers waited
    in drain() for ever (the reply's timeout starts after the send). The connection's writes are bounded by the
    client's timeout, so the request fails as unavailable within it."""
    async def stops_reading(conn: Conn) -> None:
        ping = await conn.recv()
        await conn.send(Frame(FrameKind.PONG, ping.request_id, params={"family": "stack", "n": 1, "context": 64,
                                                                        "modes": ["score"], "state": "serving"}))
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(stops_reading)
        client = PipelineClient(addr, timeout_s=1.0, connect_attempts=1, max_frame_bytes=BIG)
        await client.connect()
        t0 = time.monotonic()
        with pytest.raises(StageUnavailableError):
            await asyncio.wait_for(client.score(torch.zeros(512, 65536, dtype=torch.uint8)), 20)  # 32 MiB
        assert time.monotonic() - t0 < 10
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_stream_whose_client_stops_reading_ends_within_its_limit() -> None:
    """Every event waits on the client's socket; a client that stops reading held the stream (and its pipeline's KV
    caches) for ever. The stream ends within its limit and closes its events, which releases what they hold."""
    from blocktrain.serve.gateway.app import BoundedStream

    closed = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.set()

    async def stuck(message: object) -> None:
        if isinstance(message, dict) and message.get("type") == "http.response.body":
            await asyncio.sleep(3600)  # the client's socket is full: the server's flow control waits

    async def main() -> None:
        t0 = time.monotonic()
        await asyncio.wait_for(BoundedStream(events(), timeout_s=0.5).stream_response(stuck), 10)
        assert time.monotonic() - t0 < 5 and closed.is_set()

    asyncio.run(main())


def test_an_answer_without_the_tensors_asked_for_is_a_wire_error() -> None:
    """Stages are run by other people: an answer that lacks a tensor, or holds one of another shape, was a KeyError
    or an IndexError (a 500, or a stream cut without an error event); it is a WireError, which the gateway answers
    as a 502 naming the tensor."""
    from blocktrain.errors import WireError
    from blocktrain.serve.client.decoding import answered

    ok = Frame(FrameKind.RESULT, "r-1", tensors={"logits": torch.zeros(3, 256)})
    assert answered(ok, "logits", (3, 256)).shape == (3, 256) and answered(ok, "logits", (None, 256)).shape == (3, 256)
    with pytest.raises(WireError, match=r"none for 'q', expected \(3, 256\)"):
        answered(ok, "q", (3, 256))
    with pytest.raises(WireError, match=r"shape \(3, 256\) for 'logits', expected \(4, 256\)"):
        answered(ok, "logits", (4, 256))
    with pytest.raises(WireError, match="expected"):
        answered(ok, "logits", (3, 256, 1))
