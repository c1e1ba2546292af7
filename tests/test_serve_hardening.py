"""Stage hardening, limits: idle/read/write timeouts, the connection cap, the shared byte budget."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from contextlib import ExitStack

import pytest
import torch

from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.wire.frames import MAGIC, SMALL_FRAME_BYTES, ErrorCode, Frame, FrameKind
from blocktrain.serve.wire.links import ByteBudget, Conn, Counters
from tests.serve_sockets import (
    MIB,
    SlowSpan,
    closed,
    connect,
    frame_prefix,
    open_stage,
    recv_frame,
    score,
    send_some,
    wait_until,
    whole_span,
)
from tests.serve_utils import tiny_models


@pytest.fixture(scope="module")
def models():  # type: ignore[no-untyped-def]
    return tiny_models(seed=2)


def test_byte_budget_keeps_room_for_small_frames() -> None:
    async def run() -> None:
        budget = ByteBudget(10_000, small_frame=1000, small_slots=4)  # 6000 bytes for larger frames
        assert budget.try_reserve(3000) and budget.try_reserve(3000)
        assert not budget.try_reserve(1001)  # large frames have taken their share
        assert all(budget.try_reserve(1000) for _ in range(4))  # small ones still fit
        assert budget.used == budget.peak == 10_000 and not budget.try_reserve(1)
        with pytest.raises(ValueError, match="can never fit"):
            await budget.reserve(6001)
        waiter = asyncio.ensure_future(budget.reserve(3000))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        budget.release(3000)
        await asyncio.wait_for(waiter, 1)
        assert budget.used == 10_000 and budget.large_used == 6000

    asyncio.run(run())


# --- timeouts ----------------------------------------------------------------------------
def test_idle_connection_is_closed_after_the_idle_timeout(models) -> None:  # type: ignore[no-untyped-def]
    with open_stage(whole_span(models), idle_timeout_s=0.4) as st, connect(st.address) as s:
        t0 = time.monotonic()
        assert closed(s, timeout_s=5)
        assert time.monotonic() - t0 > 0.3  # not before its timeout
        assert st.server.counters.conns_idle_closed == 1
        wait_until(lambda: not st.server.conns, what="connection dropped")


def test_idle_timeout_spares_connections_with_work_in_flight_and_clients_reconnect(models) -> None:  # type: ignore[no-untyped-def]
    span = SlowSpan(whole_span(models), delay_s=1.0)  # compute outlasts the idle timeout twice over

    async def run(addr: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        async with PipelineClient(addr, timeout_s=10) as c:
            x = torch.arange(10, dtype=torch.uint8).unsqueeze(0)
            first = await c.score(x)
            await asyncio.sleep(1.0)  # idle: the stage closes this connection, the next call reopens it
            return first, await c.score(x)

    with open_stage(span, idle_timeout_s=0.4) as st:
        first, again = asyncio.run(run(st.address))
        assert torch.equal(first, again)
        assert st.server.counters.conns_idle_closed >= 1


def test_half_sent_frame_is_dropped_after_the_read_timeout(models) -> None:  # type: ignore[no-untyped-def]
    with open_stage(whole_span(models), read_timeout_s=0.5, idle_timeout_s=30) as st:
        with connect(st.address) as s:
            s.sendall(frame_prefix(1000) + b"x" * 300)
            wait_until(lambda: st.server.budget.used == 1000, what="frame reserved")
            t0 = time.monotonic()
            err = recv_frame(s)
            assert err is not None and err.kind is FrameKind.ERROR and err.code is ErrorCode.TIMEOUT
            assert "not complete within 0.5s" in err.error and closed(s)
            assert time.monotonic() - t0 > 0.3  # not before its timeout
        with connect(st.address) as s:  # a prefix cut short is a started frame too
            s.sendall(MAGIC + b"\x00")
            err = recv_frame(s)
            assert err is not None and err.code is ErrorCode.TIMEOUT and closed(s)
        assert st.server.counters.conns_slow_closed == 2
        wait_until(lambda: st.server.budget.used == 0, what="reservation released")
        assert asyncio.run(score(st.address)).shape == (1, 10, 256)


def test_write_timeout_drops_a_peer_that_reads_nothing() -> None:
    async def run() -> tuple[bool, float, Counters, bool]:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.connect(listener.getsockname())
        peer, _ = listener.accept()  # never reads
        try:
            reader, writer = await asyncio.open_connection(sock=sock)
            counters = Counters()
            conn = Conn(reader, writer, counters, max_frame=64 * MIB, write_timeout_s=0.3)
            big = Frame(FrameKind.PING, "big", tensors={"z": torch.zeros(2 * MIB)})  # 8 MiB
            t0 = time.monotonic()
            ok = await conn.send(big)
            elapsed = time.monotonic() - t0
            await asyncio.sleep(0.05)
            return ok, elapsed, counters, conn.closed
        finally:
            peer.close()
            listener.close()

    ok, elapsed, counters, closed = asyncio.run(run())
    assert not ok and closed and counters.writes_timed_out == 1
    assert elapsed > 0.2  # not before its timeout


# --- caps --------------------------------------------------------------------------------
def test_connection_cap_refuses_new_connections_with_a_rate_limited_log(models, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="blocktrain.serve.stage")
    with open_stage(whole_span(models), max_connections=3, idle_timeout_s=30) as st, ExitStack() as held:
        socks = [held.enter_context(connect(st.address)) for _ in range(3)]
        wait_until(lambda: len(st.server.conns) == 3, what="three connections held")
        for _ in range(4):
            with connect(st.address) as extra:
                err = recv_frame(extra)
                assert err is not None and err.code is ErrorCode.OVERLOADED and "--max-connections" in err.error
                assert closed(extra)
        assert st.server.counters.conns_refused == 4 and len(st.server.conns) == 3
        refusals = [r for r in caplog.records if "refusing a connection" in r.getMessage()]
        assert len(refusals) == 1  # four refusals, one line within the rate-limit window
        socks[0].close()
        wait_until(lambda: len(st.server.conns) == 2, what="a slot freed")
        assert asyncio.run(score(st.address)).shape == (1, 10, 256)


def test_frame_over_the_per_connection_buffer_is_refused_before_it_is_buffered(models) -> None:  # type: ignore[no-untyped-def]
    opts = {"max_frame_bytes": 2 * MIB, "conn_buffer_bytes": MIB, "buffer_bytes": 4 * MIB, "max_connections": 8}
    with open_stage(whole_span(models), **opts) as st, connect(st.address) as s:
        s.sendall(frame_prefix(MIB + 1))
        err = recv_frame(s)
        assert err is not None and err.code is ErrorCode.TOO_LARGE and "buffered per connection" in err.error
        assert closed(s)
        assert st.server.budget.peak == 0 and st.server.counters.frames_refused == 1


def test_idle_and_half_sent_maximum_frames_do_not_starve_a_real_client(models) -> None:  # type: ignore[no-untyped-def]
    """50 idle connections and four half-sent maximum-size frames: the buffered bytes stay under the cap
    (two frames fit, two wait for room), a real client is served meanwhile, and the attackers are dropped."""
    small = 64 * SMALL_FRAME_BYTES  # set aside for small frames, one per connection: the client's never wait
    cap = 2 * MIB + small  # room for two of the four large frames, and nothing else but small frames
    opts = {"max_frame_bytes": MIB, "conn_buffer_bytes": MIB, "buffer_bytes": cap, "max_connections": 64,
            "read_timeout_s": 4.0, "idle_timeout_s": 60}
    with open_stage(whole_span(models), **opts) as st, ExitStack() as held:
        server = st.server
        for _ in range(50):
            held.enter_context(connect(st.address))
        hostile = [held.enter_context(connect(st.address)) for _ in range(4)]
        for s in hostile:
            send_some(s, frame_prefix(MIB) + b"\0" * (MIB // 2), timeout_s=0.5)
        # two frames fit and are reserved whole; the other two wait for room with nothing of theirs buffered
        wait_until(lambda: len(server.conns) == 54 and server.budget.used == 2 * MIB and len(server.budget._waiters) == 2,
              what="two frames reserved, two waiting")

        assert asyncio.run(score(st.address)).shape == (1, 10, 256)  # served while the attack holds
        info = server.info()
        assert server.counters.conns_slow_closed == 0 and server.counters.frames_refused == 0
        assert info["buffered_peak"] <= info["buffer_bytes"] == cap

        errors = [recv_frame(s, timeout_s=10) for s in hostile]  # each within the read timeout of its start
        assert all(e is not None and e.code in (ErrorCode.TIMEOUT, ErrorCode.OVERLOADED) for e in errors)
        assert all(closed(s) for s in hostile)
        wait_until(lambda: server.budget.used == 0 and len(server.conns) == 50, what="attackers dropped")
        assert server.budget.peak <= server.budget.total
        assert server.counters.conns_slow_closed + server.counters.frames_refused == 4

