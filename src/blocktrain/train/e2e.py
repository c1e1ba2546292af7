"""Train the end-to-end reference with plain next-byte cross-entropy."""

from __future__ import annotations

from pathlib import Path

import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import resolve_device, resolve_precision
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.flops import train_flops_per_token
from blocktrain.model.layers import recompute_layers
from blocktrain.model.loss import lm_loss
from blocktrain.seeds import E2E_INIT, E2E_STREAM, init_seed
from blocktrain.train.loop import Figures
from blocktrain.train.memory import rss_bytes, warm_runtime
from blocktrain.train.run import TrainSummary, run_training


def train_e2e(cfg: RunConfig, data: DataDir, out: Path, *, progress: bool = True) -> TrainSummary:
    train = data.open("train")  # validate inputs before anything is written
    valid = data.open("valid") if cfg.train.eval_bytes else None
    run = RunDir(out)
    cfg = run.init(cfg)
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    # A data stream of its own, distinct from every block's.
    tstream = TrainStream(train.data, cfg.model.context, cfg.train.batch_size, cfg.train.seed, stream=E2E_STREAM, device=device)
    warm_runtime()  # before the seed: its throwaway module draws from the global generator (as train_block does)
    baseline = rss_bytes()
    torch.manual_seed(init_seed(cfg.train.seed, E2E_INIT))
    model = E2ETransformer(cfg.model).to(device)
    recompute_layers(model, cfg.train.recompute)

    def step_fn(step: int) -> tuple[torch.Tensor, Figures]:
        x, y = tstream.batch(step)
        return lm_loss(model(x.to(device)), y.to(device)), {}

    return run_training(
        name="e2e",
        module=model,
        cfg=cfg,
        step_fn=step_fn,
        ckpt_path=run.e2e_path(),
        state_path=run.e2e_state_path(),
        metrics_path=run.metrics_path("e2e"),
        baseline_rss=baseline,
        save_meta={"kind": "e2e"},
        valid=valid,
        evaluate=("val_ce", lambda x, gen: model(x)),
        progress=progress,
        device=device,
        precision=precision,
        flops_per_token=train_flops_per_token(model, cfg.model.d_model, cfg.model.context),
    )
