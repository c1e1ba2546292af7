"""Can hostile connections starve a serving stage? One real stage on loopback against 200 idle connections
and four that each send half of a maximum-size frame, then a real client.

    python benchmarks/serving/serve_starvation.py [--buffer-mib MIB] [--json benchmarks/results/serve-starvation.json]

The stage is a `blocktrain serve` process with tiny random weights (its RSS is read from /proc, apart from
this attacker's). It prints the stage's RSS growth under the attack against the configured buffer cap, whether
the client was served while the attack held, and what the stage did with the attackers (its PONG counters).
Everything ends by itself in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from blocktrain.serve.client.pipeline import PipelineClient
from blocktrain.serve.wire.frames import MAGIC, SMALL_FRAME_BYTES

SHAPE = "d_model=64,n_heads=2,n_layers=2,n_blocks=2"
MIB = 1 << 20
attackers: list[asyncio.StreamWriter] = []


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def served(addr: tuple[str, int]) -> tuple[float, dict[str, Any]]:
    """Seconds for one real request (connect, score 64 bytes), and the stage's PONG afterwards."""
    t0 = time.monotonic()
    async with PipelineClient(addr, timeout_s=20, connect_attempts=1) as c:
        logits = await c.score(torch.arange(64, dtype=torch.uint8).unsqueeze(0))
        assert logits.shape == (1, 64, 256)
        seconds = time.monotonic() - t0
        return seconds, await c.ping()


async def ping(addr: tuple[str, int]) -> dict[str, Any]:
    async with PipelineClient(addr, timeout_s=20, connect_attempts=1) as c:
        return await c.ping()


async def half_frame(addr: tuple[str, int], frame_bytes: int, send_bytes: int, budget_s: float) -> int:
    """Send the prefix of a ``frame_bytes`` frame and ``send_bytes`` of its body; return the bytes the stage took."""
    _, writer = await asyncio.open_connection(*addr)
    chunk = bytes(MIB)
    writer.write(MAGIC + struct.pack(">II", 100, frame_bytes - 100))
    sent, deadline = 0, time.monotonic() + budget_s
    try:
        while sent < send_bytes and time.monotonic() < deadline:
            writer.write(chunk[: min(MIB, send_bytes - sent)])
            await asyncio.wait_for(writer.drain(), max(0.1, deadline - time.monotonic()))
            sent += min(MIB, send_bytes - sent)
    except (TimeoutError, ConnectionError):
        pass  # the stage stopped reading this one (no room in its buffer budget): that is the point
    attackers.append(writer)
    return sent


async def attack(args: argparse.Namespace, addr: tuple[str, int], pid: int) -> dict[str, Any]:
    frame = int(args.max_frame_mib * MIB)
    idle = [await asyncio.open_connection(*addr) for _ in range(args.idle)]
    sent = await asyncio.gather(*(half_frame(addr, frame, frame // 2, 3.0) for _ in range(args.hostile)))
    rss_attack = 0.0
    for _ in range(5):  # the highest of a few samples while the attack holds
        await asyncio.sleep(0.25)
        rss_attack = max(rss_attack, rss_mib(pid))
    seconds, pong = await served(addr)  # a real client, while the attack holds
    out = {"client_served": True, "client_seconds": round(seconds, 3), "rss_under_attack_mib": round(rss_attack, 1),
           "hostile_bytes_sent": sent, "buffered_bytes_under_attack": pong["buffered_bytes"],
           "connections_under_attack": pong["connections"]}
    # the half-sent frames are dropped after the read timeout; the idle connections after the idle timeout
    deadline = time.monotonic() + args.read_timeout + 5
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        pong = await ping(addr)
        dropped = pong["stats"]["conns_slow_closed"] + pong["stats"]["frames_refused"]
        if pong["buffered_bytes"] <= SMALL_FRAME_BYTES and dropped >= args.hostile:  # only the PING itself
            break
    out.update(rss_after_drop_mib=round(rss_mib(pid), 1), rss_peak_mib=round(rss_mib(pid, "VmHWM"), 1),
               buffered_peak_bytes=pong["buffered_peak"], buffer_cap_bytes=pong["buffer_bytes"],
               buffered_after_drop=pong["buffered_bytes"], stats=pong["stats"])
    for w in attackers + [w for _, w in idle]:
        w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=200, help="idle connections")
    ap.add_argument("--hostile", type=int, default=4, help="connections each sending half a maximum-size frame")
    ap.add_argument("--max-frame-mib", type=float, default=64.0, help="the stage's --max-frame-mib")
    ap.add_argument("--buffer-mib", type=float, default=None,
                    help="the stage's --buffer-mib (default: two maximum-size frames + 64 KiB per connection)")
    ap.add_argument("--read-timeout", type=float, default=15.0, help="the stage's --read-timeout")
    ap.add_argument("--json", default="benchmarks/results/serve-starvation.json", help="write the result here")
    args = ap.parse_args()

    max_connections = args.idle + args.hostile + 16
    if args.buffer_mib is None:
        args.buffer_mib = 2 * args.max_frame_mib + max_connections * SMALL_FRAME_BYTES / MIB
    port = free_port()
    addr = ("127.0.0.1", port)
    log = tempfile.NamedTemporaryFile(prefix="serve-starvation-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "blocktrain.cli", "serve", "--random", SHAPE, "--blocks", "0-1",
           "--listen", f"127.0.0.1:{port}", "--max-frame-mib", str(args.max_frame_mib),
           "--buffer-mib", str(args.buffer_mib), "--read-timeout", str(args.read_timeout), "--idle-timeout", "120",
           "--max-connections", str(max_connections)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("BLOCKTRAIN_SERVE_TOKEN", None)  # the attack is on a stage without a token: the worst case
    stage = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    t_start = time.monotonic()
    try:
        for _ in range(150):
            try:
                seconds, _ = asyncio.run(served(addr))  # also warms the compute path up
                break
            except Exception:
                if stage.poll() is not None:
                    raise RuntimeError(f"the stage exited; see {log.name}") from None
                time.sleep(0.2)
        else:
            raise RuntimeError(f"the stage did not answer within 30 s; see {log.name}")
        time.sleep(0.5)
        rss_base = rss_mib(stage.pid)
        result: dict[str, Any] = {"idle_connections": args.idle, "hostile_connections": args.hostile,
                                  "max_frame_mib": args.max_frame_mib, "buffer_cap_mib": args.buffer_mib,
                                  "read_timeout_s": args.read_timeout, "rss_baseline_mib": round(rss_base, 1),
                                  "client_seconds_before": round(seconds, 3)}
        result.update(asyncio.run(attack(args, addr, stage.pid)))
        result["rss_growth_mib"] = round(result["rss_under_attack_mib"] - rss_base, 1)
        result["rss_growth_within_cap"] = result["rss_growth_mib"] <= args.buffer_mib
    finally:
        stage.send_signal(signal.SIGTERM)
        try:
            rc = stage.wait(15)
        except subprocess.TimeoutExpired:
            stage.kill()
            rc = stage.wait()
    text = Path(log.name).read_text()
    result.update(stage_exit_code=rc, clean_shutdown=rc == 0 and "Traceback" not in text,
                  wall_seconds=round(time.monotonic() - t_start, 1),
                  command="python " + shlex.join(["benchmarks/serving/serve_starvation.py", *sys.argv[1:]]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(
        f"stage RSS {result['rss_baseline_mib']} MiB -> {result['rss_under_attack_mib']} MiB under attack "
        f"(+{result['rss_growth_mib']} MiB; buffer cap {args.buffer_mib:g} MiB; peak reserved "
        f"{result['buffered_peak_bytes'] / MIB:.1f} MiB); client served in {result['client_seconds']} s while "
        f"{args.idle} idle + {args.hostile} half-sent frames held; after the read timeout: "
        f"{result['rss_after_drop_mib']} MiB, slow-closed {result['stats']['conns_slow_closed']}, "
        f"refused {result['stats']['frames_refused']}; clean shutdown: {result['clean_shutdown']}\n"
        f"wrote {args.json}\n"
    )
    return 0 if result["client_served"] and result["rss_growth_within_cap"] and result["clean_shutdown"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
