"""What storing the frozen earlier blocks in bf16 or int8 costs a stack: the same stack trained under each storage.

Every block k of the preset's stack trains (``blocktrain.train.block.train_block``, progressive, same seed and
stream) on frozen copies of blocks 0..k-1 stored as ``train.frozen_storage`` says; the composed model and its
prefixes are then scored in fp32 (``blocktrain.evaluate``) on the first ``--eval-bytes`` test bytes. The rows differ
only in the frozen inputs' storage, so their differences are its cost (one seed).

    flock /tmp/blocktrain-cpu.lock python benchmarks/quality/frozen_storage_ce.py --preset cpu-quick \\
        --json benchmarks/results/frozen-storage-ce.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import FrozenStorage, Objective, Precision
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.evaluate.assembled import load_model_from_run
from blocktrain.evaluate.report import evaluate_model
from blocktrain.presets import get_preset, stack_recipe
from blocktrain.train.block import train_block


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-quick")
    ap.add_argument("--storages", default="fp32,bf16,int8")
    ap.add_argument("--eval-bytes", type=int, default=98304)
    ap.add_argument("--data", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = resolve_data_dir(args.data)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="frozen-storage-") as tmp:
        for storage in args.storages.split(","):
            base = get_preset(args.preset)
            if base.objective is not Objective.STACK:  # tiny: its stack, with the presets' stack recipe
                base = replace(base, objective=Objective.STACK, stack=stack_recipe())
            cfg = replace(base, train=replace(base.train, frozen_storage=FrozenStorage(storage), precision=Precision.FP32))
            out = Path(tmp) / storage
            for k in range(cfg.model.n_blocks):
                train_block(cfg, data, out, k, progress=False)
            model = load_model_from_run(RunDir(out), "blocktrain", Precision.FP32)
            r = evaluate_model(model, data.open("test"), max_bytes=args.eval_bytes, blocks_alone=True)
            rows.append({"frozen_storage": storage, "ce_nats_per_byte": r["ce_nats_per_byte"],
                         "prefix_ce": r.get("prefix_ce")})
            print(f"{storage}: CE {r['ce_nats_per_byte']:.4f}  prefixes {r.get('prefix_ce')}", file=sys.stderr, flush=True)
    ref = next((r["ce_nats_per_byte"] for r in rows if r["frozen_storage"] == "fp32"), None)
    for r in rows:
        r["minus_fp32"] = None if ref is None else r["ce_nats_per_byte"] - ref
    doc = {"what": __doc__.split("\n\n")[0], "preset": args.preset, "eval_split": "test", "eval_bytes": args.eval_bytes,
           "command": "python benchmarks/quality/frozen_storage_ce.py " + " ".join(sys.argv[1:]), "rows": rows}
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print("| frozen storage | composed CE | minus fp32 | prefixes |\n|---|---|---|---|")
    for r in rows:
        d = "" if r["minus_fp32"] is None else f"{r['minus_fp32']:+.4f}"
        pre = ", ".join(f"{x:.4f}" for x in r["prefix_ce"] or [])
        print(f"| {r['frozen_storage']} | {r['ce_nats_per_byte']:.4f} | {d} | {pre} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
