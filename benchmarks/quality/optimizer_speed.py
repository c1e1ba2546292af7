"""What a worker's inner optimiser step costs: :class:`blocktrain.train.inner.RoundAdamW` (the optimiser of a round
whose moments are shared, the default; also with a bucket's tensors forced into one launch per op, and one tensor
at a time) against torch's AdamW as the trainers build it (its fused kernel, on the CPU
as on CUDA), over the parameters of one block of each preset, on one device.

Gradients are random and fixed; the median of ``--reps`` steps, the device synchronised around each (a step is
timed to its end). Timing an older RoundAdamW (before its multi-tensor step) is running this script with that
commit's ``src`` first on ``PYTHONPATH`` (a git worktree); the JSON records which ``blocktrain`` it imported.

    python benchmarks/quality/optimizer_speed.py --device cpu --json benchmarks/results/optimizer-speed-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import blocktrain
from blocktrain.bench.machine import machine_info, median_seconds
from blocktrain.device import resolve_device
from blocktrain.objectives import build_block
from blocktrain.presets import get_preset
from blocktrain.train.inner import make_round_optimizer
from blocktrain.train.step import make_optimizer

PRESETS = ("cpu-mini", "cpu-small", "paper")


ROOT = Path(__file__).resolve().parents[2]  # the repository this script is in


def _source() -> dict[str, str]:
    """Which ``blocktrain`` was imported: its directory relative to this repository and, where it is a git checkout,
    its commit (``-dirty``: with uncommitted changes)."""
    where = Path(blocktrain.__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return {"path": os.path.relpath(where, ROOT), "commit": rev}


def measure(device: torch.device, reps: int, presets: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for name in presets:
        cfg = get_preset(name)
        block = build_block(cfg, 0).to(device)
        g = torch.Generator().manual_seed(0)
        params = [p for p in block.parameters() if p.requires_grad]
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
        row: dict[str, Any] = {"preset": name, "tensors": len(params), "parameters": sum(p.numel() for p in params)}
        for key, foreach in (("round_adamw_s", None), ("round_multi_tensor_s", True), ("round_per_tensor_s", False)):
            round_opt, _ = make_round_optimizer(block, cfg.train)
            round_opt.foreach = foreach  # None: the device's default (an older RoundAdamW ignores it)
            row[key] = median_seconds(round_opt.step, device, reps, warmup=2)
        trainer_opt, _ = make_optimizer(block, cfg.train)
        row["trainer_adamw_s"] = median_seconds(trainer_opt.step, device, reps, warmup=2)
        row["ratio"] = row["round_adamw_s"] / row["trainer_adamw_s"]
        rows.append(row)
        del block, round_opt, trainer_opt
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="where the parameters live (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--reps", type=int, default=20, help="timed steps per optimiser (the median is reported)")
    ap.add_argument("--preset", action="append", choices=PRESETS, help="time only this preset (repeatable)")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    device = resolve_device(args.device)
    rows = measure(device, args.reps, tuple(args.preset or PRESETS))
    print(f"| preset (block 0) | tensors | parameters | RoundAdamW ms | one launch per bucket ms | per tensor ms | "
          f"trainers' AdamW ms | ratio |  on {device}")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['tensors']} | {r['parameters']:,} | {r['round_adamw_s'] * 1e3:.3f} | "
              f"{r['round_multi_tensor_s'] * 1e3:.3f} | {r['round_per_tensor_s'] * 1e3:.3f} | "
              f"{r['trainer_adamw_s'] * 1e3:.3f} | {r['ratio']:.2f} |")
    if args.json:
        command = "python benchmarks/quality/optimizer_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = {"benchmark": "optimizer_speed", "device": str(device), "machine": machine_info(device), "reps": args.reps,
               "blocktrain": _source(), "rows": rows, "command": command}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
