"""The replay check's threshold: how close honest updates come to earlier accepted ones, and how close a replay is.

The coordinator refuses an update whose count sketch has a cosine above ``--replay-cosine`` with any accepted delta of
its block (``coordinator/intake.py``). This script measures, through the coordinator's own intake in the in-process
rounds (:func:`blocktrain.coordinator.simulate.run_local_rounds`, int8 pushes with error feedback, replay check off),
the largest cosine every honest update had with the block's earlier accepted deltas, of any worker and version, on
block 0 (cold) and block 1 (copy-initialised, on frozen block 0) of each preset. Beside them: the cosine of an
accepted delta pushed again (relabelled with a new version), and of the same delta re-encoded through int8 with a
fresh error feedback, as a replaying worker would send them.

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/replay_threshold.py --json benchmarks/results/replay-threshold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.coordinator.intake import CountSketch
from blocktrain.coordinator.settings import Aggregation, CoordinatorSettings
from blocktrain.coordinator.simulate import LocalRounds, run_local_rounds
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import Compression, ErrorFeedback, decode_delta
from blocktrain.protocol.weights import block_schema, trainable_state
from blocktrain.seeds import init_seed

SHAPES = {"tiny": (3, 5, 60), "depth-proxy": (6, 10, 300), "cpu-mini": (6, 25, 200)}  # preset -> (M, H, steps)


def replay_cosines(delta: dict[str, torch.Tensor], sketcher: CountSketch) -> tuple[float, float]:
    """The sketch cosine of a delta with itself pushed again, and with itself re-encoded through int8."""
    s = sketcher(delta)
    again = float(s @ sketcher({n: t.clone() for n, t in delta.items()}))
    requantised = decode_delta(ErrorFeedback(Compression.INT8).encode(delta), Compression.INT8)
    return again, float(s @ sketcher(requantised))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,depth-proxy,cpu-mini")
    ap.add_argument("--data", default=None, help="data directory (default: $BLOCKTRAIN_DATA)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = resolve_data_dir(args.data)
    settings = CoordinatorSettings(replay_cosine=1.0, gate=False, audit_fraction=0.0, aggregation=Aggregation.MEAN)
    rows: list[dict[str, Any]] = []
    for name in args.presets.split(","):
        cfg = get_preset(name)
        cfg = replace(cfg, objective=get_preset("cpu-mini").objective, stack=get_preset("cpu-mini").stack)  # a stack
        objective = get_objective(cfg)
        m, h, steps = SHAPES[name]
        rounds = LocalRounds(workers=m, local_steps=h, steps=steps)
        earlier: list[torch.nn.Module] = []
        for k in (0, 1):
            frozen = [objective.freeze(b, torch.float32) for b in earlier]
            run = run_local_rounds(cfg, settings, rounds, data, k=k, frozen=frozen, earlier=earlier)
            cos = [u.replay_cos for u in run.updates if u.replay_cos is not None]
            sketcher = CountSketch(block_schema(run.block), settings.sketch_dim, seed=k)
            torch.manual_seed(init_seed(cfg.train.seed, k))  # version 0, as the coordinator builds it
            start = objective.build_block(k)
            if earlier:
                objective.inherit(start, k, earlier, at_init=True)
            w0, w1 = trainable_state(start), run.weights
            again, requantised = replay_cosines({n: w1[n] - w0[n] for n in w0}, sketcher)  # the whole run's delta
            row = {"preset": name, "block": k, "workers": m, "h": h, "steps": steps, "updates": len(cos),
                   "honest_max_cos": max(cos), "honest_p99_cos": statistics.quantiles(cos, n=100, method="inclusive")[98],
                   "honest_median_cos": statistics.median(cos), "replay_cos": again, "requantised_replay_cos": requantised}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            earlier.append(run.block)
    honest = max(r["honest_max_cos"] for r in rows)
    doc = {"what": __doc__.split("\n\n")[0], "command": "python benchmarks/distributed/replay_threshold.py " + " ".join(sys.argv[1:]),
           "rows": rows, "honest_max_cos": honest,
           "replay_min_cos": min(min(r["replay_cos"], r["requantised_replay_cos"]) for r in rows)}
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print("| preset | block | M | H | updates | honest median | honest p99 | honest max | replay | requantised replay |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['block']} | {r['workers']} | {r['h']} | {r['updates']} | {r['honest_median_cos']:.4f} "
              f"| {r['honest_p99_cos']:.4f} | {r['honest_max_cos']:.4f} | {r['replay_cos']:.6f} "
              f"| {r['requantised_replay_cos']:.6f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
