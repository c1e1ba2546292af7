"""Argument helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
from dataclasses import replace

from blocktrain.config import RunConfig
from blocktrain.presets import PRESETS, get_preset


def add_run_args(p: argparse.ArgumentParser, *, need_out: bool = True) -> None:
    p.add_argument("--preset", default="cpu-small", help=f"configuration preset: {', '.join(PRESETS)}")
    if need_out:
        p.add_argument("--out", required=True, help="run directory to create or resume")
    p.add_argument("--data", default=None, help="data directory (else $BLOCKTRAIN_DATA, cache, or download)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's training steps")
    p.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    p.add_argument("--batch-size", type=int, default=None, help="override sequences per step")
    p.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    p.add_argument("--sigma-min", type=float, default=None, help="override the lowest noise level")
    p.add_argument("--sigma-max", type=float, default=None, help="override the highest noise level")
    p.add_argument("--blocks", type=int, default=None, help="override the number of blocks B (must divide L)")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = get_preset(args.preset)
    overrides = (("steps", args.steps), ("seed", args.seed), ("batch_size", args.batch_size), ("lr", args.lr))
    train = {k: v for k, v in overrides if v is not None}
    if train:
        cfg = replace(cfg, train=replace(cfg.train, **train))
    diff = {k: v for k, v in (("sigma_min", args.sigma_min), ("sigma_max", args.sigma_max)) if v is not None}
    if diff:
        cfg = replace(cfg, diffusion=replace(cfg.diffusion, **diff))
    if args.blocks is not None:
        cfg = replace(cfg, model=replace(cfg.model, n_blocks=args.blocks))
    return cfg


def forward_run_args(args: argparse.Namespace) -> list[str]:
    """Re-emit the run arguments for a child process."""
    out = ["--preset", args.preset]
    for flag, value in (
        ("--data", args.data),
        ("--steps", args.steps),
        ("--seed", args.seed),
        ("--batch-size", args.batch_size),
        ("--lr", args.lr),
        ("--sigma-min", args.sigma_min),
        ("--sigma-max", args.sigma_max),
        ("--blocks", args.blocks),
    ):
        if value is not None:
            out += [flag, str(value)]
    if args.no_progress:
        out.append("--no-progress")
    return out
