"""Collect the outputs of scripts/exp_six_workers.sh and scripts/netns_three_hosts.sh into one JSON each.

    python benchmarks/distributed/collect_distributed.py six-workers RUNS_DIR --preset P --steps S --h H --out FILE
    python benchmarks/distributed/collect_distributed.py three-hosts RUNS_DIR --preset P --h H --rounds R --out FILE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def traffic(out: Path, status: dict[str, Any]) -> dict[str, Any]:
    """Per-worker traffic, counted by the coordinator (bodies only) and checked against the workers' own counts."""
    block = status["block_fp32_bytes"]
    per_worker = []
    for w in status["workers"]:
        summary_path = out / f"{w['name']}.summary.json"
        summary = _load(summary_path) if summary_path.exists() else {}
        pushed = max(1, int(summary.get("rounds_pushed", w["updates_accepted"])))
        push = w["bytes_in"] / pushed  # the delta bodies (+ tiny JSON requests)
        # pulls: one full fp32 weights download at start, then one encoded step per closed round (+ JSON polls)
        pull = (w["bytes_out"] - block) / max(1, pushed - 1)
        per_worker.append({
            "worker": w["name"],
            "block": w["block"],
            "rounds_pushed": summary.get("rounds_pushed"),
            "rounds_stale": summary.get("rounds_stale"),
            "rounds_cut": summary.get("rounds_cut"),  # pushed early, before H steps, because the deadline was near
            "bytes_in": w["bytes_in"],
            "bytes_out": w["bytes_out"],
            "push_bytes_per_round": push,
            "pull_bytes_per_round_after_first": pull,
            "round_traffic_over_block_fp32": (push + pull) / block,
            "worker_counted_bytes": (summary.get("bytes_sent"), summary.get("bytes_received")),
        })
    return {"block_fp32_bytes": block, "per_worker": per_worker}


def six_workers(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.runs)
    status = _load(out / "six.status.json")
    single, six = _load(out / "single.eval.json"), _load(out / "six.eval.json")
    n_workers = len(status["workers"])
    replicas = {b["block"]: sum(1 for w in status["workers"] if w["block"] == b["block"]) for b in status["blocks"]}
    summaries = [_load(p) for p in sorted(out.glob("w*.summary.json"))]
    diff = six["ce_nats_per_byte"] - single["ce_nats_per_byte"]
    return {
        "preset": args.preset,
        "objective": args.objective,
        "single_machine_ce_nats_per_byte": single["ce_nats_per_byte"],
        "six_worker_ce_nats_per_byte": six["ce_nats_per_byte"],
        "ce_gap_nats_per_byte": diff,
        "target_gap_nats_per_byte": args.target_gap,
        "target_met": abs(diff) <= args.target_gap,
        "eval_split": "test",
        "eval_bytes": single["bytes_scored"],
        "total_steps": args.steps,
        "total_steps_note": "optimiser steps applied to every block, in sequence, in both runs (rounds x H)",
        "local_steps_h": args.h,  # 0: each block's own H, its steps // rounds (the coordinator's --local-steps 0)
        "rounds": args.rounds or args.steps // args.h,
        "outer_steps_per_block": [b["version"] for b in status["blocks"]],
        "workers": n_workers,
        "replicas_per_block": replicas,
        "worker_local_steps_total": sum(s["local_steps"] for s in summaries),
        "single_machine_steps_total": args.steps * len(status["blocks"]),
        "bytes_moved_total": status["bytes_in"] + status["bytes_out"],
        "bytes_in_total": status["bytes_in"],
        "bytes_out_total": status["bytes_out"],
        "ce_over_rounds": [
            {"epoch": e["epoch"], "versions": e["versions"], "ce_nats_per_byte": e["ce_nats_per_byte"]}
            for e in status["evals"]
        ],
        "ce_over_rounds_note": "coordinator's periodic eval: first 8192 validation bytes; epoch = min block version",
        "updates_accepted": status["updates_accepted"],
        "rejections": status["rejections"],
        "traffic": traffic(out, status),
        "wall_s": {"single": float((out / "single.wall_s").read_text()), "six": float((out / "six.wall_s").read_text())},
        "command": args.command,
    }


def three_hosts(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.runs)
    status = _load(out / "status.json")
    net = _load(out / "net.json")
    evals = status["evals"]
    moved = status["bytes_in"] + status["bytes_out"]
    return {
        "preset": args.preset,
        "objective": args.objective,
        "ce_start": evals[0]["ce_nats_per_byte"],
        "ce_end": evals[-1]["ce_nats_per_byte"],
        "ce_over_rounds": [{"epoch": e["epoch"], "ce_nats_per_byte": e["ce_nats_per_byte"]} for e in evals],
        "ce_note": "coordinator's periodic eval on the first 8192 validation bytes",
        "bytes_moved_total": moved,
        "gb_moved": moved / 1e9,
        "rtt_ms": net["rtt_ms"],
        "rtt_note": net["rtt_note"],
        "bandwidth_cap_mbit": net["rate_mbit"],
        "latency_emulation": net["latency_emulation"],
        "local_steps_h": args.h,
        "rounds": args.rounds,
        "workers": len(status["workers"]),
        "updates_accepted": status["updates_accepted"],
        "rejections": status["rejections"],
        "traffic": traffic(out, status),
        **_host_bytes(out),
        "wall_s": float((out / "wall_s").read_text()),
        "command": args.command,
    }


def _host_bytes(out: Path) -> dict[str, Any]:
    """Each host's veth end, rx + tx over the workers' run: all its traffic (HTTP to the coordinator and
    peer-to-peer), TCP/IP headers included, split evenly between the host's workers."""
    path = out / "host-bytes.json"
    if not path.exists():
        return {}
    b = _load(path)
    hosts = [(a["rx"] - s["rx"]) + (a["tx"] - s["tx"]) for s, a in zip(b["before"], b["after"], strict=True)]
    return {"host_link_bytes": hosts, "link_bytes_per_worker": sum(hosts) / (len(hosts) * b["workers_per_host"]),
            "link_bytes_note": "rx+tx of each host's veth end during the workers' run (headers included), "
                               "per worker = all hosts / workers"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("kind", choices=["six-workers", "three-hosts"])
    p.add_argument("runs")
    p.add_argument("--preset", required=True)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--h", type=int, required=True)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--command", required=True, help="the command line that produced the runs (recorded)")
    p.add_argument("--objective", default="diffusion", help="the block objective of the runs (recorded)")
    p.add_argument("--target-gap", type=float, default=0.03, help="six-workers: |six - single| CE target, nats/byte")
    args = p.parse_args()
    doc = six_workers(args) if args.kind == "six-workers" else three_hosts(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if not isinstance(v, (dict, list))}, indent=2))


if __name__ == "__main__":
    main()
