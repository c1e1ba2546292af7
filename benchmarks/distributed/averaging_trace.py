"""Averaging trace: how far M workers move a block per round, against one machine at M times the batch.

Drives :class:`blocktrain.coordinator.simulate.BlockRun` (the coordinator's round in process) one round at a time and,
every ``--every`` rounds, records the block's test CE on the first ``--eval-bytes`` test bytes, the norm of the
published step ||W_{v+1} - W_v||, the weight norm ||W||, and for M workers the mean of their deltas' norms
mean_i ||Delta_i|| beside the norm of their aggregate ||Delta_bar|| (their ratio is 1 when the workers agree,
1/sqrt(M) when their deltas are orthogonal). Arms:

* ``m``: M workers under the outer step of ``--outer-lr`` / ``--outer-momentum``, fresh inner moments each round
  unless ``--carry-inner`` (the averaging study's ``mM`` row);
* ``xM`` and ``x1``: one machine at M times the batch and at the workers' batch, the same steps in rounds of the same
  H, plain and lossless, inner moments carried: the same training as the study's one-round ``xM`` / ``x1`` rows,
  except that every round draws its batches from that round's stream.

    python -m benchmarks.distributed.averaging_trace --preset cpu-mini --steps 690 --h 6 --seeds 0,2 \\
        --json benchmarks/results/averaging-trace.json

Prints, per seed and arm, the trace at a few rounds; writes every point and the command to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.distributed.averaging_scaling import settings_for
from blocktrain.config import RunConfig
from blocktrain.coordinator.simulate import BlockRun
from blocktrain.data.dataset import DataDir, resolve_data_dir
from blocktrain.presets import get_preset
from blocktrain.progress import progress_bar


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors.values()))


def trace_arm(cfg: RunConfig, row: dict[str, Any], data: DataDir, every: int, eval_bytes: int,
              progress: bool) -> list[dict[str, float]]:
    """Train one arm round by round; a point every ``every`` rounds and at the last."""
    settings, opts = settings_for(row)
    if row["kind"] == "x":  # the one-machine row in rounds of H (lossless, moments carried): the same training
        opts = replace(opts, local_steps=row["h"], reset_inner=False)
    block = BlockRun(cfg, settings, opts, data)
    points = []
    bar = progress_bar(total=opts.rounds, desc=f"{row['kind']}{row['workers']} seed {row['seed']}", unit="round",
                       disable=not progress, dynamic_ncols=True)
    for v, (offset, h) in enumerate(zip(block.offsets, opts.round_steps, strict=True)):
        before, buf = block.W, block.state.momentum
        n_updates = len(block.run.updates)
        block.round(h, offset)
        bar.update(1)
        if (v + 1) % every and v + 1 != opts.rounds:
            continue
        point = {"round": v + 1, "inner_steps": offset + h, "step_norm": _norm({n: block.W[n] - before[n] for n in before}),
                 "weight_norm": _norm(block.W)}
        if row["kind"] == "m" and block.state.momentum is not None:  # Delta_bar from the Nesterov buffer: m' = mu m - Delta_bar
            mu = settings.outer_momentum
            pushed = [u.norm for u in block.run.updates[n_updates:] if u.outcome == "accepted"]
            prev = buf or {n: torch.zeros_like(t) for n, t in block.state.momentum.items()}
            point["delta_bar_norm"] = _norm({n: m - mu * prev[n] for n, m in block.state.momentum.items()})
            point["mean_delta_norm"] = sum(pushed) / len(pushed)
        point["ce_nats_per_byte"] = block.finish().test_ce(cfg, data, eval_bytes)
        points.append(point)
    bar.close()
    return points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--steps", type=int, default=690, help="inner steps per worker (cpu-mini's block 0 in the stack: 690)")
    ap.add_argument("--h", type=int, default=6, help="inner steps per round")
    ap.add_argument("--workers", type=int, default=6, help="M")
    ap.add_argument("--outer-lr", type=float, default=0.85)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--carry-inner", action="store_true", help="inner moments carried across rounds (default: fresh)")
    ap.add_argument("--arms", default="m,xM,x1", help="comma-separated: m, xM, x1")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--every", type=int, default=5, help="rounds between points")
    ap.add_argument("--eval-bytes", type=int, default=8192, help="test bytes scored at each point")
    ap.add_argument("--data", default=None, help="data directory (default: $BLOCKTRAIN_DATA)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = resolve_data_dir(args.data)
    base = get_preset(args.preset)
    common = {"preset": base.name, "block": "cold", "steps": args.steps, "batch": base.train.batch_size, "h": args.h}
    arms = {"m": {"kind": "m", "workers": args.workers, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
                  "reset_inner": not args.carry_inner},
            "xM": {"kind": "x", "workers": args.workers}, "x1": {"kind": "x", "workers": 1}}
    traces = []
    for seed in (int(s) for s in args.seeds.split(",")):
        cfg = replace(base, train=replace(base.train, seed=seed))
        for name in args.arms.split(","):
            row = {**common, **arms[name], "seed": seed}
            traces.append({**row, "arm": name, "points": trace_arm(cfg, row, data, args.every, args.eval_bytes,
                                                                    not args.no_progress)})
            args.json.write_text(json.dumps({"command": "python -m benchmarks.distributed.averaging_trace "
                                             + " ".join(sys.argv[1:]), "eval_split": "test",
                                             "eval_bytes": args.eval_bytes, "traces": traces}, indent=1) + "\n")
    print(trace_table(traces))
    return 0


def trace_table(traces: list[dict[str, Any]], rounds: tuple[int, ...] = (10, 25, 50, 75, 100)) -> str:
    lines = ["| seed | arm | round | CE | step norm | weight norm | mean ‖Δ_i‖ | ‖Δ̄‖ / mean ‖Δ_i‖ |",
             "|---|---|---|---|---|---|---|---|"]
    for t in traces:
        last = t["points"][-1]["round"]
        for p in (p for p in t["points"] if p["round"] in rounds or p["round"] == last):
            ratio = f"{p['delta_bar_norm'] / p['mean_delta_norm']:.2f}" if "delta_bar_norm" in p else ""
            mean = f"{p['mean_delta_norm']:.2f}" if "mean_delta_norm" in p else ""
            lines.append(f"| {t['seed']} | {t['arm']} | {p['round']} | {p['ce_nats_per_byte']:.4f} | {p['step_norm']:.3f} "
                         f"| {p['weight_norm']:.1f} | {mean} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
