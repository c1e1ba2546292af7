"""Staggered against progressive: one pool of workers on a whole stack, at equal compute, CE against wall time.

Each arm trains the preset's stack with :func:`blocktrain.coordinator.staggered.run_pool` (the coordinator's rounds
in process: int8 pushes with error feedback, its intake and outer step; every block spends W x R_k worker-rounds of
H steps): ``open_fraction`` 1 is the progressive schedule (all workers on the one open block), f < 1 opens block k
once block k-1 has spent f of its budget, as a copy of its current weights, on frozen inputs refreshed at each of its
versions, with the workers split over the open blocks. Wall time is counted in slots (rounds run in parallel); the
composed model and every prefix are scored on the first ``--eval-bytes`` test bytes.

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/staggered_schedule.py --preset depth-proxy --steps 1000 \\
        --fractions 1.0,0.5,0.25 --json benchmarks/results/staggered-schedule.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.coordinator.settings import Aggregation, CoordinatorSettings
from blocktrain.coordinator.simulate import LocalRun
from blocktrain.coordinator.staggered import PoolSchedule, run_pool
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.train.metrics import write_json


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two rows the same arm: rows from before the settings were recorded are kept beside new ones."""
    return (row["preset"], row["steps"], row["seed"], row["workers"], row["h"], row["open_fraction"], row["eval_bytes"],
            json.dumps(row.get("settings"), sort_keys=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="depth-proxy")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (split over blocks by stack.step_ratio)")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--h", type=int, default=10)
    ap.add_argument("--fractions", default="1.0,0.5", help="open fractions; 1.0 is the progressive schedule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aggregation", default="mean", choices=[a.value for a in Aggregation],
                    help="how a round's deltas combine (the committed rows ran with mean, the default then)")
    ap.add_argument("--eval-bytes", type=int, default=65536)
    ap.add_argument("--data", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True, help="rows are added to (or replaced in) this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = get_preset(args.preset)
    cfg = replace(base, train=replace(base.train, seed=args.seed, steps=args.steps or base.train.steps))
    objective = get_objective(cfg)
    data = resolve_data_dir(args.data)
    settings = CoordinatorSettings(gate=False, audit_fraction=0.0, aggregation=Aggregation(args.aggregation))
    command = "python benchmarks/distributed/staggered_schedule.py " + " ".join(sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc: dict[str, Any] = json.loads(args.json.read_text()) if args.json.is_file() else {"what": __doc__.split("\n\n")[0]}
    rows: list[dict[str, Any]] = doc.setdefault("rows", [])
    for f in (float(x) for x in args.fractions.split(",")):
        t0 = time.perf_counter()
        pool = run_pool(cfg, settings, PoolSchedule(args.workers, args.h, f), data)
        prefix = []
        for k, block in enumerate(pool.blocks):
            frozen = [objective.freeze(b, torch.float32) for b in pool.blocks[:k]]
            prefix.append(LocalRun(block, {}).test_ce(cfg, data, args.eval_bytes, k=k, frozen=frozen))
        row = {"preset": cfg.name, "steps": cfg.train.steps, "seed": args.seed, "workers": args.workers, "h": args.h,
               "open_fraction": f, "schedule": "progressive" if f >= 1 else "staggered", "ce_nats_per_byte": prefix[-1],
               "prefix_ce": prefix, "slots": pool.slots, "worker_rounds": pool.worker_rounds, "rounds": pool.rounds,
               "opened_at": pool.opened_at, "eval_split": "test", "eval_bytes": args.eval_bytes,
               "cpu_wall_s": time.perf_counter() - t0, "command": command, "settings": settings.to_dict(),
               "commit": commit}
        rows[:] = [r for r in rows if _key(r) != _key(row)]  # the same arm run again, with the same settings
        rows.append(row)
        write_json(args.json, doc)
        print(f"open fraction {f}: CE {prefix[-1]:.4f} in {pool.slots} slots", file=sys.stderr, flush=True)
    print("| schedule | open fraction | W | H | slots (wall time, rounds) | worker-rounds | composed CE | prefixes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["open_fraction"]):
        print(f"| {r['schedule']} | {r['open_fraction']} | {r['workers']} | {r['h']} | {r['slots']} | "
              f"{sum(r['worker_rounds'])} | {r['ce_nats_per_byte']:.4f} | {', '.join(f'{c:.4f}' for c in r['prefix_ce'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
