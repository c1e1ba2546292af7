"""The coordinator's bytes per round with N workers on one block, for both averaging engines (issue 23).

For each engine (``coordinator``: every worker pushes its delta and pulls each new version from the coordinator;
``hivemind``: the workers all-reduce among themselves, one member uploads the group's mean, and new versions are
pulled from peers first) and each N, a fresh ``tiny`` run: a coordinator and N workers as processes on loopback,
block 0, a few rounds; the coordinator's own byte counters (``/v1/status`` ``bytes_by_route``: deltas in,
weights and steps out, control) divided by the rounds it closed. Prints a table and writes JSON.

    python benchmarks/distributed/hivemind_bytes.py --workers 6,12,24 --rounds 3 --json benchmarks/results/hivemind-bytes.json

Needs the hivemind extra for the hivemind rows (``pip install 'blocktrain[hivemind]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from blocktrain.coordinator.store import Store
from blocktrain.data.dataset import resolve_data_dir


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _blocktrain(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "blocktrain", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("wb"))


def one_run(engine: str, n: int, rounds: int, local_steps: int, data: Path, root: Path, timeout_s: float,
            matchmaking_s: float) -> dict[str, Any]:
    run, port = root / f"{engine}-{n}", _port()
    store = Store(run)
    tokens = [store.tokens.add_token(f"w{i}", time.time()) for i in range(n)]
    store.close()
    url = f"http://127.0.0.1:{port}"
    coord_args = ["coordinator", "--run-dir", str(run), "--preset", "tiny", "--port", str(port), "--no-eval",
                  "--threads", "1", "--rounds", str(rounds), "--round-seconds", "300", "--data", str(data),
                  "--local-steps", str(local_steps),
                  # the engines' traffic alone, as measured: --no-eval with --data had also turned these off
                  "--no-gate", "--audit-fraction", "0", "--probation-pushes", "0"]
    hivemind = engine == "hivemind"
    coord = _blocktrain([*coord_args, *(["--hivemind", "--hivemind-host", "127.0.0.1"] if hivemind else [])],
                        run.parent / f"{engine}-{n}-coordinator.log")
    workers: list[subprocess.Popen[bytes]] = []
    t0 = time.time()
    try:
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(f"{url}/v1/status", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.time() > deadline or coord.poll() is not None:
                    raise RuntimeError(f"the coordinator did not start; see {run.parent}/{engine}-{n}-coordinator.log") from None
                time.sleep(0.5)
        for i, token in enumerate(tokens):
            extra = ["--averaging", "hivemind", "--p2p-host", "127.0.0.1", "--group-size", "32",
                     "--matchmaking-s", str(matchmaking_s)] if hivemind else []
            workers.append(_blocktrain(["worker", "--coordinator", url, "--token", token, "--data", str(data),
                                        "--threads", "1", "--no-progress", "--block", "0", "--local-steps",
                                        str(local_steps), *extra], run.parent / f"{engine}-{n}-w{i}.log"))
        for w in workers:
            w.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
    finally:
        for p in [*workers, coord]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # each stops the hivemind processes it started
        for p in [*workers, coord]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    closed = max(1, int(status["rounds_closed"]))
    routes = status["bytes_by_route"]
    per_round = {r: (v["in"] + v["out"]) / closed for r, v in routes.items()}
    return {
        "engine": engine, "workers": n, "rounds_closed": int(status["rounds_closed"]), "wall_s": time.time() - t0,
        "bytes_in_per_round": status["bytes_in"] / closed, "bytes_out_per_round": status["bytes_out"] / closed,
        "bytes_per_round": (status["bytes_in"] + status["bytes_out"]) / closed,
        "update_and_weight_bytes_per_round": per_round["updates"] + per_round["weights"],
        "control_bytes_per_round": per_round["control"], "bytes_by_route": routes,
        "groups": [r["groups"] for r in status["rounds"]], "block_fp32_bytes": status["block_fp32_bytes"],
        "matchmaking_s": matchmaking_s if hivemind else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="6,12,24", help="comma-separated worker counts")
    ap.add_argument("--engines", default="coordinator,hivemind", help="comma-separated: coordinator, hivemind")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of block 0 per run")
    ap.add_argument("--local-steps", type=int, default=5, help="H: each worker's optimiser steps per round")
    ap.add_argument("--data", default=None, help="data directory (default: the resolved one)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="seconds one run may take")
    ap.add_argument("--matchmaking-s", type=float, default=3.0,
                    help="hivemind workers' matchmaking window (many workers sharing 2 cores finish far apart)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    data = resolve_data_dir(args.data).root
    rows = []
    with tempfile.TemporaryDirectory(prefix="bt-hivemind-bytes-") as tmp:
        for engine in args.engines.split(","):
            for n in (int(x) for x in args.workers.split(",")):
                row = one_run(engine, n, args.rounds, args.local_steps, data, Path(tmp), args.timeout_s,
                              args.matchmaking_s)
                rows.append(row)
                print(f"{engine:11s} {n:3d} workers: {row['bytes_per_round'] / 1e3:9.1f} kB per round "
                      f"(updates and weights {row['update_and_weight_bytes_per_round'] / 1e3:.1f} kB, control "
                      f"{row['control_bytes_per_round'] / 1e3:.1f} kB), groups {row['groups']}", flush=True)
    result = {"benchmark": "hivemind_bytes", "command": shlex.join([sys.executable, *sys.argv]), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
