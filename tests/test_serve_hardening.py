"""Stages that hostile or broken peers cannot starve: timeouts, connection and buffer caps, a shared token,
and a clean shutdown while peers are connected. Everything runs on 127.0.0.1, scaled down to seconds."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from blocktrain.cli.main import build_parser
from blocktrain.cli.serving import stage_options
from blocktrain.errors import ConfigError, ServeError, StageUnavailableError
from blocktrain.serve.client import TOKEN_ENV, PipelineClient
from blocktrain.serve.compute import BlockSpan
from blocktrain.serve.links import ByteBudget, Conn, Counters
from blocktrain.serve.stage import StageOptions, StageServer, StageState, StageThread, serve_until_stopped
from blocktrain.serve.wire import (
    MAGIC,
    MAX_HELLO_BYTES,
    SMALL_FRAME_BYTES,
    ErrorCode,
    Frame,
    FrameKind,
    decode,
    encode,
    hello,
)
from tests.serve_utils import SPANS, block_spans, free_ports, ring, tiny_models

TOKEN = "0123456789abcdef0123456789abcdef"
MIB = 1 << 20


@pytest.fixture(scope="module")
def models():  # type: ignore[no-untyped-def]
    return tiny_models(seed=2)


def _whole(models: Any) -> BlockSpan:
    cfg, blocks, _ = models
    return block_spans(cfg, blocks, [(0, 3)])[0]  # one stage with every block: it answers its sender


@contextmanager
def _stage(span: Any, **opts: Any) -> Iterator[StageThread]:
    st = StageThread(span, options=StageOptions(**opts))
    try:
        yield st
    finally:
        st.stop()


def _wait(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.01)


def _connect(addr: tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=5)


def _recv_frame(sock: socket.socket, timeout_s: float = 5.0) -> Frame | None:
    """The next frame, or None when the peer closed first."""
    sock.settimeout(timeout_s)
    buf = b""
    try:
        while len(buf) < 12 or len(buf) < 12 + sum(struct.unpack(">II", buf[4:12])):
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
    except ConnectionResetError:
        return None
    h_len, p_len = struct.unpack(">II", buf[4:12])
    return decode(buf[: 12 + h_len + p_len])


def _closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _send_some(sock: socket.socket, data: bytes, timeout_s: float = 1.0) -> int:
    """Send as much of ``data`` as the peer takes within ``timeout_s`` (a peer that stops reading is fine)."""
    sock.settimeout(timeout_s)
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(data[sent : sent + 65536])
    except TimeoutError:
        pass
    return sent


def _prefix(total: int, h_len: int = 100) -> bytes:
    """The 12-byte prefix of a frame of ``total`` bytes (header + payload)."""
    return MAGIC + struct.pack(">II", h_len, total - h_len)


async def _score(addr: tuple[str, int], token: str | None = None, seed: int = 0) -> torch.Tensor:
    async with PipelineClient(addr, timeout_s=10, token=token) as c:
        return await c.score(torch.arange(10, dtype=torch.uint8).unsqueeze(0), seed=seed)


class SlowSpan:
    """Wraps a span; every batch takes ``delay_s`` longer."""

    def __init__(self, span: BlockSpan, delay_s: float) -> None:
        self.span = span
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.span, name)

    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        time.sleep(self.delay_s)
        return self.span.run(frames)


# --- options -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"idle_timeout_s": 0}, "idle_timeout_s must be a positive"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s must be a positive"),
        ({"write_timeout_s": -1}, "--write-timeout"),
        ({"max_connections": 0}, "max_connections must be at least 1"),
        ({"conn_buffer_bytes": 1000}, "raise --conn-buffer-mib"),
        ({"conn_buffer_bytes": 2 * MIB, "buffer_bytes": MIB}, "raise --buffer-mib"),
        ({"conn_buffer_bytes": MIB, "buffer_bytes": 2 * MIB, "max_connections": 17}, "64 KiB set aside"),
        ({"token": "short"}, "16-512 printable ASCII"),
        ({"token": "has a space in it, sadly"}, "16-512 printable ASCII"),
    ],
)
def test_stage_options_are_validated(opts: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        StageOptions(**opts)


def test_serve_flags_reach_stage_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    parse = build_parser().parse_args
    opts = stage_options(parse(["serve", "--idle-timeout", "7", "--read-timeout", "3", "--write-timeout", "4",
                                "--max-connections", "9", "--max-frame-mib", "2"]))
    assert (opts.idle_timeout_s, opts.read_timeout_s, opts.write_timeout_s, opts.max_connections) == (7, 3, 4, 9)
    assert (opts.conn_buffer_bytes, opts.buffer_bytes, opts.token) == (2 * MIB, 8 * MIB + 9 * SMALL_FRAME_BYTES, "")
    opts = stage_options(parse(["serve", "--conn-buffer-mib", "1", "--buffer-mib", "3", "--max-connections", "16"]))
    assert (opts.conn_buffer_bytes, opts.buffer_bytes) == (MIB, 3 * MIB)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert stage_options(parse(["serve"])).token == TOKEN
    (tmp_path / "tok").write_text("f" * 32 + "\n")
    assert stage_options(parse(["serve", "--token-file", str(tmp_path / "tok")])).token == "f" * 32
    with pytest.raises(ConfigError, match="max_connections"):
        stage_options(parse(["serve", "--max-connections", "0"]))
    with pytest.raises(ConfigError, match="cannot read --token-file"):
        stage_options(parse(["serve", "--token-file", str(tmp_path / "missing")]))


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
    with _stage(_whole(models), idle_timeout_s=0.4) as st, _connect(st.address) as s:
        t0 = time.monotonic()
        assert _closed(s, timeout_s=5)
        assert 0.3 < time.monotonic() - t0 < 4
        assert st.server.counters.conns_idle_closed == 1
        _wait(lambda: not st.server.conns, what="connection dropped")


def test_idle_timeout_spares_connections_with_work_in_flight_and_clients_reconnect(models) -> None:  # type: ignore[no-untyped-def]
    span = SlowSpan(_whole(models), delay_s=1.0)  # compute outlasts the idle timeout twice over

    async def run(addr: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        async with PipelineClient(addr, timeout_s=10) as c:
            x = torch.arange(10, dtype=torch.uint8).unsqueeze(0)
            first = await c.score(x)
            await asyncio.sleep(1.0)  # idle: the stage closes this connection, the next call reopens it
            return first, await c.score(x)

    with _stage(span, idle_timeout_s=0.4) as st:
        first, again = asyncio.run(run(st.address))
        assert torch.equal(first, again)
        assert st.server.counters.conns_idle_closed >= 1


def test_half_sent_frame_is_dropped_after_the_read_timeout(models) -> None:  # type: ignore[no-untyped-def]
    with _stage(_whole(models), read_timeout_s=0.5, idle_timeout_s=30) as st:
        with _connect(st.address) as s:
            s.sendall(_prefix(1000) + b"x" * 300)
            _wait(lambda: st.server.budget.used == 1000, what="frame reserved")
            t0 = time.monotonic()
            err = _recv_frame(s)
            assert err is not None and err.kind is FrameKind.ERROR and err.code is ErrorCode.TIMEOUT
            assert "not complete within 0.5s" in err.error and _closed(s)
            assert 0.3 < time.monotonic() - t0 < 4
        with _connect(st.address) as s:  # a prefix cut short is a started frame too
            s.sendall(MAGIC + b"\x00")
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.TIMEOUT and _closed(s)
        assert st.server.counters.conns_slow_closed == 2
        _wait(lambda: st.server.budget.used == 0, what="reservation released")
        assert asyncio.run(_score(st.address)).shape == (1, 10, 256)


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
    assert 0.2 < elapsed < 3


# --- caps --------------------------------------------------------------------------------
def test_connection_cap_refuses_new_connections_with_a_rate_limited_log(models, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="blocktrain.serve.stage")
    with _stage(_whole(models), max_connections=3, idle_timeout_s=30) as st, ExitStack() as held:
        socks = [held.enter_context(_connect(st.address)) for _ in range(3)]
        _wait(lambda: len(st.server.conns) == 3, what="three connections held")
        for _ in range(4):
            with _connect(st.address) as extra:
                err = _recv_frame(extra)
                assert err is not None and err.code is ErrorCode.OVERLOADED and "--max-connections" in err.error
                assert _closed(extra)
        assert st.server.counters.conns_refused == 4 and len(st.server.conns) == 3
        refusals = [r for r in caplog.records if "refusing a connection" in r.getMessage()]
        assert len(refusals) == 1  # four refusals, one line within the rate-limit window
        socks[0].close()
        _wait(lambda: len(st.server.conns) == 2, what="a slot freed")
        assert asyncio.run(_score(st.address)).shape == (1, 10, 256)


def test_frame_over_the_per_connection_buffer_is_refused_before_it_is_buffered(models) -> None:  # type: ignore[no-untyped-def]
    opts = {"max_frame_bytes": 2 * MIB, "conn_buffer_bytes": MIB, "buffer_bytes": 4 * MIB, "max_connections": 8}
    with _stage(_whole(models), **opts) as st, _connect(st.address) as s:
        s.sendall(_prefix(MIB + 1))
        err = _recv_frame(s)
        assert err is not None and err.code is ErrorCode.TOO_LARGE and "buffered per connection" in err.error
        assert _closed(s)
        assert st.server.budget.peak == 0 and st.server.counters.frames_refused == 1


def test_idle_and_half_sent_maximum_frames_do_not_starve_a_real_client(models) -> None:  # type: ignore[no-untyped-def]
    """50 idle connections and four half-sent maximum-size frames: the buffered bytes stay under the cap
    (two frames fit, two wait for room), a real client is served meanwhile, and the attackers are dropped."""
    small = 64 * SMALL_FRAME_BYTES  # set aside for small frames, one per connection: the client's never wait
    cap = 2 * MIB + small  # room for two of the four large frames, and nothing else but small frames
    opts = {"max_frame_bytes": MIB, "conn_buffer_bytes": MIB, "buffer_bytes": cap, "max_connections": 64,
            "read_timeout_s": 4.0, "idle_timeout_s": 60}
    with _stage(_whole(models), **opts) as st, ExitStack() as held:
        server = st.server
        for _ in range(50):
            held.enter_context(_connect(st.address))
        hostile = [held.enter_context(_connect(st.address)) for _ in range(4)]
        for s in hostile:
            _send_some(s, _prefix(MIB) + b"\0" * (MIB // 2), timeout_s=0.5)
        # two frames fit and are reserved whole; the other two wait for room with nothing of theirs buffered
        _wait(lambda: len(server.conns) == 54 and server.budget.used == 2 * MIB and len(server.budget._waiters) == 2,
              what="two frames reserved, two waiting")

        assert asyncio.run(_score(st.address)).shape == (1, 10, 256)  # served while the attack holds
        info = server.info()
        assert server.counters.conns_slow_closed == 0 and server.counters.frames_refused == 0
        assert info["buffered_peak"] <= info["buffer_bytes"] == cap

        errors = [_recv_frame(s, timeout_s=10) for s in hostile]  # each within the read timeout of its start
        assert all(e is not None and e.code in (ErrorCode.TIMEOUT, ErrorCode.OVERLOADED) for e in errors)
        assert all(_closed(s) for s in hostile)
        _wait(lambda: server.budget.used == 0 and len(server.conns) == 50, what="attackers dropped")
        assert server.budget.peak <= server.budget.total
        assert server.counters.conns_slow_closed + server.counters.frames_refused == 4


# --- shared token ---------------------------------------------------------------------------
def test_token_wrong_or_missing_gets_error_and_close_right_token_is_served(models, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with _stage(_whole(models), token=TOKEN) as st:
        with _connect(st.address) as s:  # no HELLO first
            s.sendall(encode(Frame(FrameKind.PING, "p1")))
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNAUTHORIZED and "requires a shared token" in err.error
            assert _closed(s)
        with _connect(st.address) as s:  # a large first frame is refused from its prefix, nothing buffered
            s.sendall(_prefix(512 * 1024))
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNAUTHORIZED and _closed(s)
        assert st.server.budget.peak <= MAX_HELLO_BYTES  # only the small PING above was ever buffered
        with _connect(st.address) as s:  # wrong token, sent by hand
            s.sendall(encode(hello("f" * 32)) + encode(Frame(FrameKind.PING, "p2")))
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNAUTHORIZED and _closed(s)
        with pytest.raises(ServeError, match="unauthorized"):
            asyncio.run(_score(st.address, token="e" * 32))
        with pytest.raises(ServeError, match="unauthorized"):
            asyncio.run(_score(st.address))  # no token at all
        assert st.server.counters.auth_failures == 5
        assert asyncio.run(_score(st.address, token=TOKEN)).shape == (1, 10, 256)
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        assert asyncio.run(_score(st.address)).shape == (1, 10, 256)  # PipelineClient reads the env var
        assert st.server.counters.auth_failures == 5


def test_token_travels_between_stages(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    with ring(block_spans(cfg, blocks, SPANS), token=TOKEN) as stages:
        assert asyncio.run(_score(stages[0].address, token=TOKEN)).shape == (1, 10, 256)
        assert all(s.server.counters.auth_failures == 0 for s in stages)


def test_stage_with_another_token_fails_requests_fast(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    spans = block_spans(cfg, blocks, SPANS)
    ports = free_ports(3)
    other = "9" * 32
    fast = {"connect_timeout_s": 0.5, "connect_attempts": 2, "backoff_s": 0.05, "retries": 0}
    stages = []
    try:
        for i, (span, tok) in enumerate(zip(spans, (TOKEN, other, TOKEN), strict=True)):
            nxt = (("127.0.0.1", ports[(i + 1) % 3]),)
            stages.append(StageThread(span, port=ports[i], options=StageOptions(next_stages=nxt, token=tok, **fast)))
        t0 = time.monotonic()
        with pytest.raises(StageUnavailableError, match="refused this stage's token"):
            asyncio.run(_score(stages[0].address, token=TOKEN))
        assert time.monotonic() - t0 < 5
        assert stages[1].server.counters.auth_failures >= 1
    finally:
        for s in stages:
            s.stop()


# --- shutdown --------------------------------------------------------------------------------
def test_shutdown_with_peers_connected_logs_no_traceback(models, caplog) -> None:  # type: ignore[no-untyped-def]
    """The CLI's way of running a stage (asyncio.run until a stop event), and a ring of stage threads,
    both stopped while idle peers, a half-sent frame, a frame waiting for room and a client are connected."""
    caplog.set_level(logging.DEBUG)
    cfg, blocks, _ = models
    opts = StageOptions(buffer_bytes=3 * MIB // 2 + 8 * SMALL_FRAME_BYTES, conn_buffer_bytes=MIB, max_frame_bytes=MIB,
                        max_connections=8)  # room for one large frame
    server = StageServer(_whole(models), "127.0.0.1", 0, opts)
    holder: dict[str, Any] = {}

    async def main() -> None:
        holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await serve_until_stopped(server, holder["stop"])

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    _wait(lambda: server.state is StageState.SERVING, what="stage serving")
    addr = ("127.0.0.1", server.port)
    client_loop = asyncio.new_event_loop()
    with ExitStack() as held:
        for _ in range(3):
            held.enter_context(_connect(addr))
        for _ in range(2):  # the first is half-sent, the second waits for room
            _send_some(held.enter_context(_connect(addr)), _prefix(MIB) + b"\0" * 1000)
        client = PipelineClient(addr, timeout_s=10)
        client_loop.run_until_complete(client.connect())
        with ring(block_spans(cfg, blocks, SPANS)) as stages:
            ring_client = PipelineClient(stages[0].address, timeout_s=10)
            client_loop.run_until_complete(ring_client.connect())
            client_loop.run_until_complete(ring_client.score(torch.zeros(1, 4, dtype=torch.uint8)))
            _wait(lambda: len(server.conns) == 6 and server.budget.used == MIB, what="peers connected")
            holder["loop"].call_soon_threadsafe(holder["stop"].set)
            thread.join(10)
        assert not thread.is_alive() and server.state is StageState.STOPPED
        client_loop.run_until_complete(client.close())
        client_loop.run_until_complete(ring_client.close())
    client_loop.close()
    gc.collect()
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    for needle in ("Traceback", "Task was destroyed", "Exception in callback", "never retrieved"):
        assert needle not in caplog.text
