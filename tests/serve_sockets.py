"""Socket-level helpers for the stage hardening tests: raw connections, frames by hand, a slow span."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.runtime.diffusion import BlockSpan
from blocktrain.serve.stage.server import StageOptions, StageThread
from blocktrain.serve.wire.frames import MAGIC, Frame, decode
from tests.serve_utils import block_spans

TOKEN = "0123456789abcdef0123456789abcdef"
MIB = 1 << 20


def whole_span(models: Any) -> BlockSpan:
    cfg, blocks, _ = models
    return block_spans(cfg, blocks, [(0, 3)])[0]  # one stage with every block: it answers its sender


@contextmanager
def open_stage(span: Any, **opts: Any) -> Iterator[StageThread]:
    st = StageThread(span, options=StageOptions(**opts))
    try:
        yield st
    finally:
        st.stop()


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.01)


def connect(addr: tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=5)


def recv_frame(sock: socket.socket, timeout_s: float = 5.0) -> Frame | None:
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


def closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
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


def send_some(sock: socket.socket, data: bytes, timeout_s: float = 1.0) -> int:
    """Send as much of ``data`` as the peer takes within ``timeout_s`` (a peer that stops reading is fine)."""
    sock.settimeout(timeout_s)
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(data[sent : sent + 65536])
    except TimeoutError:
        pass
    return sent


def with_header(data: bytes, **fields: object) -> bytes:
    """``data`` (an encoded frame) with header fields replaced, its lengths fixed up: a frame no encoder would write."""
    h_len, p_len = struct.unpack(">II", data[4:12])
    header = {**json.loads(data[12 : 12 + h_len]), **fields}
    raw = json.dumps(header).encode()
    return data[:4] + struct.pack(">II", len(raw), p_len) + raw + data[12 + h_len :]


def frame_prefix(total: int, h_len: int = 100) -> bytes:
    """The 12-byte prefix of a frame of ``total`` bytes (header + payload)."""
    return MAGIC + struct.pack(">II", h_len, total - h_len)


async def score(addr: tuple[str, int], token: str | None = None, seed: int = 0) -> torch.Tensor:
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

