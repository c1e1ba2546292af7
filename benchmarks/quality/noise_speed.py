"""What the diffusion objective's noise costs per step: the counter generator on the device (``blocktrain.noise``)
against the host draw it replaced (``torch.randn`` with the seeded CPU generator, then a copy to the device).

One eps (batch, context, d_model) per training step, at each preset's shape; the median of ``--reps`` draws, the
device synchronised around each (a draw on the device is timed to its end).

    python benchmarks/quality/noise_speed.py --device cpu --json benchmarks/results/noise-speed-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from blocktrain.bench.machine import machine_info, median_seconds
from blocktrain.device import resolve_device
from blocktrain.noise import normal
from blocktrain.presets import get_preset

PRESETS = ("cpu-mini", "cpu-small", "paper")


def measure(device: torch.device, reps: int, presets: tuple[str, ...] = PRESETS) -> list[dict[str, Any]]:
    rows = []
    for name in presets:
        cfg = get_preset(name)
        shape = (cfg.train.batch_size, cfg.model.context, cfg.model.d_model)
        g = torch.Generator().manual_seed(0)
        counter = median_seconds(lambda: normal(shape, g, device), device, reps)  # noqa: B023 (called in this iteration)
        host = median_seconds(lambda: torch.randn(*shape, generator=g).to(device), device, reps)  # noqa: B023
        rows.append({"preset": name, "shape": list(shape), "elements": shape[0] * shape[1] * shape[2],
                     "counter_on_device_s": counter, "host_randn_and_copy_s": host, "ratio": counter / host})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="where the counter generator draws (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--reps", type=int, default=10, help="timed draws per preset (the median is reported)")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    rows = measure(device, args.reps)
    print(f"| preset | eps shape | counter on {device} ms | host randn + copy ms | ratio |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {tuple(r['shape'])} | {r['counter_on_device_s'] * 1e3:.2f} | "
              f"{r['host_randn_and_copy_s'] * 1e3:.2f} | {r['ratio']:.2f} |")
    if args.json:
        command = "python benchmarks/quality/noise_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = {"benchmark": "noise_speed", "device": str(device), "machine": machine_info(device), "reps": args.reps,
               "rows": rows, "command": command}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
