"""Render the markdown tables of benchmarks/results/README-distributed.md from the result JSON files.

    python benchmarks/distributed/render_distributed_tables.py six|three|traffic|ingest FILE...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(f: str) -> Any:
    return json.loads(Path(f).read_text())


def six(f: str) -> str:
    d = _load(f)
    lines = [
        f"`{Path(f).name}` (preset `{d['preset']}`, {d['total_steps']} steps per block, H={d['local_steps_h']}, "
        f"{d['rounds']} rounds; command: `{d['command']}`)",
        "",
        "| | single machine `train` | six workers |",
        "|---|---|---|",
        f"| test CE, first {d['eval_bytes']} bytes (nats/byte) | {d['single_machine_ce_nats_per_byte']:.4f} "
        f"| {d['six_worker_ce_nats_per_byte']:.4f} |",
        f"| gap (six - single) | | {d['ce_gap_nats_per_byte']:+.4f} "
        f"(target within 0.03: {'met' if d['target_met'] else 'NOT met'}) |",
        f"| optimiser steps per block | {d['total_steps']} | {d['total_steps']} |",
        f"| local steps over all workers/blocks | {d['single_machine_steps_total']} | {d['worker_local_steps_total']} |",
        f"| bytes moved (coordinator bodies in + out) | 0 | {d['bytes_moved_total']:,} |",
        f"| wall time (s) | {d['wall_s']['single']:.0f} | {d['wall_s']['six']:.0f} |",
        "",
        "CE over rounds (coordinator's periodic eval, first 8192 validation bytes):",
        "",
        "| epoch (min version) | versions of blocks 0..3 | CE |",
        "|---|---|---|",
    ]
    for e in d["ce_over_rounds"]:
        versions = " ".join(str(v) for v in e["versions"].values())
        lines.append(f"| {e['epoch']} | {versions} | {e['ce_nats_per_byte']:.4f} |")
    return "\n".join(lines)


def three(f: str) -> str:
    d = _load(f)
    return "\n".join([
        f"`{Path(f).name}` (preset `{d['preset']}`, H={d['local_steps_h']}, {d['rounds']} rounds, "
        f"{d['workers']} workers; command: `{d['command']}`)",
        "",
        "| ce_start | ce_end | bytes moved | GB moved | rtt_ms (measured) | cap | wall (s) |",
        "|---|---|---|---|---|---|---|",
        f"| {d['ce_start']:.4f} | {d['ce_end']:.4f} | {d['bytes_moved_total']:,} | {d['gb_moved']:.4f} "
        f"| {d['rtt_ms']:.1f} | {d['bandwidth_cap_mbit']} Mbit/s | {d['wall_s']:.0f} |",
    ])


def traffic(files: list[str]) -> str:
    lines = [
        "| run | block fp32 bytes | push / round | pull / round (after first) | (push + pull) / block fp32 |",
        "|---|---|---|---|---|",
    ]
    for f in files:
        t = _load(f)["traffic"]
        b, ws = t["block_fp32_bytes"], t["per_worker"]
        push = sum(w["push_bytes_per_round"] for w in ws) / len(ws)
        pull = sum(w["pull_bytes_per_round_after_first"] for w in ws) / len(ws)
        r = [w["round_traffic_over_block_fp32"] for w in ws]
        lines.append(f"| `{Path(f).name}` | {b:,} | {push:,.0f} ({push / b:.3f}x) | {pull:,.0f} ({pull / b:.3f}x) "
                     f"| {min(r):.3f} - {max(r):.3f} |")
    return "\n".join(lines)


def ingest(f: str) -> str:
    d = _load(f)
    lines = [
        f"`{Path(f).name}`: preset `{d['preset']}` block, {d['updates']} updates of {d['update_bytes'] / 1e6:.1f} MB "
        f"({d['compression']}), coordinator in its own process on 127.0.0.1, {d['cpu_count']} cores.",
        "",
        "| mode | MB/s | vs plain loopback copy |",
        "|---|---|---|",
    ]
    for k, v in d["ingest_MBps"].items():
        lines.append(f"| {k} | {v:.0f} | {d['ingest_over_copy'][k]:.3f} |")
    lines.append(f"| plain loopback TCP copy (same bytes) | {d['plain_loopback_copy_MBps']:.0f} | 1 |")
    return "\n".join(lines)


if __name__ == "__main__":
    kind, files = sys.argv[1], sys.argv[2:]
    if kind == "six":
        print("\n\n".join(six(f) for f in files))
    elif kind == "three":
        print("\n\n".join(three(f) for f in files))
    elif kind == "traffic":
        print(traffic(files))
    elif kind == "ingest":
        print(ingest(files[0]))
    else:
        raise SystemExit("usage: render_distributed_tables.py six|three|traffic|ingest FILE...")
