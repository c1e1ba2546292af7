"""The stack objective's local head: 0 or 1 private Transformer layers before LayerNorm + Linear (issue 11).

For each ``--head-layers`` value, trains a whole stack with the library's own
commands (``blocktrain train --objective stack``: progressive, block k on frozen
copies of blocks 0..k-1) and scores every prefix on the test split with
``blocktrain eval --blocks-alone``. Prints a table and writes JSON.

    python benchmarks/quality/stack_head_layers.py --json benchmarks/results/stack-head-layers-cpu-mini.json

CE figures do not depend on the machine's load; the wall times do.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from blocktrain.config import Objective
from blocktrain.objectives.stack import StackObjective
from blocktrain.presets import get_preset


def _run(cmd: list[str]) -> str:
    print("+", shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def measure(preset: str, head_layers: int, data: str, out: Path, max_bytes: int | None) -> dict[str, Any]:
    base = [sys.executable, "-m", "blocktrain"]
    run = out / f"stack-h{head_layers}"
    t0 = time.perf_counter()
    _run([*base, "train", "--preset", preset, "--objective", "stack", "--head-layers", str(head_layers), "--data", data,
          "--out", str(run), "--no-progress"])
    train_s = time.perf_counter() - t0
    ev_cmd = [*base, "eval", str(run), "--model", "blocktrain", "--split", "test", "--data", data, "--blocks-alone",
              "--json", "--no-progress"]
    ev = json.loads(_run(ev_cmd + (["--max-bytes", str(max_bytes)] if max_bytes else [])))
    cfg = get_preset(preset)
    cfg = replace(cfg, objective=Objective.STACK, stack=replace(cfg.stack, head_layers=head_layers))  # as trained
    obj = StackObjective(cfg)
    params = [sum(p.numel() for p in obj.build_block(k).parameters()) for k in range(cfg.model.n_blocks)]
    return {"head_layers": head_layers, "ce_nats_per_byte": ev["ce_nats_per_byte"], "prefix_ce": ev["prefix_ce"],
            "compositional_gain_nats_per_byte": ev["compositional_gain_nats_per_byte"], "bytes_scored": ev["bytes_scored"],
            "params_per_block": params, "train_flops_per_token_per_block": [obj.train_flops_per_token(k) for k in
                                                                             range(cfg.model.n_blocks)],
            "train_wall_s": train_s, "run_dir": str(run)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--head-layers", default="0,1", help="comma-separated values to measure")
    ap.add_argument("--data", default="../shared/data/wikitext/wikitext-2-v1-tokens")
    ap.add_argument("--out", default="runs/stack-head-layers", help="run directories go here")
    ap.add_argument("--max-bytes", type=int, default=None, help="score only the first N test bytes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [measure(args.preset, int(h), args.data, Path(args.out), args.max_bytes) for h in args.head_layers.split(",")]
    print(f"{'head layers':>11} | {'composed CE':>11} | {'prefix CE':<30} | {'gain':>7} | params/block")
    for r in rows:
        print(f"{r['head_layers']:>11} | {r['ce_nats_per_byte']:>11.4f} | {', '.join(f'{c:.3f}' for c in r['prefix_ce']):<30} "
              f"| {r['compositional_gain_nats_per_byte']:+.4f} | {r['params_per_block'][0]:,}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"preset": args.preset, "split": "test", "rows": rows,
                                         "command": "python " + shlex.join(sys.argv)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
