"""Eval-only ablation of where/how p(next byte) is read off the chain, on a trained run.

Every readout below re-uses the same traversal (the logits each block already
computes along the chain), so all cost one traversal except `sigma_min`, which
adds one block evaluation. Prints a table and writes JSON.

    python benchmarks/quality/readout_ablation.py RUN --split valid --max-bytes 100000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.data.stream import mix_seed
from blocktrain.diffusion.sampler import block_steps
from blocktrain.errors import ConfigError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.block import BlockDenoiser
from blocktrain.objectives.diffusion import DiffusionObjective

READOUTS = ("last_step", "sigma_min", "mean_logprob", "mean_prob", "last_two_logprob")


def chain_all_logits(model: AssembledModel, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Log-probs of each block's evaluation along one traversal, plus the sigma_min readout last."""
    obj = model.objective
    if not isinstance(obj, DiffusionObjective):
        raise ConfigError(f"the readout ablation reads a diffusion chain; this run's objective is {obj.name!r}")
    cfg = model.cfg.diffusion
    g = torch.Generator().manual_seed(mix_seed(seed, 0))  # chain 0's generator, as AssembledModel.log_probs
    z = obj.initial_carry(x, g)
    out = []
    blocks = [b for b in model.blocks if isinstance(b, BlockDenoiser)]
    for k, block in enumerate(blocks):
        z, logits = block_steps(block, k, x, z, obj.partition, cfg, is_last=k == len(blocks) - 1)
        out.append(torch.log_softmax(logits.float(), -1))
    out.append(torch.log_softmax(blocks[-1](x, z, torch.tensor(cfg.sigma_min)).float(), -1))
    return out


def combine(lps: list[torch.Tensor], how: str) -> torch.Tensor:
    per_block = lps[:-1]
    if how == "last_step":
        return per_block[-1]
    if how == "sigma_min":
        return lps[-1]
    if how == "mean_logprob":
        return torch.log_softmax(torch.stack(per_block).mean(0), -1)
    if how == "mean_prob":
        return torch.logsumexp(torch.stack(per_block), 0) - math.log(len(per_block))
    if how == "last_two_logprob":
        return torch.log_softmax(torch.stack(per_block[-2:]).mean(0), -1)
    raise ValueError(how)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("--data", default=None)
    p.add_argument("--split", default="valid")
    p.add_argument("--max-bytes", type=int, default=100_000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    run = RunDir(Path(args.run))
    model = AssembledModel.load(run)
    split = resolve_data_dir(args.data).open(args.split)
    rows: dict[str, float] = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for how in READOUTS:

            def lp(x: torch.Tensor, how: str = how) -> torch.Tensor:
                return combine(chain_all_logits(model, x, 0), how).unsqueeze(0)

            res = score_split(lp, split.data, model.context, max_bytes=args.max_bytes)
            rows[how] = res.ce_nats_per_byte
        if run.has_e2e():
            e2e = E2EModel.load(run)
            rows["e2e_reference"] = score_split(lambda x: e2e.log_probs(x), split.data, e2e.context,
                                                max_bytes=args.max_bytes).ce_nats_per_byte
    sys.stdout.write(f"readout ablation on {args.run} ({args.split}, first {args.max_bytes:,} bytes)\n")
    for k, v in rows.items():
        sys.stdout.write(f"  {k:18s} {v:.4f}\n")
    if args.json:
        command = "python " + shlex.join(["benchmarks/quality/readout_ablation.py", *sys.argv[1:]])
        Path(args.json).write_text(json.dumps({"run": args.run, "split": args.split, "max_bytes": args.max_bytes,
                                               "ce_nats_per_byte": rows, "command": command}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
