"""Averaging study (issue 19): the outer step, H and the transport, against one machine at six times the batch.

Each row trains block 0 of a ``stack`` run with :func:`blocktrain.coordinator.simulate.run_local_rounds`:
M replicas in one process, exactly the rounds the coordinator and its workers run
(same streams, inner AdamW, delta codec with error feedback, ``next_version``), on
the same train bytes, ``--steps`` inner steps per replica whatever H. It scores
block 0's own next-byte CE (the first prefix) on the first ``--eval-bytes`` test
bytes. References, on the same code path:

* ``ref-b96``: one replica, one round of all the steps at six times the batch, plain
  average, lossless transport: ordinary training on the samples six workers see;
* ``single-b16``: the same at the workers' batch;
* ``m1-*``: one replica with the outer step of the row it names, which separates the
  outer optimiser's own effect from averaging.

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/averaging_study.py --preset cpu-mini \\
        --jsonl benchmarks/results/averaging-study.jsonl --plot benchmarks/results/averaging-frontier.png

Rows already in ``--jsonl`` are skipped (the study resumes). Prints the table of every row.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import Objective, RunConfig
from blocktrain.coordinator.settings import CoordinatorSettings, OuterOptimizer
from blocktrain.coordinator.simulate import LocalRounds, run_local_rounds
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import Compression
from blocktrain.train.metrics import append_jsonl, read_jsonl

AVG = {"outer": OuterOptimizer.AVERAGE, "outer_lr": 1.0}
BF16 = {"push": Compression.BF16, "step": Compression.BF16}  # the transport before issue 19
INT8 = {"push": Compression.INT8, "step": Compression.INT8}
NONE = {"push": Compression.NONE, "step": Compression.NONE}


def nesterov(lr: float, mu: float) -> dict[str, Any]:
    return {"outer": OuterOptimizer.NESTEROV, "outer_lr": lr, "outer_momentum": mu}


def _rows() -> dict[str, dict[str, Any]]:
    """name -> row spec: workers, H, batch multiple, outer settings, transport."""
    rows: dict[str, dict[str, Any]] = {
        "ref-b96": {"workers": 1, "h": 0, "batch_x": 6, "outer": AVG, "transport": NONE},
        "single-b16": {"workers": 1, "h": 0, "batch_x": 1, "outer": AVG, "transport": NONE},
        "avg-h25": {"workers": 6, "h": 25, "batch_x": 1, "outer": AVG, "transport": BF16},
    }
    for lr in (0.3, 0.5, 0.7, 1.0):
        for mu in (0.0, 0.9):
            rows[f"nesterov-lr{lr}-mu{mu}-h25"] = {"workers": 6, "h": 25, "batch_x": 1, "outer": nesterov(lr, mu),
                                                   "transport": BF16}
    return rows


ROWS = _rows()


def add_rows(lr: float, mu: float) -> None:
    """Rows around the chosen outer step: the H sweep, the M=1 reference and the int8 transport."""
    tag = f"nesterov-lr{lr}-mu{mu}"
    for h in (10, 50, 100):
        ROWS[f"{tag}-h{h}"] = {"workers": 6, "h": h, "batch_x": 1, "outer": nesterov(lr, mu), "transport": BF16}
    for h in (10, 25, 50, 100):
        ROWS[f"{tag}-h{h}-int8"] = {"workers": 6, "h": h, "batch_x": 1, "outer": nesterov(lr, mu), "transport": INT8}
    ROWS[f"m1-{tag}-h25"] = {"workers": 1, "h": 25, "batch_x": 1, "outer": nesterov(lr, mu), "transport": BF16}


def measure(name: str, cfg: RunConfig, args: argparse.Namespace, command: str) -> dict[str, Any]:
    spec = ROWS[name]
    h = spec["h"] or args.steps
    settings = CoordinatorSettings(**spec["outer"], step_compression=spec["transport"]["step"],
                                   gate_tolerance=args.gate_tolerance)
    opts = LocalRounds(workers=spec["workers"], local_steps=h, steps=args.steps, compression=spec["transport"]["push"],
                       batch_size=cfg.train.batch_size * spec["batch_x"])
    data = resolve_data_dir(args.data)
    torch.set_num_threads(args.threads)
    run = run_local_rounds(cfg, settings, opts, data, progress=not args.no_progress)
    ce = run.test_ce(cfg, data, args.eval_bytes)
    fp32 = sum(4 * w.numel() for w in run.weights.values())
    per_round = run.bytes_per_worker_round()
    raw = run.bytes_per_worker_round(wire=False)
    return {
        "row": name, "preset": cfg.name, "block": 0, "workers": spec["workers"], "h": h, "rounds": opts.rounds,
        "steps_per_worker": args.steps, "batch_size": opts.batch_size,
        "outer": spec["outer"]["outer"].value, "outer_lr": settings.outer_lr,
        "outer_momentum": settings.outer_momentum if settings.outer is OuterOptimizer.NESTEROV else None,
        "push": opts.compression.value, "step": settings.step_compression.value,
        "ce_nats_per_byte": ce, "eval_split": "test", "eval_bytes": args.eval_bytes,
        "block_fp32_bytes": fp32, "bytes_per_worker_round": per_round,
        "round_traffic_over_block_fp32": per_round / fp32 if spec["workers"] > 1 else None,
        "raw_round_traffic_over_block_fp32": raw / fp32 if spec["workers"] > 1 else None,  # safetensors, not deflated
        "bytes_per_worker_total": per_round * opts.rounds, "wall_s": run.wall_s,
        "gate_tolerance": args.gate_tolerance,  # None: no loss gate
        "updates": len(run.updates), "rejected": sum(1 for u in run.updates if u.outcome != "accepted"),
        "command": f"{command} --rows {name}",
    }


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "—" if x is None else format(x, fmt)


def _traffic(r: dict[str, Any]) -> tuple[float | None, float | None]:
    """(raw, deflated) round traffic over the block's fp32 size; rows measured before deflate hold raw only."""
    if "raw_round_traffic_over_block_fp32" in r:
        return r["raw_round_traffic_over_block_fp32"], r["round_traffic_over_block_fp32"]
    return r["round_traffic_over_block_fp32"], None


def table(rows: list[dict[str, Any]]) -> str:
    ref = next((r["ce_nats_per_byte"] for r in rows if r["row"] == "ref-b96"), None)  # the stack's block 0
    head = ("| row | M | H | outer | lr | mu | push/step | CE (test) | gap to batch-96 "
            "| round traffic / block fp32: raw | deflated | MB per worker | wall s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        gap = None if ref is None or "/" in r["row"] else r["ce_nats_per_byte"] - ref
        raw, wire = _traffic(r)
        lines.append(
            f"| {r['row']} | {r['workers']} | {r['h']} | {r['outer']} | {r['outer_lr']} | {_f(r['outer_momentum'], '.1f')} "
            f"| {r['push']}/{r['step']} | {r['ce_nats_per_byte']:.4f} | {_f(gap, '+.4f')} "
            f"| {_f(raw, '.3f')} | {_f(wire, '.3f')} | {r['bytes_per_worker_total'] / 1e6:.1f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """The frontier: CE gap to the batch-96 reference against the bytes each worker moves, one point per H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next(r["ce_nats_per_byte"] for r in rows if r["row"] == "ref-b96")
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[float, float, int]]] = {}
    for r in rows:
        if r["workers"] < 2 or r["outer"] != "nesterov" or "/" in r["row"]:
            continue
        key = f"nesterov lr {r['outer_lr']} mu {r['outer_momentum']}, {r['push']}"
        series.setdefault(key, []).append((r["bytes_per_worker_total"] / 1e6, r["ce_nats_per_byte"] - ref, r["h"]))
    for key, pts in series.items():
        if len(pts) < 2:
            continue
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        for x, y, h in pts:
            ax.annotate(f"H={h}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for r in rows:
        if r["row"] == "avg-h25":
            ax.scatter([r["bytes_per_worker_total"] / 1e6], [r["ce_nats_per_byte"] - ref], marker="x", color="k",
                       label="plain average, H=25 (before)")
    ax.axhline(0.03, ls="--", color="grey", lw=0.8, label="target gap 0.03")
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set(xscale="log", xlabel="MB each worker moves over the run (push + pull)",
           ylabel="CE gap to batch-96 (nats/byte)", title="six workers: gap against traffic")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--objective", default=None, choices=["stack", "diffusion"],
                    help="train this objective's block 0 (default: the preset's); rows are named OBJECTIVE/ROW")
    ap.add_argument("--steps", type=int, default=400, help="inner steps per replica, whatever H")
    ap.add_argument("--data", default=None, help="data directory (default: $BLOCKTRAIN_DATA)")
    ap.add_argument("--eval-bytes", type=int, default=32768, help="test bytes scored")
    ap.add_argument("--rows", default="all", help="comma-separated row names, or all")
    ap.add_argument("--around", default=None, help="LR,MU: add the H sweep, int8 and M=1 rows of this outer step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gate-tolerance", type=float, default=None,
                    help="run the coordinator's loss gate with this tolerance (nats); the rows count what it refused")
    ap.add_argument("--jsonl", type=Path, required=True, help="append rows here; rows already in it are skipped")
    ap.add_argument("--plot", type=Path, default=None, help="write the frontier PNG here")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    if args.around:
        lr, mu = (float(x) for x in args.around.split(","))
        add_rows(lr, mu)
    cfg = get_preset(args.preset)
    tag = ""
    if args.objective and args.objective != cfg.objective:
        cfg = replace(cfg, objective=Objective(args.objective))
        tag = f"{args.objective}/"
    done = {r["row"]: r for r in _read(args.jsonl)}
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)} (--around LR,MU adds more)")
    command = (f"python benchmarks/distributed/averaging_study.py --preset {args.preset} --steps {args.steps} "
               f"--eval-bytes {args.eval_bytes} --jsonl {args.jsonl}" + (f" --around {args.around}" if args.around else "")
               + (f" --objective {args.objective}" if args.objective else "")
               + (f" --gate-tolerance {args.gate_tolerance}" if args.gate_tolerance is not None else ""))
    if not args.table_only:
        for name in names:
            if tag + name in done:
                continue
            print("+", tag + name, file=sys.stderr, flush=True)
            row = measure(name, cfg, args, command)
            row["row"], row["objective"] = tag + name, str(cfg.objective)
            append_jsonl(args.jsonl, row)
            print(f"{name}: CE {row['ce_nats_per_byte']:.4f} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    rows = _read(args.jsonl)
    print(table(rows))
    if args.plot and any(r["row"] == "ref-b96" for r in rows):
        plot(rows, args.plot)
    return 0


def _read(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.is_file() else []


if __name__ == "__main__":
    raise SystemExit(main())
