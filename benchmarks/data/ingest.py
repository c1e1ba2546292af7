"""How fast the coordinator ingests updates on loopback, next to a plain loopback copy.

    python benchmarks/data/ingest.py --preset cpu-small --updates 24 --compress none --json benchmarks/results/ingest.json

The coordinator runs as its own process (as in production). U workers, all on
block 0, each push one delta. The timing includes HTTP, parsing, validation
(names, shapes, dtypes, finiteness, norm), sha256 checks, the durable write and
the SQLite commit of every update. The round is kept open by a
(U+1)-th registered worker that never pushes, so aggregation is not timed. It runs with and without fsync
(``--no-fsync``), sequentially and with several concurrent clients. The
reference is the same number of bytes sent through a plain TCP socket on
127.0.0.1 to a process that only reads them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.model.block import BlockDenoiser
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import Compression, pack_delta
from blocktrain.protocol.moments import V_PREFIX
from blocktrain.protocol.weights import block_schema

log = logging.getLogger(__name__)

_SINK = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); view = memoryview(buf); total = int(sys.argv[1]); got = 0
while got < total:
    n = c.recv_into(view)
    if not n: break
    got += n
c.sendall(b"k"); c.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plain_copy_mbps(payload: bytes, repeats: int) -> float:
    """MB/s of sending ``repeats`` x ``payload`` over a loopback TCP socket to another process."""
    total = len(payload) * repeats
    sink = subprocess.Popen([sys.executable, "-c", _SINK, str(total)], stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.perf_counter()
            for _ in range(repeats):
                s.sendall(payload)
            s.recv(1)
            dt = time.perf_counter() - t0
    finally:
        sink.wait(timeout=60)
    return total / dt / 1e6


def run_ingest_bench(preset: str = "cpu-small", updates: int = 40, compression: str = "none",
                     work_dir: Path | None = None, concurrency: int = 4) -> dict[str, Any]:
    cfg = get_preset(preset)
    tmp = tempfile.TemporaryDirectory(prefix="blocktrain-ingest-") if work_dir is None else None
    root = Path(tmp.name) if tmp is not None else Path(work_dir or ".")
    result: dict[str, Any] = {"preset": preset, "updates": updates, "compression": compression}
    try:
        rates: dict[str, float] = {}
        for fsync in (True, False):
            for mode, n_clients in (("sequential", 1), ("concurrent", concurrency)):
                name = f"{mode}_{'fsync' if fsync else 'no_fsync'}"
                rates[name] = _one(cfg.name, root / f"run-{name}", updates, Compression(compression), n_clients,
                                   fsync)
        shapes = block_schema(BlockDenoiser(cfg.model, cfg.diffusion.sigma_data))
        body = pack_delta({n: torch.zeros(s) for n, s in shapes.items()}, Compression(compression), block=0,
                          base_version=0, base_sha="0" * 64, samples=1, **_moments(shapes, torch.Generator()))
        copy = plain_copy_mbps(body, updates)
        result.update(
            block_fp32_bytes=sum(4 * torch.Size(s).numel() for s in shapes.values()),
            update_bytes=len(body),
            ingest_MBps=rates,
            concurrent_clients=concurrency,
            plain_loopback_copy_MBps=copy,
            ingest_over_copy={k: v / copy for k, v in rates.items()},
            cpu_count=os.cpu_count(),
            includes="HTTP + safetensors parse + sha256 + name/shape/dtype/finite/norm checks + durable blob + "
                     "SQLite commit per update (the round stays open: aggregation is not timed); *_fsync: fsync per blob and commit "
                     "(power-loss safe), *_no_fsync: --no-fsync (safe from process crashes only)",
        )
    finally:
        if tmp is not None:
            tmp.cleanup()
    return result


def _moments(shapes: dict[str, tuple[int, ...]], g: torch.Generator) -> dict[str, Any]:
    """The inner moments a worker pushes with its delta under the coordinator's default (shared moments), on a round
    that shares them: every push here is one (the coordinator runs with --moment-every 1), the largest a worker sends."""
    s = CoordinatorSettings()
    moments = {}
    for prefix in s.inner_start.shares:
        for n, shape in shapes.items():
            x = 1e-3 * torch.randn(shape, generator=g)
            moments[prefix + n] = x.square() if prefix == V_PREFIX else x
    return {"moments": moments or None, "moment_codec": s.moment_codec if moments else None}


def _one(preset: str, run: Path, updates: int, compression: Compression, n_clients: int, fsync: bool) -> float:
    store = Store(run)
    tokens = [store.tokens.add_token(f"w{i:03d}", time.time()) for i in range(updates + 1)]  # the last never pushes
    store.close()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # no BLOCKTRAIN_DATA: with data the coordinator gates and audits every push (the intake alone is timed here)
    env = {**{k: v for k, v in os.environ.items() if k != "BLOCKTRAIN_DATA"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blocktrain", "coordinator", "--run-dir", str(run), "--preset", preset,
         "--objective", "diffusion", "--port",  # the updates below are diffusion blocks
         str(port), "--no-eval", "--norm-k", "0", "--round-seconds", "3600", "--threads", "1", "--moment-every", "1",
         # one more live worker than push: the round stays open (time the intake, not the aggregation)
         *([] if fsync else ["--no-fsync"])],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(f"{url}/v1/status", timeout=5)
                break
            except httpx.HTTPError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the coordinator did not start") from None
                time.sleep(0.2)
        cfg = get_preset(preset)
        shapes = block_schema(BlockDenoiser(cfg.model, cfg.diffusion.sigma_data))
        bodies = []
        sha = ""
        for i, t in enumerate(tokens):
            auth = {"Authorization": f"Bearer {t}"}
            httpx.post(f"{url}/v1/register", json={"block": 0}, headers=auth, timeout=30)
            if i == updates:  # the silent live replica
                break
            sha = sha or str(httpx.get(f"{url}/v1/work", headers=auth, timeout=30).json()["weights_sha"])
            g = torch.Generator().manual_seed(i)
            delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in shapes.items()}
            bodies.append(pack_delta(delta, compression, block=0, base_version=0, base_sha=sha, samples=1,
                                     **_moments(shapes, g)))
        errors: list[str] = []

        def push(idx: list[int]) -> None:
            with httpx.Client(base_url=url, timeout=120) as h:
                for i in idx:
                    r = h.post("/v1/blocks/0/updates", content=bodies[i],
                               headers={"Authorization": f"Bearer {tokens[i]}"})
                    if r.status_code != 202:
                        errors.append(f"{r.status_code} {r.text[:200]}")

        chunks = [list(range(c, updates, n_clients)) for c in range(n_clients)]
        threads = [threading.Thread(target=push, args=(c,)) for c in chunks]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dt = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"ingest bench: {len(errors)} pushes failed, first: {errors[0]}")
        st = httpx.get(f"{url}/v1/status", timeout=30).json()
        if st["updates_accepted"] != updates or st["blocks"][0]["version"] != 0:
            raise RuntimeError(f"ingest bench: expected {updates} accepted updates in an open round, got {st}")
        mbps = sum(len(b) for b in bodies) / dt / 1e6
        log.info("ingest (%d clients, fsync=%s): %d updates of %.1f MB in %.2fs = %.0f MB/s", n_clients, fsync, updates,
                 len(bodies[0]) / 1e6, dt, mbps)
        return mbps
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="coordinator update ingest speed on loopback vs a plain socket copy")
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--updates", type=int, default=40, help="updates to push")
    p.add_argument("--compress", default="none", choices=[c.value for c in Compression])
    p.add_argument("--work-dir", default=None, help="run directory for the coordinator (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run_ingest_bench(preset=args.preset, updates=args.updates, compression=args.compress,
                              work_dir=Path(args.work_dir) if args.work_dir else None)
    text = json.dumps(result, indent=2)
    sys.stdout.write(text + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
