"""The pipeline client against an entry stage that hangs: a connection whose PING is never answered leaves nothing
running, and a stage that stops reading cannot hold a request past the client's timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import torch

from blocktrain.errors import ServeError, StageUnavailableError, WireError
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.wire.frames import ErrorCode, Frame, FrameKind, Mode, encode
from blocktrain.serve.wire.links import Conn, Counters
from tests.serve_sockets import with_header

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


def test_an_answer_with_values_no_model_makes_is_a_wire_error() -> None:
    """NaN or infinite logits reached the sampler (a RuntimeError: a 500, or a stream cut) or a score (a JSON null that
    lm-eval cannot sum); a draft byte past 255 was an IndexError. Each is a WireError (the request's 502)."""
    from blocktrain.errors import WireError
    from blocktrain.serve.client.decoding import answered

    def reply(name: str, t: torch.Tensor) -> Frame:
        return Frame(FrameKind.RESULT, "r-1", tensors={name: t})

    bad_logits = torch.zeros(2, 256)
    bad_logits[1, 7] = float("nan")
    with pytest.raises(WireError, match="finite floats"):
        answered(reply("logits", bad_logits), "logits", (2, 256))
    with pytest.raises(WireError, match="finite floats"):
        answered(reply("q", torch.full((1, 256), float("inf"))), "q", (1, 256))
    with pytest.raises(WireError, match="finite floats"):
        answered(reply("logits", torch.zeros(2, 256, dtype=torch.int64)), "logits", (2, 256))
    with pytest.raises(WireError, match="byte ids"):
        answered(reply("draft", torch.tensor([[3, 256]])), "draft", (1, 2))
    with pytest.raises(WireError, match="byte ids"):
        answered(reply("bytes", torch.tensor([[-1, 5]])), "bytes", (1, 2))
    with pytest.raises(WireError, match="byte ids"):
        answered(reply("bytes", torch.tensor([[1.0, 5.0]])), "bytes", (1, 2))
    assert answered(reply("draft", torch.tensor([[0, 255]], dtype=torch.uint8)), "draft", (1, 2)).tolist() == [[0, 255]]
    assert answered(reply("bytes", torch.tensor([[0, 255]])), "bytes", (1, 2)).tolist() == [[0, 255]]


PONG = {"family": "stack", "n": 1, "context": 64, "modes": ["score"], "state": "serving"}


def test_a_request_s_own_overload_is_no_refusal_of_the_connection() -> None:
    """The entry answers one request OVERLOADED (its pending cap) and keeps the connection: when that connection
    later drops for another reason, the requests then in flight fail for that reason, not with the old overload
    (which was kept as the connection's refusal). An OVERLOADED with no request id refuses the connection."""
    async def stage(conn: Conn) -> None:
        ping = await conn.recv()
        await conn.send(Frame(FrameKind.PONG, ping.request_id, params=PONG))
        first = await conn.recv()
        await conn.send(first.reply_error(ErrorCode.OVERLOADED, "4 requests pending: at most 4"))
        await conn.recv()  # the second request: the stage then goes away
        conn.close()

    async def main() -> None:
        server, addr = await _serve(stage)
        client = PipelineClient(addr, timeout_s=5.0, connect_attempts=1)
        await client.connect()
        with pytest.raises(ServeError, match="at most 4"):
            await client.score(torch.zeros(1, 8, dtype=torch.uint8))
        with pytest.raises(StageUnavailableError, match="connection") as lost:
            await client.score(torch.zeros(1, 8, dtype=torch.uint8))
        assert "at most 4" not in str(lost.value)
        assert not client._futures
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_cancelled_call_leaves_no_future_behind() -> None:
    """A call cancelled while it waits (its HTTP client left) kept its future until an answer came, for ever when
    none did."""
    async def silent_after_pong(conn: Conn) -> None:
        ping = await conn.recv()
        await conn.send(Frame(FrameKind.PONG, ping.request_id, params=PONG))
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(silent_after_pong)
        client = PipelineClient(addr, timeout_s=20.0, connect_attempts=1)
        await client.connect()
        task = asyncio.create_task(client.score(torch.zeros(1, 8, dtype=torch.uint8)))
        await asyncio.sleep(0.2)
        assert len(client._futures) == 1
        task.cancel()
        await asyncio.wait({task})
        assert not client._futures
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_release_is_sent_even_when_its_caller_is_cancelled() -> None:
    """A generation's finally asks for its RELEASE as its task is cancelled; the send waits for the connection (another
    request's frame is being written). Awaited there, it held the cancelled task (or, under a stream's cancel scope,
    was cancelled with it), and the KV caches stayed until their idle timeout; it is sent in a task of its own."""
    got: list[Frame] = []

    async def stage(conn: Conn) -> None:
        ping = await conn.recv()
        await conn.send(Frame(FrameKind.PONG, ping.request_id, params=PONG))
        got.append(await conn.recv())

    async def main() -> None:
        server, addr = await _serve(stage)
        client = PipelineClient(addr, timeout_s=5.0, connect_attempts=1)
        await client.connect()
        assert client.conn is not None
        busy = client.conn._lock  # the connection's writer, held as another request's frame is written
        await busy.acquire()

        async def generation() -> None:
            try:
                await asyncio.sleep(30)
            finally:
                await client.release("r-9", Mode.AR)

        task = asyncio.create_task(generation())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait({task}, timeout=5)  # the old release held the cancelled task on the connection's writer
        assert task.done()
        busy.release()
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.05)
        assert [(f.kind, f.request_id) for f in got] == [(FrameKind.RELEASE, "r-9")]
        await client.close()
        server.close()

    asyncio.run(main())


def test_requests_waiting_for_a_failed_connect_share_its_failure() -> None:
    """An entry stage that accepts connections and never answers: each waiting request connected again in turn, its
    PING waited the whole request timeout, so the k-th waited k of them. The PING waits the connect timeout, and the
    requests that waited for a failed connect get its failure."""
    from blocktrain.serve.gateway.checks import RequestError
    from blocktrain.serve.gateway.options import GatewayOptions
    from blocktrain.serve.gateway.serving import Gateway

    async def silent(conn: Conn) -> None:
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(silent)
        opts = GatewayOptions(pipeline=f"{addr[0]}:{addr[1]}", request_timeout_s=20.0)
        gw = Gateway(opts, PipelineClient(addr, timeout_s=20.0, connect_timeout_s=0.5, connect_attempts=1))
        t0 = time.monotonic()
        results = await asyncio.gather(*(gw.stage() for _ in range(8)), return_exceptions=True)
        assert all(isinstance(r, RequestError) and r.status == 503 for r in results), results
        assert time.monotonic() - t0 < 5
        server.close()

    asyncio.run(main())


def test_requests_reopening_a_lost_entry_share_a_failed_connect() -> None:
    """The entry stage restarts and then accepts without answering: every request waiting to reopen the connection
    connected in turn (the k-th after k failed PINGs); those that waited for a failed connect get its failure."""
    conns = [0]

    async def once_then_silent(conn: Conn) -> None:
        conns[0] += 1
        if conns[0] == 1:
            ping = await conn.recv()
            await conn.send(Frame(FrameKind.PONG, ping.request_id, params=PONG))
            conn.close()  # the entry goes away; when it is back, it answers nothing
            return
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(once_then_silent)
        client = PipelineClient(addr, timeout_s=20.0, connect_timeout_s=1.0, connect_attempts=1)
        await client.connect()
        await asyncio.sleep(0.2)  # the connection closed
        t0 = time.monotonic()
        results = await asyncio.gather(*(client.score(torch.zeros(1, 8, dtype=torch.uint8)) for _ in range(8)),
                                       return_exceptions=True)
        assert all(isinstance(r, StageUnavailableError) for r in results), results
        assert time.monotonic() - t0 < 4  # one PING timeout (1 s), not eight
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_cancelled_connect_shares_no_earlier_failure() -> None:
    """A connect fails, then the next is cancelled (its request's client left): the requests that waited for that
    second connect must try again, not take the first one's failure; and each waiter gets a failure of its own (one
    object raised in many tasks gathered all their frames)."""
    async def silent(conn: Conn) -> None:
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(silent)
        client = PipelineClient(addr, timeout_s=5.0, connect_timeout_s=0.3, connect_attempts=1)
        with pytest.raises(StageUnavailableError):
            await client.connect()
        a, b = client.failed_since(0), client.failed_since(0)
        assert a is not None and b is not None and a is not b and a.__traceback__ is None
        seen = client.connects
        task = asyncio.create_task(client.connect())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.wait({task})
        assert client.connects == seen + 1 and client.failed_since(seen) is None
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_bad_answer_fails_its_request_at_once() -> None:
    """An answer the client cannot decode (here: its payload's shapes disagree with its header's) was logged and
    dropped, and its request waited out the whole timeout (120 s by default) to fail as 'unavailable'. A bad frame
    whose header names a request fails that request at once, as a WireError."""
    async def garbles(conn: Conn) -> None:
        ping = await conn.recv()
        await conn.send(Frame(FrameKind.PONG, ping.request_id, params={"family": "stack", "n": 1, "context": 64,
                                                                        "modes": ["score"], "state": "serving"}))
        sub = await conn.recv()
        data = encode(Frame(FrameKind.RESULT, sub.request_id, Mode.SCORE, tensors={"logits": torch.zeros(1, 4, 256)}))
        conn.writer.write(with_header(data, shapes={"logits": [1, 5, 256]}))
        await conn.writer.drain()
        await asyncio.sleep(30)

    async def main() -> None:
        server, addr = await _serve(garbles)
        client = PipelineClient(addr, timeout_s=20.0, connect_attempts=1)
        await client.connect()
        t0 = time.monotonic()
        with pytest.raises(WireError, match="bad frame") as exc:
            await client.score(torch.zeros(1, 4, dtype=torch.uint8))
        assert time.monotonic() - t0 < 5 and not isinstance(exc.value, StageUnavailableError)
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_bad_request_frame_is_refused_by_its_id() -> None:
    """A stage refused a malformed frame with an ERROR naming no request, which its client could only log: the
    request waited out its timeout. The refusal names the request where the frame's header did."""
    from tests.serve_sockets import connect, open_stage, recv_frame, whole_span
    from tests.serve_utils import tiny_models

    with open_stage(whole_span(tiny_models(seed=1))) as st, connect(st.address) as s:
        data = encode(Frame(FrameKind.SUBMIT, "mine", Mode.SCORE, tensors={"x": torch.zeros(1, 4, dtype=torch.uint8)}))
        s.sendall(with_header(data, shapes={"x": [1, 5]}))
        got = recv_frame(s)
        assert got is not None and got.kind is FrameKind.ERROR and got.code is ErrorCode.MALFORMED
        assert got.request_id == "mine" and "disagree" in got.error


def test_a_next_stage_that_hangs_with_its_socket_open_is_failed_over() -> None:
    """A next stage that hangs (stopped, stuck on its device) keeps its socket open: the link noticed only a dropped
    connection, so frames in its custody sat there until their requests timed out, and every later frame went to the
    same hung stage. A frame held past the stall bound drops the connection, and the frames go to a replica."""
    from blocktrain.serve.wire.links import Link

    async def hung(conn: Conn) -> None:
        while True:
            await conn.recv()  # takes every frame, answers none

    async def good(conn: Conn) -> None:
        while True:
            frame = await conn.recv()
            await conn.send(Frame(FrameKind.ACK, frame.request_id, params={"tag": frame.params["tag"]}))

    async def main() -> tuple[list[Frame], bool]:
        s1, a1 = await _serve(hung)
        s2, a2 = await _serve(good)
        back: list[Frame] = []

        async def on_frame(frame: Frame) -> None:  # what the router does with an ACK: custody released
            back.append(frame)
            link.release(frame.params["tag"])

        async def undeliverable(frame: Frame, reason: str) -> None:
            raise AssertionError(f"{frame.request_id} failed: {reason}")

        link = Link([a1, a2], Counters(), on_frame, undeliverable, backoff_s=0.01)
        tag = link.send(Frame(FrameKind.WORK, "r1", Mode.SCORE, 1, tensors={"h": torch.zeros(1, 4, 8)}))
        await asyncio.sleep(0.5)
        assert not back and not link.stalled(5.0)  # held, not yet past the bound
        assert link.stalled(0.2)
        deadline = time.monotonic() + 5
        while not back and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        again = link.stalled(0.2)  # acknowledged by the replica: nothing held
        assert link.release(tag) is None and link.target == f"{a2[0]}:{a2[1]}"
        await link.close()
        s1.close()
        s2.close()
        return back, again

    back, again = asyncio.run(main())
    assert [(f.kind, f.request_id) for f in back] == [(FrameKind.ACK, "r1")] and not again
