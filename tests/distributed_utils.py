"""Shared fixtures and helpers of the coordinator/worker tests (no tests in here)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.data.dataset import DataDir, open_data_dir
from blocktrain.presets import get_preset
from blocktrain.protocol.moments import InnerStart
from tests.forked_cli import spawn

WORDS = [
    "the", "of", "and", "in", "to", "a", "was", "is", "for", "on", "as", "by", "with", "he", "at", "from",
    "his", "an", "were", "are", "which", "this", "also", "be", "had", "first", "new", "one", "their",
    "after", "its", "who", "two", "not", "but", "has", "have", "been", "time", "city", "album", "river",
    "song", "game",
]


def write_corpus(root: Path, seed: int = 0) -> DataDir:
    """A small synthetic WikiText-like data directory (train/valid/test)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 120_000), ("valid", 16_000), ("test", 16_000)):
        out = []
        size = 0
        while size < n:
            line = " = " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + " . \n"
            out.append(line)
            size += len(line)
        (root / f"wiki.{split}.raw").write_text("".join(out))
    return open_data_dir(root)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> DataDir:
    return write_corpus(tmp_path_factory.mktemp("data"))


class FakeClock:
    """A settable wall clock for deadlines and leases."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


# Tests of the round mechanics, not of the defences (tests/test_intake.py), turn off what reads an update's content
# or counts its refusals: random test deltas are independent, so the agreement screen at a round's close would drop
# about half of them, and a test that sends many bad bodies on purpose would get its worker quarantined.
NO_SCREEN: dict[str, Any] = {"agree_min": None, "quarantine_after": 0, "refusal_burst": 0}


# Settings for tests that push hand-made deltas (not a worker's): rounds start fresh (the default, shared moments, asks
# every push for its moments; tests/test_inner.py covers them), and the norm bound is loose, since a hand-made delta
# has one size whatever its round's lr, where a trained one follows it (the calibrated default, 3, is for those).
HANDMADE: dict[str, Any] = {"inner_start": InnerStart.FRESH, "norm_k": 10.0}


def make_coordinator(run: Path, data: DataDir | None, clock: Any = None, **settings: Any) -> Coordinator:
    """A coordinator of the tiny preset, with :data:`HANDMADE`'s settings unless a test says otherwise."""
    for name, value in HANDMADE.items():
        settings.setdefault(name, value)
    if clock is None:
        return Coordinator(run, get_preset("tiny"), CoordinatorSettings(**settings), data)
    return Coordinator(run, get_preset("tiny"), CoordinatorSettings(**settings), data, clock=clock)


def full(c: Coordinator) -> int:
    """The samples a push claims for a whole round (H x batch): only such pushes' norms join the block's history."""
    return c.settings.local_steps * c.cfg.train.batch_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadServer:
    """uvicorn serving a coordinator app in a background thread (real loopback sockets)."""

    def __init__(self, c: Coordinator, background: bool = True) -> None:
        import uvicorn

        from blocktrain.coordinator.app import server_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = server_config(c, "127.0.0.1", self.port, background=background, limit_concurrency=1000, backlog=512)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_worker(c: Coordinator, kind: Any, data: DataDir, tmp_path: Path, name: str = "w", timeout: float = 60) -> Any:
    """One worker of class ``kind`` (a :class:`~blocktrain.worker.loop.Worker`) on block 0 over loopback HTTP, run
    until it stops; returns it."""
    from blocktrain.worker.options import WorkerOptions

    token = c.add_token(name)
    with ThreadServer(c) as srv:
        w = kind(WorkerOptions(url=srv.url, token=token, block=0, progress=False, frozen_cache=tmp_path / "frozen"), data)
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        t.join(timeout=timeout)
        assert not t.is_alive(), f"worker {name} did not stop within {timeout:g} s"
    return w


def cli(*args: str, **kw: Any) -> Any:
    """``blocktrain ARGS`` in its own process (forked from this one: see tests/forked_cli.py)."""
    # no BLOCKTRAIN_DATA from the developer's shell: a coordinator would take it as its dataset
    env = {k: v for k, v in os.environ.items() if k != "BLOCKTRAIN_DATA"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return spawn(list(args), env=env, **kw)


def add_token(run: Path, name: str) -> str:
    """What ``blocktrain token add NAME --run-dir RUN`` does, in this process (the CLI itself has its own test)."""
    from blocktrain.coordinator.store import Store

    store = Store(run)
    try:
        return store.tokens.add_token(name, time.time())
    finally:
        store.close()


def wait_for(pred: Any, timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            got = pred()
        except (httpx.HTTPError, OSError):
            got = None
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def one_row(store: Store, sql: str, *args: Any) -> dict[str, Any]:
    """``store.q1(sql, *args)`` where the test expects a row: fails if the query found none."""
    row = store.q1(sql, *args)
    assert row is not None, sql
    return row


def get_status(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/status", timeout=10).json())


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; killed (by pid) at teardown."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def block_weights(c: Coordinator, k: int) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in c.weights[k].items()}
