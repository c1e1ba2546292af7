"""Depth at the committed budget, as the device suite runs it (``scripts/device_suite.sh``, job b).

Each ``bench quality`` run (one preset, one lr, one seed: the stack against the E2E at matched FLOPs) becomes one
row of a JSONL file (``row``); ``summary`` picks each arm's best lr by its mean over seeds and prints the gap
(stack minus E2E, nats/byte) with the seed spread of both arms at their best lr:

    python benchmarks/quality/device_depth.py row --key K --preset P --lr LR --seed S --bench RUN.json --jsonl depth.jsonl
    python benchmarks/quality/device_depth.py summary --jsonl depth.jsonl --json device-depth.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ARMS = ("stack", "stack_prefix0", "e2e_matched_flops")


def bench_row(key: str, preset: str, lr: float, seed: int, bench: dict[str, Any]) -> dict[str, Any]:
    """One row: every arm's test CE (the composed stack, its first prefix, the E2E at matched FLOPs)."""
    stack = bench["objectives"]["stack"]
    return {"key": key, "preset": preset, "lr": lr, "seed": seed, "device": bench.get("machine", {}).get("device"),
            "bytes_scored": stack["bytes_scored"], "command": bench["command"],
            "ce": {"stack": stack["ce_nats_per_byte"], "stack_prefix0": stack["prefix_ce"][0],
                   "e2e_matched_flops": bench["e2e_matched_flops"]["ce_nats_per_byte"]}}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per preset: each arm's CE by lr (seed mean, spread), its best lr, and the gap at the best lrs."""
    out: dict[str, Any] = {}
    by_preset: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_preset[r["preset"]].append(r)
    for preset, rs in sorted(by_preset.items()):
        arms: dict[str, Any] = {}
        for arm in ARMS:
            by_lr: dict[float, list[float]] = defaultdict(list)
            for r in rs:
                by_lr[r["lr"]].append(r["ce"][arm])
            means = {lr: statistics.mean(v) for lr, v in by_lr.items()}
            best = min(means, key=lambda lr: means[lr])
            arms[arm] = {"best_lr": best, "mean": means[best], "seeds": len(by_lr[best]),
                         "spread": max(by_lr[best]) - min(by_lr[best]),
                         "by_lr": {str(lr): {"mean": means[lr], "ces": by_lr[lr]} for lr in sorted(by_lr)}}
        gap = arms["stack"]["mean"] - arms["e2e_matched_flops"]["mean"]
        out[preset] = {"arms": arms, "gap_stack_minus_e2e": gap,
                       "spread_max": max(arms["stack"]["spread"], arms["e2e_matched_flops"]["spread"]),
                       "rows": len(rs)}
    return out


def table(summary: dict[str, Any]) -> str:
    lines = ["| preset | arm | best lr | seed mean CE | seeds | spread |", "|---|---|---|---|---|---|"]
    for preset, s in summary.items():
        for arm in ARMS:
            a = s["arms"][arm]
            lines.append(f"| {preset} | {arm} | {a['best_lr']:g} | {a['mean']:.4f} | {a['seeds']} | {a['spread']:.4f} |")
        lines.append(f"| {preset} | gap (stack - E2E) | | {s['gap_stack_minus_e2e']:+.4f} | | {s['spread_max']:.4f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("row")
    r.add_argument("--key", required=True)
    r.add_argument("--preset", required=True)
    r.add_argument("--lr", type=float, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--bench", type=Path, required=True)
    r.add_argument("--jsonl", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("--jsonl", type=Path, required=True)
    s.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "row":
        row = bench_row(args.key, args.preset, args.lr, args.seed, json.loads(args.bench.read_text()))
        with args.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return 0
    rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    summary = summarise(rows)
    sys.stdout.write(table(summary) + "\n")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "device-depth", "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
