"""Train one block alone: config + data directory + its own checkpoint.

Peak memory is one block and its optimiser, plus (stack objective) forward-only
copies of the earlier blocks it reads, loaded from the run directory once they
have finished (the progressive schedule). Nothing else of the model is built.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from blocktrain.checkpoint.blocks import block_save_meta, check_block_index, load_block
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import Precision, RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import compile_module, resolve_device, resolve_precision
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import frozen_dtype
from blocktrain.seeds import block_stream, init_seed
from blocktrain.train.memory import rss_bytes, warm_runtime
from blocktrain.train.round import BlockTask
from blocktrain.train.run import TrainSummary, run_training

log = logging.getLogger(__name__)

__all__ = ["block_save_meta", "check_block_index", "train_block"]


def train_block(
    cfg: RunConfig, data: DataDir, out: Path, k: int, *, progress: bool = True, stream: int = 0
) -> TrainSummary:
    check_block_index(k, cfg.model.n_blocks)
    train = data.open("train")  # validate inputs before anything is written
    valid = data.open("valid") if cfg.train.eval_bytes else None
    run = RunDir(out)
    cfg = run.init(cfg)
    objective = get_objective(cfg)
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    tstream = TrainStream(train.data, cfg.model.context, cfg.train.batch_size, cfg.train.seed,
                          stream=block_stream(k, stream), device=device)
    warm_runtime()
    baseline = rss_bytes()  # frozen copies count towards the worker's training memory
    dtype = frozen_dtype(cfg.train.frozen_storage, precision is Precision.BF16)
    earlier = [load_block(run, cfg, j, finished=True) for j in range(objective.frozen_inputs(k))]
    frozen = [compile_module(objective.freeze(b, dtype).to(device), cfg.train.compile) for b in earlier]
    # seeded just before it is built, as the coordinator's version 0 and the in-process rounds build it (the warm-up
    # and the earlier blocks' construction drew from the generator after the seed: other weights)
    torch.manual_seed(init_seed(cfg.train.seed, k))
    block = objective.build_block(k)
    objective.inherit(block, k, earlier, at_init=True)  # warm start and frozen heads (stack variants); a resume overwrites it
    del earlier  # only the frozen copies stay
    block = block.to(device)
    steps, lr = objective.block_steps(k), objective.block_lr(k)
    if steps != cfg.train.steps:
        log.info("block %d trains %d steps, not %d: stack.step_ratio %g gives earlier blocks more steps and later ones "
                 "fewer, at the same total FLOPs as %d steps per block (--step-ratio 1 gives every block the same steps)",
                 k, steps, cfg.train.steps, cfg.stack.step_ratio, cfg.train.steps)
    if lr != cfg.train.lr:
        log.info("block %d trains at peak lr %g, not %g (stack.lr_later %g)", k, lr, cfg.train.lr, cfg.stack.lr_later)
    cfg = cfg.with_train(steps=steps, lr=lr)

    return run_training(
        name=f"block_{k}",
        module=block,
        cfg=cfg,
        step_fn=BlockTask(objective, k, frozen, device).loss_fn(block, tstream),
        ckpt_path=run.block_path(k),
        state_path=run.block_state_path(k),
        metrics_path=run.metrics_path(f"block_{k}"),
        baseline_rss=baseline,
        save_meta=block_save_meta(cfg, k),
        valid=valid,
        evaluate=(  # block k's own CE, without the target (its prefix, or itself on pure noise)
            f"val_{objective.reference_name}",  # the key bench quality's block-0 lr sweep reads
            lambda x, gen: objective.local_logits(block, k, x, gen, frozen),
        ),
        progress=progress,
        device=device,
        precision=precision,
        flops_per_token=objective.train_flops_per_token(k),
    )
