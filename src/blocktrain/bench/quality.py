"""``blocktrain bench quality``: E2E reference vs B blocks at matched training compute.

Each block gets as many steps as the E2E run at the same batch and context, so
total training FLOPs match (each block is 1/B of the depth). Every training runs
in its own fresh process so its peak RSS is its own; memory is peak RSS minus
the RSS just before the model is built. Both models are scored on the same
test bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from blocktrain.bench.machine import machine_info
from blocktrain.checkpoint.run import RunDir
from blocktrain.cli.common import config_from_args, forward_run_args
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.errors import BlockTrainError, RunError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.report import evaluate_model
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.train.metrics import read_jsonl

log = logging.getLogger(__name__)


def _summary(run: RunDir, name: str) -> dict[str, Any]:
    recs = [r for r in read_jsonl(run.metrics_path(name)) if r.get("event") == "summary"]
    if not recs:
        raise RunError(f"{name} wrote no summary to {run.metrics_path(name)}")
    return recs[-1]


def _analytic(module: Any) -> dict[str, int]:
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {
        "params": params,
        "param_bytes": 4 * params,
        "grad_bytes": 4 * params,
        "optimizer_bytes": 8 * params,  # AdamW: two fp32 moments
        "total_state_bytes": 16 * params,
    }


def _child(cmd: list[str]) -> None:
    log.info("running: %s", shlex.join(cmd))
    rc = subprocess.call(cmd)
    if rc != 0:
        raise BlockTrainError(f"child training failed (exit {rc}): {shlex.join(cmd)}")


def run_quality_bench(args: argparse.Namespace) -> dict[str, Any]:
    cfg = config_from_args(args)
    data = resolve_data_dir(args.data)
    data.open("test")
    out = Path(args.out or f"runs/bench-quality-{cfg.name}")
    if out.exists():
        if not args.fresh:
            raise RunError(f"{out} exists; pass --fresh to delete it or choose another --out")
        shutil.rmtree(out)
    run = RunDir(out)
    child_args = [*forward_run_args(args)]
    if args.data is None:
        child_args += ["--data", str(data.root)]
    base = [sys.executable, "-m", "blocktrain"]
    t0 = time.perf_counter()
    _child([*base, "train-e2e", "--out", str(out), *child_args])
    e2e_sum = _summary(run, "e2e")
    block_sums = []
    for k in range(cfg.model.n_blocks):
        _child([*base, "train-block", "--block", str(k), "--out", str(out), *child_args])
        block_sums.append(_summary(run, f"block_{k}"))
    train_wall = time.perf_counter() - t0

    test = data.open("test")
    progress = not args.no_progress
    e2e_eval = evaluate_model(E2EModel.load(run, cfg), test, max_bytes=args.max_eval_bytes, progress=progress)
    bt_eval = evaluate_model(
        AssembledModel.load(run, cfg), test, chains=args.chains, max_bytes=args.max_eval_bytes,
        blocks_alone=True, progress=progress,
    )
    if e2e_eval["bytes_scored"] != bt_eval["bytes_scored"]:
        raise RunError("E2E and BlockTrain were scored on different bytes")
    block_mem = max(s["train_mem_bytes"] for s in block_sums)
    result: dict[str, Any] = {
        "benchmark": "quality",
        "preset": cfg.name,
        "config": cfg.to_dict(),
        "command": "blocktrain " + shlex.join(sys.argv[1:]),
        "machine": machine_info(),
        "data_dir": str(data.root),
        "data_flavour": data.flavour,
        "split": "test",
        "bytes_scored": e2e_eval["bytes_scored"],
        "e2e": {
            **e2e_eval,
            "train_wall_s": e2e_sum["wall_s"],
            "train_mem_bytes": e2e_sum["train_mem_bytes"],
            "train_steps": e2e_sum["steps"],
            "analytic": _analytic(E2ETransformer(cfg.model)),
        },
        "blocktrain": {
            **bt_eval,
            "train_wall_s_sequential": sum(s["wall_s"] for s in block_sums),
            "train_wall_s_per_block": [s["wall_s"] for s in block_sums],
            "train_steps_per_block": [s["steps"] for s in block_sums],
        },
        "block_worker": {
            "train_mem_bytes": block_mem,
            "train_mem_bytes_per_block": [s["train_mem_bytes"] for s in block_sums],
            "analytic": _analytic(BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)),
        },
        "gap_nats_per_byte": bt_eval["ce_nats_per_byte"] - e2e_eval["ce_nats_per_byte"],
        "memory_ratio_block_over_e2e": block_mem / max(1, e2e_sum["train_mem_bytes"]),
        "blocks_alone_ce": bt_eval["blocks_alone_ce"],
        "bench_wall_s": time.perf_counter() - t0,
        "train_wall_s": train_wall,
    }
    table = format_table(result)
    sys.stdout.write(table + "\n")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(f"# Quality benchmark: {cfg.name}\n\n```\n{result['command']}\n```\n\n{table}\n")
        log.info("wrote %s and %s", path, path.with_suffix(".md"))
    return result


def format_table(r: dict[str, Any]) -> str:
    e, b, w = r["e2e"], r["blocktrain"], r["block_worker"]
    mib = 2**20
    rows = [
        ("model", "E2E reference", f"BlockTrain (B={r['config']['model']['n_blocks']})"),
        ("test CE (nats/byte)", f"{e['ce_nats_per_byte']:.4f}", f"{b['ce_nats_per_byte']:.4f} (K=1 chain)"),
        ("bits/byte", f"{e['bits_per_byte']:.4f}", f"{b['bits_per_byte']:.4f}"),
        ("gap (nats/byte)", "", f"{r['gap_nats_per_byte']:+.4f}"),
        (f"K={b['chains']} chain mixture", "", f"{b['ce_mixture_nats_per_byte'] or b['ce_nats_per_byte']:.4f} ({b['chains']}x compute)"),
        ("best block alone", "", f"{min(r['blocks_alone_ce']):.4f} ({', '.join(f'{c:.3f}' for c in r['blocks_alone_ce'])})"),
        ("train wall (s)", f"{e['train_wall_s']:.0f}", f"{b['train_wall_s_sequential']:.0f} (sum over blocks)"),
        ("train memory (MiB, peak RSS - base)", f"{e['train_mem_bytes'] / mib:.1f}", f"{w['train_mem_bytes'] / mib:.1f} per block worker"),
        ("memory ratio", "", f"{r['memory_ratio_block_over_e2e']:.3f}"),
        ("params per worker", f"{e['analytic']['params']:,}", f"{w['analytic']['params']:,}"),
        ("params+grads+AdamW (MiB)", f"{e['analytic']['total_state_bytes'] / mib:.1f}", f"{w['analytic']['total_state_bytes'] / mib:.1f}"),
        ("bytes scored", f"{e['bytes_scored']:,}", f"{b['bytes_scored']:,}"),
    ]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["| " + " | ".join(c.ljust(width[i]) for i, c in enumerate(row)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (wd + 2) for wd in width) + "|")
    return "\n".join(lines)
