"""Composition ablation on cpu-mini: does the chain beat its best block used alone?

Each run trains the E2E reference or the B=4 blocks of one recipe (same seeds,
same data streams), scores the first 128 KiB of the validation split with the
full chain (K=1, fixed seed) and every block alone, and appends one JSON line.

    python -m benchmarks.quality.chain_ablation e2e
    python -m benchmarks.quality.chain_ablation naive --sigma-min 1 --sigma-max 10
    python -m benchmarks.quality.chain_ablation chain --sigma-min 0.05 --sigma-max 10
    python -m benchmarks.quality.chain_ablation boost --sigma-min 0.05 --sigma-max 10
    python -m benchmarks.quality.chain_ablation ensemble
    python -m benchmarks.quality.chain_ablation selfcond --sigma-min 1 --sigma-max 10
    python -m benchmarks.quality.chain_ablation concat --sigma-min 5 --sigma-max 50
    python -m benchmarks.quality.chain_ablation naive --sigma-min 5 --sigma-max 50 --block-layers 4
    python -m benchmarks.quality.chain_ablation boost --sigma-min 0.05 --sigma-max 10 --refresh-rounds 5
    python -m benchmarks.quality.chain_ablation table      # renders benchmarks/results/ablation.md

Recipes (block k, slice step sigmas s_0 = sigma_max > s_1 > ... > s_B = sigma_min):
- naive: the library's block loss: z = E[y] + sigma*eps, sigma from block k's slice.
- chain: chain-aware. Block k trains at sigma = s_k on the z that frozen copies
  of blocks 0..k-1 produce by Euler steps from z = sigma_max*eps (forward only,
  no gradient, no optimiser state): exactly the inference input, no target leak.
- boost: chain-aware, and block k's logits are a residual added to the running
  logit sum of the blocks before it (D and the readout use the running sum).
- ensemble: no chain. Every block is a plain LM fed pure noise at sigma_max;
  the readout is the mean of the B blocks' probabilities (compute: B forwards,
  the same as one traversal). It bounds what passing predictions can add.
- selfcond: self-conditioning. z = sigma*eps + (1 - sigma/sigma_max) * D_self,
  the inference form of z with the block's own detached estimate (from
  z = sigma*eps) standing in for the earlier blocks' D; D_self is dropped for
  half the sequences. No other block and no target leak.
- softblend: the same form of z with a soft blend of E rows: weight u ~ U(0, 1)
  on E[y] and the rest on a random peaked mixture of rows.
- features: a wider channel, as an upper-bound probe. Block k reads the frozen
  final features F = LN(h) (b, t, d) of blocks 0..k-1 run in order (greedy
  layer-wise training with a local head); every block gets pure noise z, so
  D carries nothing. Not BlockTrain's protocol: it measures what a channel the
  size of z could carry if it held features instead of a next-byte guess.
- stack: features, with block k's input projection of F initialised to the
  identity, so it starts by continuing from block k-1's features.
- library-stack: the library's stack objective (blocktrain.objectives.stack):
  block k continues the residual stream h of frozen blocks 0..k-1 and trains
  its own next-byte head; the references are the prefixes 0..k (stored under
  blocks_alone_ce). features/stack above are probes of a feature channel
  beside the diffusion input, not this objective.
- concat: the naive loss with the [x || z] input layout (interleaved tokens
  under one causal mask) instead of the additive one.
Knobs: --block-layers N (depth per block at matched compute), --lr, --steps, and
--refresh-rounds R for chain/boost (all blocks train at once in rounds of
--round-steps H, each reading snapshots of the earlier blocks refreshed every
R rounds, as the decentralised protocol would have to).

Train compute is counted as 6 x params x bytes for trained blocks plus
2 x params x bytes for the frozen forward passes; inference compute is forward
FLOPs per scored byte. Run one at a time: every run uses both CPU cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.quality import ablation_table
from benchmarks.quality.ablation_recipes import (
    FEATURES,
    LIBRARY_STACK,
    RECIPES,
    B,
    FeatureBlock,
    Variant,
    chain_state,
    feature_chain,
    objective_for,
    train_blocks,
    train_e2e,
)
from blocktrain.config import DiffusionConfig, Readout, RunConfig, Slicing, Solver
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import chain_logits, evaluations_per_traversal, initial_noise
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.block import BlockDenoiser
from blocktrain.objectives import compose_logits
from blocktrain.objectives.diffusion import DiffusionObjective
from blocktrain.presets import cpu_mini, cpu_small, tiny
from blocktrain.train.metrics import append_jsonl

RESULTS = Path(__file__).resolve().parents[1] / "results"
EVAL_BYTES = 131072
CHAIN_SEED = 7  # generator seed of every chain traversal that is scored
ALONE_SEED = 11  # block k used alone draws its noise from ALONE_SEED + k
PRESETS = {"cpu-mini": cpu_mini, "cpu-small": cpu_small, "tiny": tiny}


def _denoisers(blocks: Sequence[nn.Module]) -> list[BlockDenoiser]:
    out = [b for b in blocks if isinstance(b, BlockDenoiser)]
    assert len(out) == len(blocks)
    return out


def score_e2e(cfg: RunConfig, train: np.ndarray, valid: np.ndarray) -> dict[str, Any]:
    m = train_e2e(cfg, train)
    with torch.no_grad():
        ce = score_split(lambda x: torch.log_softmax(m(x), -1).unsqueeze(0), valid, cfg.model.context, max_bytes=EVAL_BYTES)
    params = sum(p.numel() for p in m.parameters())
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.model.context
    return {"ce": ce.ce_nats_per_byte, "train_flops": 6.0 * params * tokens, "infer_flops_per_byte": 2.0 * params}


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """logits (b, t, 256) -> one chain's log-probabilities (1, b, t, 256) for score_split."""
    return torch.log_softmax(logits, -1).unsqueeze(0)


def score_blocks(v: Variant, cfg: RunConfig, train: np.ndarray, valid: np.ndarray,
                 inference_variants: bool = False) -> dict[str, Any]:
    """Train ``v``'s blocks (``cfg.train.steps``: their schedule's length) and score them; ``inference_variants``: the
    same blocks under other inference schedules too."""
    obj = objective_for(cfg, v.mode)
    smax, T, d = cfg.diffusion.sigma_max, cfg.model.context, cfg.model.d_model
    blocks, frozen_forwards = train_blocks(v, cfg, train)

    def run(x: torch.Tensor, readout: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(CHAIN_SEED)
        if v.mode == LIBRARY_STACK:
            return _log_probs(compose_logits(obj, blocks, x, g))
        if v.mode == "ensemble":
            lps = [torch.log_softmax(b(x, initial_noise((x.shape[0], x.shape[1]), d, smax, g), torch.tensor(smax)), -1) for b in blocks]
            return (torch.logsumexp(torch.stack(lps), 0) - math.log(B)).unsqueeze(0)
        if v.mode in FEATURES:
            return _log_probs(feature_chain(blocks, x, g, smax, d)[0])
        assert isinstance(obj, DiffusionObjective)
        _, total, steps = chain_state(v.mode, obj, blocks, x, g, B)
        assert total is not None
        if readout == "mean":  # the mean of the B steps' log-probabilities, renormalised
            return _log_probs(torch.stack([torch.log_softmax(s, -1) for s in steps]).mean(0))
        return _log_probs(total)

    with torch.no_grad():
        ce = score_split(lambda x: run(x, "last"), valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte
        ce_mean = None
        if v.mode not in ("ensemble", *FEATURES, LIBRARY_STACK):
            ce_mean = score_split(lambda x: run(x, "mean"), valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte
    alone = []
    for k in range(B):

        @torch.no_grad()
        def lp(x: torch.Tensor, k: int = k) -> torch.Tensor:
            g = torch.Generator().manual_seed(ALONE_SEED + k)
            if v.mode == LIBRARY_STACK:  # prefix 0..k with block k's head (the stack objective's reference)
                return _log_probs(obj.reference_logits(blocks[: k + 1], x, g)[k])
            if v.mode == "ensemble":
                return _log_probs(blocks[k](x, initial_noise((x.shape[0], x.shape[1]), d, smax, g), torch.tensor(smax)))
            if v.mode in FEATURES:  # no features from a predecessor
                blk = blocks[k]
                assert isinstance(blk, FeatureBlock)
                return _log_probs(blk.forward_feat(x, initial_noise((x.shape[0], x.shape[1]), d, smax, g), smax, None)[0])
            return _log_probs(obj.local_logits(blocks[k], k, x, g))  # the block alone at the top of its slice

        alone.append(score_split(lp, valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte)
    infer: dict[str, dict[str, float]] = {}
    if v.mode == "naive" and inference_variants:  # the same blocks under other inference schedules
        variants = {
            "euler_2_steps": replace(cfg.diffusion, steps_per_block=2),
            "euler_4_steps": replace(cfg.diffusion, steps_per_block=4),
            "heun_1_step": replace(cfg.diffusion, solver=Solver.HEUN),
            "readout_sigma_min": replace(cfg.diffusion, readout=Readout.SIGMA_MIN),
        }
        for name, dcfg in variants.items():

            @torch.no_grad()
            def vlp(x: torch.Tensor, dcfg: DiffusionConfig = dcfg) -> torch.Tensor:
                g = torch.Generator().manual_seed(CHAIN_SEED)
                return _log_probs(chain_logits(_denoisers(blocks), x, NoisePartition(dcfg, B), dcfg, g))

            ce_v = score_split(vlp, valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte
            infer[name] = {"ce": ce_v, "evaluations": evaluations_per_traversal(dcfg, B)}
    params = sum(p.numel() for p in blocks[0].parameters())
    tokens_per_step = cfg.train.batch_size * T
    width = 2.0 if v.mode == "concat" else 1.0  # the [x || z] layout runs 2T tokens per sequence
    train_flops = width * (6.0 * params * tokens_per_step * v.block_steps * B + 2.0 * params * frozen_forwards * tokens_per_step)
    if v.mode == LIBRARY_STACK:  # the objective's own count: each block's step plus its frozen trunks' forwards
        train_flops = sum(obj.train_flops_per_token(k) for k in range(B)) * tokens_per_step * v.block_steps
    out: dict[str, Any] = {
        "ce": ce,
        "ce_mean_readout": ce_mean,
        "blocks_alone_ce": alone,
        "compositional_gain": min(alone) - ce,
        "train_flops": train_flops,
        "infer_flops_per_byte": width * 2.0 * params * B,
        "inference_variants": infer,
    }
    if v.refresh_rounds > 0:  # what the snapshots cost the last block's worker (fp32 weights of blocks 0..B-2)
        snap_bytes = 4 * params * (B - 1)
        out["snapshot_mib_per_refresh"] = snap_bytes / 2**20
        out["snapshot_mib_per_round"] = snap_bytes / 2**20 / v.refresh_rounds
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    recipes = ["e2e", *RECIPES, "table"]
    ap.add_argument("recipe", choices=recipes)
    ap.add_argument("--sigma-min", type=float, default=1.0)
    ap.add_argument("--sigma-max", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=None, help="E2E steps (default: the preset's); blocks match its compute")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    ap.add_argument("--block-layers", type=int, default=None, help="layers per block; blocks then train steps*(L/B)/N steps")
    ap.add_argument("--block-steps", type=int, default=None, help="override the blocks' steps (to match total FLOPs, not only layer FLOPs)")
    ap.add_argument("--refresh-rounds", type=int, default=0, help="chain/boost: concurrent blocks, snapshots refreshed every R rounds")
    ap.add_argument("--catchup-steps", type=int, default=0, help="with --refresh-rounds: last steps per block against final predecessors")
    ap.add_argument("--round-steps", type=int, default=10, help="local steps per round with --refresh-rounds")
    ap.add_argument("--slicing", choices=[s.value for s in Slicing], default=Slicing.EQUAL_PROB.value)
    ap.add_argument("--overlap", type=float, default=0.1)
    ap.add_argument("--data", default=None)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-mini", help="cpu-small confirms a cpu-mini row; tiny is a smoke test")
    ap.add_argument("--jsonl", type=Path, default=None, help="where to append the row (default: results/ablation-<preset>.jsonl)")
    args = ap.parse_args()
    jsonl: Path = args.jsonl or RESULTS / f"ablation-{args.preset}.jsonl"
    if args.recipe == "table":
        text = ablation_table.render(jsonl.parent / "ablation-cpu-mini.jsonl", EVAL_BYTES, jsonl.parent / "ablation-cpu-small.jsonl")
        (jsonl.parent / "ablation.md").write_text(text)
        sys.stdout.write(text)
        return 0
    torch.set_num_threads(2)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = PRESETS[args.preset]()
    lr = args.lr if args.lr is not None else cfg.train.lr
    steps = args.steps if args.steps is not None else cfg.train.steps
    cfg = replace(
        cfg,
        diffusion=replace(
            cfg.diffusion, sigma_min=args.sigma_min, sigma_max=args.sigma_max, slicing=Slicing(args.slicing), overlap=args.overlap
        ),
        train=replace(cfg.train, steps=steps, lr=lr),
    )
    lpb = cfg.model.layers_per_block
    block_layers = args.block_layers or lpb
    block_steps = args.block_steps or round(steps * lpb / block_layers)
    # the blocks' lr schedule spans their own steps: one of the E2E's steps left blocks of 4 layers (200 steps) at
    # 0.6 of the peak lr, never annealed, and blocks of 1 layer (800 steps) at the least lr for half their steps
    block_cfg: RunConfig = replace(cfg, model=replace(cfg.model, n_layers=block_layers * B),
                                   train=replace(cfg.train, steps=block_steps))
    data = resolve_data_dir(args.data)
    train, valid = data.open("train").data, data.open("valid").data
    t0 = time.time()
    if args.recipe == "e2e":
        res = score_e2e(cfg, train, valid)
    else:
        v = Variant(args.recipe, block_steps, args.refresh_rounds, args.round_steps, args.catchup_steps)
        res = score_blocks(v, block_cfg, train, valid, inference_variants=block_steps == steps and block_layers == lpb)
    row = {"preset": args.preset, "recipe": args.recipe, "sigma_min": args.sigma_min, "sigma_max": args.sigma_max, "steps": steps,
           "slicing": args.slicing, "overlap": args.overlap, "lr": lr, "block_layers": block_layers, "block_steps": block_steps,
           "refresh_rounds": args.refresh_rounds, "round_steps": args.round_steps, "catchup_steps": args.catchup_steps, **res,
           "wall_s": round(time.time() - t0, 1), "command": "python -m benchmarks.quality.chain_ablation " + " ".join(sys.argv[1:])}
    append_jsonl(jsonl, row)
    sys.stdout.write(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
