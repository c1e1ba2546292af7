"""Training memory of a block worker, for every block k, against the E2E trainer's: the product's own measurement.

Each arm trains in a fresh child process (``blocktrain.train.block.train_block`` or ``train_e2e``) for ``--steps``
optimiser steps of the preset's shape, and reports the trainer's ``train_mem_bytes``: peak RSS minus the RSS after
the runtime was warmed, frozen copies of the earlier blocks included (they are loaded after the baseline). Block k
reads blocks 0..k-1, trained for the same few steps in the same run directory: memory does not depend on the
weights' values. ``--frozen`` sets how the frozen copies are stored (``TrainConfig.frozen_storage``); the CE cost of
a storage is measured by ``blocktrain eval`` on a trained run, not here.

    flock /tmp/blocktrain-cpu.lock python benchmarks/quality/worker_memory.py --preset cpu-small --frozen auto,int8 \\
        --json benchmarks/results/worker-memory-cpu-small.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any


def child(preset: str, arm: str, steps: int, out: Path, variant: str, data: str | None) -> dict[str, Any]:
    """Train one arm in this process and return its memory (called in a fresh process by :func:`main`)."""
    import torch

    from blocktrain.config import FrozenStorage
    from blocktrain.data.dataset import resolve_data_dir
    from blocktrain.presets import get_preset
    from blocktrain.train.block import train_block
    from blocktrain.train.e2e import train_e2e

    torch.set_num_threads(2)
    cfg = get_preset(preset)
    frozen, _, recompute = variant.partition("+")
    cfg = replace(cfg, train=replace(cfg.train, steps=steps, eval_bytes=0, checkpoint_every=10**6,
                                     frozen_storage=FrozenStorage(frozen), recompute=recompute == "recompute"))
    ds = resolve_data_dir(data)
    summary = train_e2e(cfg, ds, out, progress=False) if arm == "e2e" else train_block(cfg, ds, out, int(arm),
                                                                                     progress=False)
    return {"arm": arm, "variant": variant, "train_mem_bytes": summary.train_mem_bytes, "peak_rss": summary.peak_rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--steps", type=int, default=6, help="optimiser steps per arm (memory peaks in the first)")
    ap.add_argument("--variants", default="auto,int8,auto+recompute,int8+recompute",
                    help="comma-separated FROZEN_STORAGE[+recompute] to measure")
    ap.add_argument("--data", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # ARM:FROZEN:OUT, run by main in a fresh process
    args = ap.parse_args()
    if args.child:
        arm, frozen, out = args.child.split(":", 2)
        print(json.dumps(child(args.preset, arm, args.steps, Path(out), frozen, args.data)))
        return 0
    rows: list[dict[str, Any]] = []

    def run(arm: str, variant: str, out: Path) -> dict[str, Any]:
        cmd = [sys.executable, __file__, "--preset", args.preset, "--steps", str(args.steps), "--child",
               f"{arm}:{variant}:{out}"] + (["--data", args.data] if args.data else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{arm:>4} {variant:<15} {row['train_mem_bytes'] / 2**20:8.1f} MiB", file=sys.stderr, flush=True)
        return row

    variants = args.variants.split(",")
    from blocktrain.presets import get_preset

    n_blocks = get_preset(args.preset).model.n_blocks  # every block of the preset, however many it has
    with tempfile.TemporaryDirectory(prefix="worker-memory-") as tmp:
        e2e = run("e2e", "auto", Path(tmp) / "e2e")  # the E2E trainer as it runs by default: the reference
        e2e_recompute = run("e2e", "auto+recompute", Path(tmp) / "e2e-recompute")
        for variant in variants:
            out = Path(tmp) / f"blocks-{variant}"
            for k in range(n_blocks):
                row = run(str(k), variant, out)
                row["ratio_over_e2e"] = row["train_mem_bytes"] / e2e["train_mem_bytes"]
                rows.append(row)
    worst = {v: max(r["ratio_over_e2e"] for r in rows if r["variant"] == v) for v in variants}
    doc = {"what": __doc__.split("\n\n")[0], "preset": args.preset, "steps": args.steps,
           "command": "python benchmarks/quality/worker_memory.py " + " ".join(sys.argv[1:]),
           "e2e_train_mem_bytes": e2e["train_mem_bytes"], "e2e_recompute_train_mem_bytes": e2e_recompute["train_mem_bytes"],
           "rows": rows, "worst_ratio": worst}
    print("| variant | " + " | ".join(f"block {k}" for k in range(n_blocks)) + " | worst / E2E |")
    print("|---|" + "---|" * (n_blocks + 1))
    for v in variants:
        mib = [f"{r['train_mem_bytes'] / 2**20:.1f} MiB ({r['ratio_over_e2e']:.3f})" for r in rows if r["variant"] == v]
        print(f"| {v} | " + " | ".join(mib) + f" | {worst[v]:.3f} |")
    print(f"E2E trainer: {e2e['train_mem_bytes'] / 2**20:.1f} MiB; with recompute "
          f"{e2e_recompute['train_mem_bytes'] / 2**20:.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
