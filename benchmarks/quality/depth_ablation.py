"""Depth ablation of the stack objective (issue 18): one row per lever setting, against the E2E at matched FLOPs.

Each row trains a whole stack with the library's own commands (``blocktrain
train --objective stack`` plus the row's ``StackConfig`` flags), scores the
composed model and every prefix on the same test bytes (``blocktrain eval
--blocks-alone``), then trains the E2E reference at the row's training FLOPs
(frozen forward passes included, as a decentralised worker pays them) with
``blocktrain train-e2e --steps N`` and scores it on those bytes. E2E runs are
deterministic, so one whose step count is within ``--e2e-share`` of the row's
is reused; the row records the E2E's own FLOPs ratio either way.

    python benchmarks/quality/depth_ablation.py --preset depth-proxy --rows baseline,init-identity \\
        --jsonl benchmarks/results/depth-ablation.jsonl

Winners are chosen on validation (the last block's ``val_prefix_ce``, the composed
model on the first ``eval_bytes`` validation bytes); test figures are reported.
Appends one JSON line per row; prints the table of every row in the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from blocktrain.cli.common import add_run_args, config_from_args
from blocktrain.config import RunConfig
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.flops import train_flops_per_token
from blocktrain.objectives import get_objective
from blocktrain.train.metrics import append_jsonl, read_jsonl, write_json

# row name -> (lever, extra run flags). Rows that lose stay in the table.
ROWS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("none", []),
    "head-shared": ("1 one logit space", ["--head", "shared"]),
    "head-residual": ("1 one logit space", ["--head", "residual"]),
    "aux-1": ("2 training-time decoder", ["--aux-layers", "1"]),
    "aux-2": ("2 training-time decoder", ["--aux-layers", "2"]),
    "dense-embed": ("3 dense inputs", ["--dense", "embed"]),
    "dense-all": ("3 dense inputs", ["--dense", "all"]),
    "init-copy": ("4 warm start", ["--init", "copy"]),
    "init-identity": ("4 warm start", ["--init", "identity"]),
    "steps-front": ("5 budget", ["--step-ratio", "0.7"]),
    "steps-back": ("5 budget", ["--step-ratio", "1.4"]),
    "identity+residual": ("4+1", ["--init", "identity", "--head", "residual"]),
    "copy+front": ("4+5", ["--init", "copy", "--step-ratio", "0.7"]),
    "copy+back": ("4+5", ["--init", "copy", "--step-ratio", "1.4"]),
    "copy+aux-1": ("4+2", ["--init", "copy", "--aux-layers", "1"]),
    "copy+dense-all": ("4+3", ["--init", "copy", "--dense", "all"]),
    "baseline-concurrent": ("schedule", ["--schedule", "concurrent", "--round-steps", "50"]),
    "copy-concurrent": ("4, schedule", ["--init", "copy", "--schedule", "concurrent", "--round-steps", "50"]),
}
# Every row names each lever's setting, so a preset's defaults never change what a row measures.
_DEFAULTS = {"--head": "private", "--aux-layers": "0", "--dense": "off", "--init": "fresh", "--step-ratio": "1.0",
             "--schedule": "progressive"}


def row_flags(name: str) -> list[str]:
    """The row's run flags: its own settings, then the baseline's for every lever it leaves alone."""
    flags = list(ROWS[name][1])
    for flag, value in _DEFAULTS.items():
        if flag not in flags:
            flags += [flag, value]
    return flags



def _run(cmd: list[str]) -> str:
    print("+", shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def _summaries(run: Path, name: str) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run / "metrics" / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in lines if r.get("event") == "summary"][-1]


def _eval(run: Path, model: str, data: str, max_bytes: int, blocks_alone: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "blocktrain", "eval", str(run), "--model", model, "--split", "test", "--data", data,
           "--max-bytes", str(max_bytes), "--json", "--no-progress", *(["--blocks-alone"] if blocks_alone else [])]
    return json.loads(_run(cmd))


class E2ECache:
    """E2E references by step count, trained once each (they are deterministic), for one set of training flags, data
    and scored bytes: a reference is found again only under the same ones (``--extra --lr 4e-3`` trains its own)."""

    def __init__(self, out: Path, common: list[str], data: str, max_bytes: int, share: float) -> None:
        self.out, self.common, self.data, self.max_bytes, self.share = out, common, data, max_bytes, share
        ident = json.dumps({"flags": common, "data": data, "max_bytes": max_bytes})
        self.key = hashlib.sha256(ident.encode()).hexdigest()[:12]  # what the references' folders are named by

    def get(self, steps: int) -> tuple[int, dict[str, Any]]:
        for run in sorted(self.out.glob(f"e2e-ref-{self.key}-*")):
            have = int(run.name.rsplit("-", 1)[1])
            if abs(have - steps) <= self.share * steps and (run / "eval.json").exists():
                return have, json.loads((run / "eval.json").read_text())
        run = self.out / f"e2e-ref-{self.key}-{steps}"
        t0 = time.perf_counter()
        _run([sys.executable, "-m", "blocktrain", "train-e2e", *self.common, "--steps", str(steps), "--out", str(run)])
        summary = _summaries(run, "e2e")
        ev = _eval(run, "e2e", self.data, self.max_bytes, blocks_alone=False)
        ev.update(train_wall_s=time.perf_counter() - t0, train_mem_bytes=summary["train_mem_bytes"],
                  train_flops=summary["flops_per_step"] * summary["steps"], steps=summary["steps"])
        write_json(run / "eval.json", ev)  # whole or absent: a cut one is not read back as a reference
        return steps, ev


def run_dir(out: str, name: str, flags: list[str]) -> Path:
    """The run folder of ``name`` trained with ``flags``: named by them too, so that a row measured again with another
    recipe (``--extra --lr 0.004``) trains afresh, where a folder named by the row alone went on from the stack the
    old recipe had finished, and the row recorded the new command beside the old stack's CE."""
    return Path(out) / f"{name}-{hashlib.sha256(json.dumps(flags).encode()).hexdigest()[:12]}"


def measure(name: str, args: argparse.Namespace, e2e: E2ECache) -> dict[str, Any]:
    lever, flags = ROWS[name][0], row_flags(name)
    common = ["--preset", args.preset, "--data", args.data, "--no-progress", *args.extra]
    run = run_dir(args.out, name, [*common, *flags])
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "blocktrain", "train", *common, "--objective", "stack", *flags, "--out", str(run)])
    wall = time.perf_counter() - t0
    cfg = _config([*common, "--objective", "stack", *flags])
    n = cfg.model.n_blocks
    sums = [_summaries(run, f"block_{k}") for k in range(n)]
    ev = _eval(run, "blocktrain", args.data, args.max_bytes, blocks_alone=True)
    tokens = cfg.train.batch_size * cfg.model.context
    obj = get_objective(cfg)  # the concurrent schedule's summaries carry no FLOPs: the same formula the trainers use
    flops = sum(obj.train_flops_per_token(k) * tokens * s["steps"] for k, s in enumerate(sums))
    e2e_step = train_flops_per_token(E2ETransformer(cfg.model), cfg.model.d_model, cfg.model.context) * tokens
    want = max(1, round(flops / e2e_step))
    got, ref = e2e.get(want)
    prefix = ev["prefix_ce"]
    mems = [s["train_mem_bytes"] for s in sums if "train_mem_bytes" in s]  # none under the concurrent schedule
    mem: int | None = max(mems) if len(mems) == n else None
    return {
        "row": name, "lever": lever, "flags": flags, "preset": args.preset,
        "ce_nats_per_byte": ev["ce_nats_per_byte"], "prefix_ce": prefix,
        "gain_nats_per_byte": prefix[0] - ev["ce_nats_per_byte"],
        "val_composed_ce": sums[-1].get("eval", {}).get("val_prefix_ce"),
        "val_prefix_ce": [s.get("eval", {}).get("val_prefix_ce") for s in sums],
        "e2e_matched_flops_ce": ref["ce_nats_per_byte"], "e2e_steps": got, "e2e_steps_exact": want,
        "gap_matched_flops_nats_per_byte": ev["ce_nats_per_byte"] - ref["ce_nats_per_byte"],
        "train_flops": flops, "train_flops_over_e2e_step": flops / e2e_step, "e2e_flops_over_row": got / (flops / e2e_step),
        "steps_per_block": [s["steps"] for s in sums],
        "worker_mem_bytes": mem, "e2e_mem_bytes": ref["train_mem_bytes"],
        "memory_ratio": mem / ref["train_mem_bytes"] if mem is not None else None,
        "stack_train_wall_s": wall, "stack_wall_s_per_block": [s["wall_s"] for s in sums],
        "e2e_train_wall_s": ref["train_wall_s"], "bytes_scored": ev["bytes_scored"],
        "command": "python " + shlex.join(["benchmarks/quality/depth_ablation.py", "--preset", args.preset, "--rows", name,
                                           "--data", args.data, "--out", args.out, "--max-bytes", str(args.max_bytes),
                                           "--e2e-share", f"{args.e2e_share:g}",
                                           *(["--extra", *args.extra] if args.extra else [])]),
    }


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _config(run_flags: list[str]) -> RunConfig:
    """The run config the trainers build from these flags (the CLI's own parser)."""
    p = argparse.ArgumentParser()
    add_run_args(p, need_out=False)
    return config_from_args(p.parse_args(run_flags))


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"| row | lever | prefix CE (test) | composed | gain | E2E matched FLOPs | gap | FLOPs / E2E step | "
            f"val composed | worker mem ratio | stack wall s |\n|{'---|' * 11}")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['lever']} | {', '.join(f'{c:.3f}' for c in r['prefix_ce'])} | {r['ce_nats_per_byte']:.3f} | "
            f"{r['gain_nats_per_byte']:+.3f} | {r['e2e_matched_flops_ce']:.3f} ({r['e2e_steps']} steps) | "
            f"{r['gap_matched_flops_nats_per_byte']:+.3f} | {r['train_flops_over_e2e_step']:.0f} | "
            f"{_f(r['val_composed_ce'])} | {_f(r['memory_ratio'])} | {r['stack_train_wall_s']:.0f} |")
    return "\n".join(lines)


def sweep_e2e_lr(args: argparse.Namespace, steps: int, lrs: list[float]) -> list[dict[str, Any]]:
    """The E2E reference at ``steps`` for each lr: validation CE (its own end-of-run eval) and test CE."""
    out = []
    for lr in lrs:
        flags = ["--preset", args.preset, "--data", args.data, "--no-progress", *args.extra, "--steps", str(steps),
                 "--lr", repr(lr)]
        run = run_dir(args.out, f"e2e-sweep-{steps}-lr{lr:g}", flags)
        _run([sys.executable, "-m", "blocktrain", "train-e2e", *flags, "--out", str(run)])
        summary = _summaries(run, "e2e")
        ev = _eval(run, "e2e", args.data, args.max_bytes, blocks_alone=False)
        out.append({"lr": lr, "steps": steps, "val_ce": summary["eval"].get("val_ce"), "test_ce": ev["ce_nats_per_byte"],
                    "bytes_scored": ev["bytes_scored"],
                    "command": "python " + shlex.join(["benchmarks/quality/depth_ablation.py", "--preset", args.preset,
                                                       "--sweep-e2e-lr", ",".join(f"{x:g}" for x in lrs),
                                                       "--sweep-steps", str(steps), "--data", args.data, "--out",
                                                       args.out, "--max-bytes", str(args.max_bytes),
                                                       *(["--extra", *args.extra] if args.extra else [])])})
        print(f"E2E {steps} steps, lr {lr:g}: val {out[-1]['val_ce']:.4f}, test {out[-1]['test_ce']:.4f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="depth-proxy")
    ap.add_argument("--rows", default="baseline", help=f"comma-separated rows: {', '.join(ROWS)}")
    ap.add_argument("--data", default="../shared/data/wikitext/wikitext-2-v1-tokens")
    ap.add_argument("--out", default="runs/depth-ablation", help="run directories go here")
    ap.add_argument("--max-bytes", type=int, default=262144, help="score the first N test bytes (the same for every arm)")
    ap.add_argument("--e2e-share", type=float, default=0.02, help="reuse an E2E run within this fraction of the steps")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="run flags for every arm (a recipe change)")
    ap.add_argument("--jsonl", type=Path, default=None, help="append rows here; the table shows every row in the file")
    ap.add_argument("--sweep-e2e-lr", default=None, help="instead of rows: the E2E at --sweep-steps for each of these lrs")
    ap.add_argument("--sweep-steps", type=int, default=0, help="E2E steps of the lr sweep (a row's matched-FLOPs steps)")
    ap.add_argument("--table-only", action="store_true", help="print the table of the rows in --jsonl; train nothing")
    args = ap.parse_args()
    if args.table_only:
        if not args.jsonl or not args.jsonl.is_file():
            ap.error("--table-only reads the rows of an existing --jsonl file")
        print(table([r for r in read_jsonl(args.jsonl) if "row" in r]))
        return 0
    if args.sweep_e2e_lr:
        res = sweep_e2e_lr(args, args.sweep_steps, [float(x) for x in args.sweep_e2e_lr.split(",")])
        if args.jsonl:
            append_jsonl(args.jsonl, {"e2e_lr_sweep": res})
        return 0
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    e2e = E2ECache(Path(args.out), ["--preset", args.preset, "--data", args.data, "--no-progress", *args.extra],
                   args.data, args.max_bytes, args.e2e_share)
    rows = []
    for name in args.rows.split(","):
        row = measure(name, args, e2e)
        rows.append(row)
        if args.jsonl:
            append_jsonl(args.jsonl, row)
    if args.jsonl:
        rows = [r for r in read_jsonl(args.jsonl) if "row" in r]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
