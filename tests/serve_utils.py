"""Helpers for the serving tests: tiny random-weight models and in-process pipelines."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import BaseModel

from blocktrain.config import RunConfig
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.presets import tiny
from blocktrain.serve.runtime import Span
from blocktrain.serve.runtime.diffusion import BlockSpan
from blocktrain.serve.runtime.e2e import E2ESpan
from blocktrain.serve.runtime.loading import _e2e_parts
from blocktrain.serve.stage.server import StageOptions, StageThread
from blocktrain.serve.wire.links import Address
from tests.forked_cli import ForkedCli

SPANS = ((0, 1), (2, 2), (3, 3))  # B=4 blocks over three stages
E2E_SPANS = ((0, 1), (2, 2), (3, 3))  # L=4 layers over three stages


def tiny_models(seed: int = 0) -> tuple[RunConfig, list[BlockDenoiser], E2ETransformer]:
    cfg = tiny()
    torch.manual_seed(seed)
    blocks = []
    for _ in range(cfg.model.n_blocks):
        b = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
        torch.nn.init.normal_(b.z_in.weight, std=0.05)  # let z matter in untrained blocks
        torch.nn.init.normal_(b.mod.weight, std=0.05)  # and sigma, through adaLN
        blocks.append(b.eval())
    e2e = E2ETransformer(cfg.model).eval()
    return cfg, blocks, e2e


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def block_spans(cfg: RunConfig, blocks: Sequence[BlockDenoiser], spans: Sequence[tuple[int, int]]) -> list[BlockSpan]:
    return [BlockSpan({k: blocks[k] for k in range(lo, hi + 1)}, cfg) for lo, hi in spans]


def e2e_spans(e2e: E2ETransformer, spans: Sequence[tuple[int, int]]) -> list[E2ESpan]:
    return [E2ESpan(e2e.cfg, *_e2e_parts(e2e, lo, hi)) for lo, hi in spans]


@contextmanager
def ring(spans: Sequence[Span], ports: Sequence[int] | None = None,
         **opts: object) -> Iterator[list[StageThread]]:
    """Start stages as a ring on loopback (the last stage answers through the first)."""
    ports = list(ports or free_ports(len(spans)))
    addrs: list[Address] = [("127.0.0.1", p) for p in ports]
    stages = []
    try:
        for i, span in enumerate(spans):
            nxt = addrs[(i + 1) % len(spans)] if len(spans) > 1 else None
            o = StageOptions(next_stages=(nxt,) if nxt else (), **opts)  # type: ignore[arg-type]
            stages.append(StageThread(span, "127.0.0.1", ports[i], o))
        yield stages
    finally:
        for s in stages:
            s.stop()


def local_models(
    cfg: RunConfig, blocks: Sequence[BlockDenoiser], e2e: E2ETransformer
) -> tuple[AssembledModel, E2EModel]:
    return AssembledModel(list(blocks), cfg), E2EModel(e2e, cfg)


def wait_port(port: int, proc: subprocess.Popen[bytes] | ForkedCli, seconds: float = 120.0) -> None:
    """Wait until a `blocktrain serve` subprocess listens on 127.0.0.1:port (fails at once if it exited)."""
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "stage exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"stage on port {port} did not start within {seconds}s")


def extras(obj: BaseModel) -> dict[str, Any]:
    """An openai client object's fields beyond OpenAI's schema (its ``model_extra``: a dict, as the client's models
    allow extra fields)."""
    assert obj.model_extra is not None
    return obj.model_extra


def entry_name(stage: StageThread, rid: str) -> str:
    """The entry's name of a connected client's request ``rid``: the key of its KV caches at every stage."""
    server = stage.server
    names = {server.entry.inner(conn, rid) for conn in list(server.conns)}
    held = [name for name in names if name in getattr(server.span, "cache", ())]
    assert len(held) == 1, f"request {rid!r} is cached under {len(held)} of the entry's names"
    return held[0]
