"""Stage hardening, trust: the shared token between clients and stages, and a clean shutdown with peers connected."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from blocktrain.errors import ServeError, StageUnavailableError
from blocktrain.serve.client.pipeline import TOKEN_ENV, PipelineClient
from blocktrain.serve.stage.server import StageOptions, StageServer, StageState, StageThread, serve_until_stopped
from blocktrain.serve.wire.frames import MAX_HELLO_BYTES, SMALL_FRAME_BYTES, ErrorCode, Frame, FrameKind, encode, hello
from tests.serve_sockets import (
    MIB,
    TOKEN,
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
from tests.serve_utils import SPANS, block_spans, free_ports, ring, tiny_models


@pytest.fixture(scope="module")
def models():  # type: ignore[no-untyped-def]
    return tiny_models(seed=2)


# --- shared token ---------------------------------------------------------------------------
def test_token_wrong_or_missing_gets_error_and_close_right_token_is_served(models, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with open_stage(whole_span(models), token=TOKEN) as st:
        with connect(st.address) as s:  # no HELLO first
            s.sendall(encode(Frame(FrameKind.PING, "p1")))
            err = recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNAUTHORIZED and "requires a shared token" in err.error
            assert closed(s)
        with connect(st.address) as s:  # a large first frame is refused from its prefix, nothing buffered
            s.sendall(frame_prefix(512 * 1024))
            err = recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNAUTHORIZED and closed(s)
        assert st.server.budget.peak <= MAX_HELLO_BYTES  # only the small PING above was ever buffered
        with connect(st.address) as s:  # wrong token, sent by hand
            s.sendall(encode(hello("f" * 32)) + encode(Frame(FrameKind.PING, "p2")))
            err = recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNAUTHORIZED and closed(s)
        with pytest.raises(ServeError, match="unauthorized"):
            asyncio.run(score(st.address, token="e" * 32))
        with pytest.raises(ServeError, match="unauthorized"):
            asyncio.run(score(st.address))  # no token at all
        assert st.server.counters.auth_failures == 5
        assert asyncio.run(score(st.address, token=TOKEN)).shape == (1, 10, 256)
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        assert asyncio.run(score(st.address)).shape == (1, 10, 256)  # PipelineClient reads the env var
        assert st.server.counters.auth_failures == 5


def test_token_travels_between_stages(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    with ring(block_spans(cfg, blocks, SPANS), token=TOKEN) as stages:
        assert asyncio.run(score(stages[0].address, token=TOKEN)).shape == (1, 10, 256)
        assert all(s.server.counters.auth_failures == 0 for s in stages)


def test_stage_with_another_token_fails_requests_fast(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    spans = block_spans(cfg, blocks, SPANS)
    ports = free_ports(3)
    other = "9" * 32
    fast: dict[str, Any] = {"connect_timeout_s": 0.5, "connect_attempts": 2, "backoff_s": 0.05, "retries": 0}
    stages = []
    try:
        for i, (span, tok) in enumerate(zip(spans, (TOKEN, other, TOKEN), strict=True)):
            nxt = (("127.0.0.1", ports[(i + 1) % 3]),)
            stages.append(StageThread(span, port=ports[i], options=StageOptions(next_stages=nxt, token=tok, **fast)))
        with pytest.raises(StageUnavailableError, match="refused this stage's token"):
            asyncio.run(score(stages[0].address, token=TOKEN))
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
    server = StageServer(whole_span(models), "127.0.0.1", 0, opts)
    holder: dict[str, Any] = {}

    async def main() -> None:
        holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await serve_until_stopped(server, holder["stop"])

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    wait_until(lambda: server.state is StageState.SERVING, what="stage serving")
    addr = ("127.0.0.1", server.port)
    client_loop = asyncio.new_event_loop()
    with ExitStack() as held:
        for _ in range(3):
            held.enter_context(connect(addr))
        for _ in range(2):  # the first is half-sent, the second waits for room
            send_some(held.enter_context(connect(addr)), frame_prefix(MIB) + b"\0" * 1000)
        client = PipelineClient(addr, timeout_s=10)
        client_loop.run_until_complete(client.connect())
        with ring(block_spans(cfg, blocks, SPANS)) as stages:
            ring_client = PipelineClient(stages[0].address, timeout_s=10)
            client_loop.run_until_complete(ring_client.connect())
            client_loop.run_until_complete(ring_client.score(torch.zeros(1, 4, dtype=torch.uint8)))
            wait_until(lambda: len(server.conns) == 6 and server.budget.used == MIB, what="peers connected")
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
