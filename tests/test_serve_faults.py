"""Faults: bad frames, unknown ids, dead stages (with and without a replica), restarted stages."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from blocktrain.errors import StageUnavailableError, WireError
from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.runtime.diffusion import BlockSpan
from blocktrain.serve.stage.server import StageOptions, StageThread
from blocktrain.serve.wire.frames import MAGIC, ErrorCode, Frame, FrameKind, Mode, decode, encode
from tests.serve_utils import E2E_SPANS, SPANS, block_spans, e2e_spans, free_ports, local_models, ring, tiny_models

FAST: dict[str, Any] = {"connect_timeout_s": 0.5, "connect_attempts": 2, "backoff_s": 0.05}


@pytest.fixture(scope="module")
def models():  # type: ignore[no-untyped-def]
    return tiny_models(seed=1)


def _recv_frame(sock: socket.socket) -> Frame | None:
    buf = b""
    while len(buf) < 12:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    h_len, p_len = struct.unpack(">II", buf[4:12])
    while len(buf) < 12 + h_len + p_len:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    return decode(buf[: 12 + h_len + p_len])


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(2)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def _score(addr: tuple[str, int], timeout_s: float = 10.0, seed: int = 0) -> torch.Tensor:
    async with PipelineClient(addr, timeout_s=timeout_s) as c:
        return await c.score(torch.arange(10, dtype=torch.uint8).unsqueeze(0), seed=seed)


def test_bad_frames_are_rejected_and_others_still_served(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    with ring(block_spans(cfg, blocks, SPANS), max_frame_bytes=1 << 20) as stages:
        addr = stages[0].address
        # 1. bad magic: ERROR malformed, connection closed
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            err = _recv_frame(s)
            assert err is not None and err.kind is FrameKind.ERROR and err.code is ErrorCode.MALFORMED
            assert "magic" in err.error and _closed(s)
        # 2. oversized: rejected from the 12-byte prefix alone, connection closed
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(MAGIC + struct.pack(">II", 100, 50 << 20))
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.TOO_LARGE and "exceeds the cap" in err.error
            assert _closed(s)
        # 3. well framed but bad JSON, then unknown ids: rejected, and the same connection goes on
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(MAGIC + struct.pack(">II", 5, 0) + b"{oops")
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.MALFORMED and "not JSON" in err.error
            s.sendall(encode(Frame(FrameKind.RESULT, "ghost-1", Mode.SCORE)))
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNKNOWN_REQUEST and err.request_id == "ghost-1"
            s.sendall(encode(Frame(FrameKind.WORK, "ghost-2", Mode.SWEEP, 0, {"tag": 3})))
            err = _recv_frame(s)
            assert err is not None and err.code is ErrorCode.UNKNOWN_REQUEST
            s.sendall(encode(Frame(FrameKind.PING, "still-there")))
            pong = _recv_frame(s)
            assert pong is not None and pong.kind is FrameKind.PONG and pong.params["state"] == "serving"
        # other clients are served throughout
        assert asyncio.run(_score(addr)).shape == (1, 10, 256)


def test_unknown_baseline_request_rejected(models) -> None:  # type: ignore[no-untyped-def]
    _, _, e2e = models

    async def run(addr):  # type: ignore[no-untyped-def]
        async with PipelineClient(addr, timeout_s=10) as c:
            step = Frame(FrameKind.SUBMIT, "nobody", Mode.BASELINE, params={"pos": 5},
                         tensors={"x": torch.zeros(1, 1, dtype=torch.uint8)})
            with pytest.raises(WireError, match="unknown_request"):
                await c.call(step)
            return await c.generate_baseline(b"ok", 3, seed=0)

    with ring(e2e_spans(e2e, E2E_SPANS)) as stages:
        assert len(asyncio.run(run(stages[0].address))) == 3


def test_dead_stage_gives_clear_error_fast(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    with ring(block_spans(cfg, blocks, SPANS), request_timeout_s=10, **FAST) as stages:
        stages[1].stop()
        with pytest.raises(StageUnavailableError, match=r"could not pass request .* restart that stage"):
            asyncio.run(_score(stages[0].address, timeout_s=10))


class DyingSpan:
    """Wraps a span; the first frame it receives kills its own server (mid-request)."""

    def __init__(self, span: BlockSpan) -> None:
        self.span = span
        self.stage: StageThread | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.span, name)

    def run(self, frames: Sequence[Frame]) -> list[Frame]:
        assert self.stage is not None
        asyncio.run_coroutine_threadsafe(self.stage.server.stop(), self.stage.loop)
        time.sleep(0.5)
        raise RuntimeError("stage crashed")


def _ring_with_dying_middle(cfg, blocks, replica: bool, **opts: Any) -> tuple[list[StageThread], DyingSpan]:  # type: ignore[no-untyped-def]
    spans = block_spans(cfg, blocks, SPANS)
    p0, p1, p1b, p2 = free_ports(4)
    dying = DyingSpan(spans[1])
    nxt0 = (("127.0.0.1", p1), ("127.0.0.1", p1b)) if replica else (("127.0.0.1", p1),)
    stages = [StageThread(spans[0], port=p0, options=StageOptions(next_stages=nxt0, **opts))]
    to_p2 = StageOptions(next_stages=(("127.0.0.1", p2),), **opts)
    stages.append(StageThread(dying, port=p1, options=to_p2))  # type: ignore[arg-type]
    dying.stage = stages[-1]
    if replica:
        replica_span = block_spans(cfg, blocks, [SPANS[1]])[0]
        stages.append(StageThread(replica_span, port=p1b, options=to_p2))
    stages.append(StageThread(spans[2], port=p2, options=StageOptions(next_stages=(("127.0.0.1", p0),), **opts)))
    return stages, dying


def test_stage_dying_mid_request_fails_over_to_replica(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, e2e = models
    assembled, _ = local_models(cfg, blocks, e2e)
    stages, _ = _ring_with_dying_middle(cfg, blocks, replica=True, request_timeout_s=10, **FAST)
    try:
        logits = asyncio.run(_score(stages[0].address, timeout_s=10, seed=3))
    finally:
        for s in stages:
            s.stop()
    ref = assembled.log_probs(torch.arange(10, dtype=torch.uint8).unsqueeze(0), seed=3)[0]
    assert torch.allclose(torch.log_softmax(logits, -1), ref, atol=1e-5)


def test_stage_dying_mid_request_without_replica_errors_within_timeout(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    stages, _ = _ring_with_dying_middle(cfg, blocks, replica=False, request_timeout_s=10, retries=0, **FAST)
    try:
        with pytest.raises(StageUnavailableError, match=r"stage_unavailable|timeout"):
            asyncio.run(_score(stages[0].address, timeout_s=10))
    finally:
        for s in stages:
            s.stop()


def test_restarted_stage_is_reachable_without_restarting_neighbours(models) -> None:  # type: ignore[no-untyped-def]
    cfg, blocks, _ = models
    spans = block_spans(cfg, blocks, SPANS)
    with ring(spans, request_timeout_s=10, **FAST) as stages:
        addr = stages[0].address
        first = asyncio.run(_score(addr, seed=1))
        port, opts = stages[1].server.port, stages[1].server.opts
        stages[1].stop()
        with pytest.raises(StageUnavailableError):
            asyncio.run(_score(addr, timeout_s=10, seed=1))
        stages[1] = StageThread(spans[1], port=port, options=opts)  # same address, neighbours untouched
        again = asyncio.run(_score(addr, seed=1))
    assert torch.equal(first, again)
