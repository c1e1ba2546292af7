"""One hostile worker out of six on real training (issue 19): what each defence catches, and the final CE.

Each run trains block 0 of a ``stack`` run with six replicas through the coordinator's
own round (:func:`blocktrain.coordinator.simulate.run_local_rounds`): the same
parsing and intake (:mod:`blocktrain.coordinator.intake`), the same
aggregation and outer step. The last replica is hostile in every run but ``honest``:

* ``scaled_random``: Gaussian noise at 100x its honest update's norm;
* ``sign_flip``: minus its honest update;
* ``shuffled_labels``: trained on targets shuffled within each batch.

It scores block 0's own CE on the first ``--eval-bytes`` test bytes. The slow-worker
run needs real processes and deadlines: ``scripts/exp_slow_worker.sh``, merged here
with ``--merge``.

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/hostile_peers.py --preset cpu-mini \\
        --outer nesterov --outer-lr 0.7 --outer-momentum 0.9 --gate-tolerance 0.0 \\
        --out benchmarks/results/hostile-peers.json
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from pathlib import Path
from typing import Any

import torch

from blocktrain.coordinator.settings import Aggregation, CoordinatorSettings, OuterOptimizer
from blocktrain.coordinator.simulate import LocalRounds, run_local_rounds
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import delta_norm

RANDOM_SCALE = 100.0  # ||poison|| / ||honest Delta|| of a scaled random update


class Poison(enum.Enum):
    """What the hostile replica does instead of training honestly (a ``simulate.Hostile``)."""

    SCALED_RANDOM = "scaled_random"  # Gaussian noise with 100x the honest update's norm
    SIGN_FLIP = "sign_flip"  # -Delta: undoes its own training
    SHUFFLED_LABELS = "shuffled_labels"  # trained honestly, on targets shuffled within each batch

    def targets(self, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The targets it trains on: shuffled across the batch for shuffled labels, else the true ones."""
        if self is not Poison.SHUFFLED_LABELS:
            return y
        perm = torch.randperm(y.numel(), generator=generator)
        return y.reshape(-1)[perm].reshape(y.shape)  # (b*t,) -> (b, t)

    def delta(self, delta: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The update it pushes in place of ``delta`` (shuffled labels poison the data instead)."""
        if self is Poison.SIGN_FLIP:
            return {n: -d for n, d in delta.items()}
        if self is Poison.SCALED_RANDOM:
            noise = {n: torch.randn(d.shape, generator=generator) for n, d in delta.items()}
            scale = RANDOM_SCALE * delta_norm(delta) / max(delta_norm(noise), 1e-30)
            return {n: scale * z for n, z in noise.items()}
        return delta


KINDS = ["honest", "honest5", *(p.value for p in Poison)]  # honest5: the run without the hostile worker


def run_kind(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = get_preset(args.preset)
    cfg = cfg.with_train(seed=args.seed)
    settings = CoordinatorSettings(outer=OuterOptimizer(args.outer), outer_lr=args.outer_lr,
                                   outer_momentum=args.outer_momentum, gate_tolerance=args.gate_tolerance,
                                   aggregation=Aggregation(args.aggregation))
    honest = kind.startswith("honest")
    opts = LocalRounds(workers=5 if kind == "honest5" else 6, local_steps=args.h, steps=args.steps)
    data = resolve_data_dir(args.data)
    run = run_local_rounds(cfg, settings, opts, data, progress=not args.no_progress,
                           hostile=None if honest else Poison(kind))
    ce = run.test_ce(cfg, data, args.eval_bytes)
    hostile = opts.workers - 1 if not honest else -1  # the replica that pushed the poisoned updates
    bad = [u for u in run.updates if u.replica == hostile]
    good = [u for u in run.updates if u.replica != hostile]
    caught: dict[str, int] = {}
    for u in bad:
        if u.outcome != "accepted":
            caught[u.outcome] = caught.get(u.outcome, 0) + 1
    honest_gate = [u.gate[1] - u.gate[0] for u in good if u.gate is not None]
    return {
        "kind": kind,
        "aggregation": args.aggregation,
        "seed": args.seed,
        "final_ce_nats_per_byte": ce,
        "poisoned_updates": len(bad),
        "poisoned_caught": sum(caught.values()),
        "poisoned_caught_by": caught,
        "poisoned_accepted_within_norm_bound": sum(1 for u in bad if u.outcome == "accepted"),
        "poisoned_accepted_rounds": sorted({u.round for u in bad if u.outcome == "accepted"}),
        "honest_updates": len(good),
        "honest_rejected": sum(1 for u in good if u.outcome != "accepted"),
        "honest_rejected_by": {r: sum(1 for u in good if u.outcome == r) for r in {u.outcome for u in good} - {"accepted"}},
        "honest_gate_change_max": max(honest_gate) if honest_gate else None,
        "skipped_rounds": run.skipped_rounds,
        "wall_s": run.wall_s,
        "command": (f"python benchmarks/distributed/hostile_peers.py --preset {args.preset} --steps {args.steps} --h {args.h} "
                    f"--outer {args.outer} --outer-lr {args.outer_lr} --outer-momentum {args.outer_momentum} "
                    f"--eval-bytes {args.eval_bytes} --kinds {kind}"
                    + (f" --gate-tolerance {args.gate_tolerance}" if args.gate_tolerance is not None else "")
                    + (f" --aggregation {args.aggregation}" if args.aggregation != "mean" else "")
                    + (f" --seed {args.seed}" if args.seed else "")),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--steps", type=int, default=400, help="inner steps per replica")
    ap.add_argument("--h", type=int, default=25, help="H: inner steps per round")
    ap.add_argument("--outer", default="nesterov", choices=[o.value for o in OuterOptimizer])
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--gate-tolerance", type=float, default=None,
                    help="nats the held-out loss may rise (default: the coordinator's calibrated tolerance)")
    ap.add_argument("--aggregation", default="mean", choices=[a.value for a in Aggregation])
    ap.add_argument("--eval-bytes", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0, help="train.seed: the blocks' init and every worker's stream")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--data", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="hostile-peers.json (runs of other kinds are kept)")
    ap.add_argument("--merge", type=Path, default=None, help="a run (JSON) to add as is, e.g. the slow worker's")
    ap.add_argument("--honest-from", default=None, metavar="JSONL:ROW",
                    help="take the honest run from this averaging-study row (same settings, gate on) instead of rerunning it")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": []}
    runs = {_key(r): r for r in doc["runs"]}
    if args.honest_from:
        path, _, name = args.honest_from.partition(":")
        row = next(json.loads(x) for x in Path(path).read_text().splitlines() if x.strip() and json.loads(x)["row"] == name)
        if row.get("gate_tolerance") != args.gate_tolerance or row["h"] != args.h or row["outer_lr"] != args.outer_lr:
            ap.error(f"row {name} was not run with these settings (gate, H, outer lr)")
        runs["honest"] = {"kind": "honest", "final_ce_nats_per_byte": row["ce_nats_per_byte"], "poisoned_updates": 0,
                          "poisoned_caught": 0, "honest_updates": row["updates"], "honest_rejected": row["rejected"],
                          "command": row["command"], "from": args.honest_from}
    if args.merge:
        extra = json.loads(args.merge.read_text())
        runs[extra["kind"]] = extra
    else:
        for kind in args.kinds.split(","):
            if kind not in KINDS:
                ap.error(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
            print("+", kind, file=sys.stderr, flush=True)
            row = run_kind(kind, args)
            runs[_key(row)] = row
    for r in runs.values():
        ref = runs.get(_key({**r, "kind": "honest"}), {}).get("final_ce_nats_per_byte")
        r["honest_ce_nats_per_byte"] = r.get("honest_ce_nats_per_byte", ref)
        ref5 = runs.get(_key({**r, "kind": "honest5"}), {}).get("final_ce_nats_per_byte")
        if ref5 is not None:
            r["without_hostile_ce_nats_per_byte"] = ref5  # the fair reference: the run without the hostile worker
    doc["runs"] = list(runs.values())
    doc["what"] = ("six replicas of block 0 (stack, first prefix), the last one hostile; defences: the norm bound "
                   "and the loss gate of blocktrain.coordinator.intake; CE on the first eval bytes of the test split")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("| aggregation | seed | kind | final CE | honest CE | diff | vs 5 honest | poisoned | caught | accepted within bound "
          "| honest rejected |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        h = r.get("honest_ce_nats_per_byte")
        diff = "—" if h is None else f"{r['final_ce_nats_per_byte'] - h:+.4f}"
        h5 = r.get("without_hostile_ce_nats_per_byte")
        diff5 = "—" if h5 is None else f"{r['final_ce_nats_per_byte'] - h5:+.4f}"
        print(f"| {r.get('aggregation', 'mean')} | {r.get('seed', 0)} | {r['kind']} | {r['final_ce_nats_per_byte']:.4f} "
              f"| {h if h is None else f'{h:.4f}'} | {diff} | {diff5} "
              f"| {r.get('poisoned_updates', '—')} | {r.get('poisoned_caught', '—')} "
              f"| {r.get('poisoned_accepted_within_norm_bound', '—')} | {r.get('honest_rejected', '—')} |")
    return 0


def _key(r: dict[str, Any]) -> str:
    seed = r.get("seed", 0)
    return f"{r.get('aggregation', 'mean')}/{r['kind']}" + (f"/s{seed}" if seed else "")


if __name__ == "__main__":
    raise SystemExit(main())
