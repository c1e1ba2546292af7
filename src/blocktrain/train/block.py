"""Train one block alone: config + data directory + its own checkpoint.

Peak memory is one block and its optimiser: the other blocks are never built.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import block_alone_logits
from blocktrain.errors import ConfigError
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.block import BlockDenoiser
from blocktrain.train.loop import TrainSummary, run_training
from blocktrain.train.memory import rss_bytes, warm_runtime

log = logging.getLogger(__name__)


def check_block_index(k: int, n_blocks: int) -> None:
    if not 0 <= k < n_blocks:
        raise ConfigError(f"block index {k} is out of range; this config has B={n_blocks} blocks (0..{n_blocks - 1})")


def block_save_meta(cfg: RunConfig, k: int) -> dict[str, str]:
    s = NoisePartition(cfg.diffusion, cfg.model.n_blocks).slices[k]
    return {"kind": "block", "block_index": str(k), "sigma_lo": repr(s.sigma_lo), "sigma_hi": repr(s.sigma_hi)}


def train_block(
    cfg: RunConfig, data: DataDir, out: Path, k: int, *, progress: bool = True, stream: int = 0
) -> TrainSummary:
    check_block_index(k, cfg.model.n_blocks)
    train = data.open("train")  # validate inputs before anything is written
    valid = data.open("valid") if cfg.train.eval_bytes else None
    run = RunDir(out)
    cfg = run.init(cfg)
    partition = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    tstream = TrainStream(train.data, cfg.model.context, cfg.train.batch_size, cfg.train.seed, stream=1000 * k + stream)
    torch.manual_seed(cfg.train.seed * 1009 + k)
    warm_runtime()
    baseline = rss_bytes()
    block = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)

    def step_fn(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = tstream.batch(step)
        out = block_loss(block, k, x, y, partition, cfg.diffusion, tstream.generator(step, purpose=1))
        return out.loss, {"noised_ce": out.noised_ce, "mean_sigma": out.mean_sigma}

    def eval_fn() -> dict[str, float]:
        """Block-alone CE on validation (pure noise at its own sigma): honest, never leaky."""
        assert valid is not None
        block.eval()
        gen = torch.Generator().manual_seed(cfg.train.seed)

        def lp(x: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(block_alone_logits(block, k, x, partition, gen), dim=-1).unsqueeze(0)

        res = score_split(lp, valid.data, cfg.model.context, max_bytes=cfg.train.eval_bytes)
        return {"val_block_alone_ce": res.ce_nats_per_byte}

    return run_training(
        name=f"block_{k}",
        module=block,
        cfg=cfg,
        step_fn=step_fn,
        ckpt_path=run.block_path(k),
        state_path=run.block_state_path(k),
        metrics_path=run.metrics_path(f"block_{k}"),
        bytes_per_step=cfg.train.batch_size * cfg.model.context,
        baseline_rss=baseline,
        save_meta=block_save_meta(cfg, k),
        eval_fn=eval_fn if valid is not None else None,
        progress=progress,
    )
