"""Training all B blocks of a run: which block may train when.

* Blocks that train alone (``diffusion``) run as independent processes, up to
  ``parallel`` at a time.
* ``stack`` with the **progressive** schedule (the default): block k opens when
  block k-1 has finished its step budget, so the blocks run one after another,
  each in its own process, block k on frozen copies of the finished 0..k-1.
* ``stack`` with the **concurrent** schedule: every block is open at once, in
  one process. Training goes in rounds of ``round_steps`` steps per block;
  every ``refresh_rounds`` rounds the frozen copies that later blocks read are
  refreshed from the current earlier blocks. It exists to measure what
  staleness costs (block k learns on features that are still moving); use it
  only when blocks cannot wait for one another. Checkpoints fall on refresh
  boundaries, so a resumed run continues exactly.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from blocktrain.checkpoint.blocks import block_save_meta
from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import atomic_write_bytes
from blocktrain.config import Precision, RunConfig, Schedule
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import resolve_device, resolve_precision
from blocktrain.errors import BlockTrainError, CheckpointError
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import frozen_dtype
from blocktrain.seeds import block_stream, init_seed
from blocktrain.train.checkpointing import Checkpointer
from blocktrain.train.loop import MetricsHook, train_steps
from blocktrain.train.metrics import JsonlWriter, drop_after
from blocktrain.train.round import BlockTask
from blocktrain.train.step import lr_at, make_optimizer

log = logging.getLogger(__name__)


def train_concurrent(cfg: RunConfig, data: DataDir, out: Path, *, progress: bool = True) -> list[float]:
    """Train every block of a stack at once (see the module docstring); returns each block's last loss."""
    if not get_objective(cfg).trains_in_order:
        raise BlockTrainError("the concurrent schedule is for the stack objective; diffusion blocks never wait for each other")
    tc = cfg.train
    train = data.open("train")
    run = RunDir(out)
    cfg = run.init(cfg)
    objective = get_objective(cfg)
    device = resolve_device(tc.device)
    precision = resolve_precision(tc.precision, device)
    B = cfg.model.n_blocks
    if any(objective.block_steps(k) != tc.steps for k in range(B)):
        raise BlockTrainError("the concurrent schedule trains every block for train.steps steps; pass --step-ratio 1")
    blocks: list[nn.Module] = []
    for k in range(B):
        torch.manual_seed(init_seed(tc.seed, k))
        block = objective.build_block(k)
        objective.inherit(block, k, blocks, at_init=True)  # from the earlier blocks' initial weights
        blocks.append(block.to(device))
    ckpts = []
    for k, block in enumerate(blocks):
        opt, names = make_optimizer(block, tc)
        ckpts.append(Checkpointer(f"block_{k}", block, opt, names, cfg, run.block_path(k), run.block_state_path(k),
                                  block_save_meta(cfg, k)))
    streams = [TrainStream(train.data, cfg.model.context, tc.batch_size, tc.seed, stream=block_stream(k), device=device)
               for k in range(B)]
    metrics = [MetricsHook(JsonlWriter(run.metrics_path(f"block_{k}")), tc.log_every) for k in range(B)]
    schedules = [replace(tc, lr=objective.block_lr(k)) for k in range(B)]  # each block's peak lr (stack.lr_later)
    period = tc.round_steps * tc.refresh_rounds  # steps per block between refreshes (and checkpoints)
    start = _resume(run, ckpts)
    for k in range(B):  # the steps after the checkpoint it resumes from (0: none) are logged again
        if dropped := drop_after(run.metrics_path(f"block_{k}"), start):
            log.info("block_%d: dropped %d metrics records of steps after %d, which this run logs again", k, dropped,
                     start)
    dtype = frozen_dtype(tc.frozen_storage, precision is Precision.BF16)
    losses = [float("nan")] * B
    t0 = time.perf_counter()
    step = start
    while step < tc.steps:
        frozen = [objective.freeze(b, dtype) for b in blocks[:-1]]  # a refresh: snapshots of the current blocks
        for k in range(1, B):  # frozen heads (shared or residual) follow the same refresh
            objective.inherit(blocks[k], k, blocks[:k], at_init=False)
        end = min(tc.steps, step + period)
        for r0 in range(step, end, tc.round_steps):
            for k in range(B):
                loss_at = BlockTask(objective, k, frozen[:k], device).loss_fn(blocks[k], streams[k])
                lr = functools.partial(lr_at, cfg=schedules[k])  # step -> block k's lr
                losses[k] = train_steps(blocks[k], ckpts[k].opt, loss_at, range(r0, min(end, r0 + tc.round_steps)),
                                        lr=lr, grad_clip=tc.grad_clip, precision=precision, device=device,
                                        hooks=[metrics[k]]).last_loss
        step = end
        _checkpoint(run, ckpts, step)
        if progress:
            log.info("concurrent: step %d of %d per block, losses %s (%.0f s)", step, tc.steps,
                     ", ".join(f"{v:.3f}" for v in losses), time.perf_counter() - t0)
    for k in range(B):
        metrics[k].writer.write(event="summary", name=f"block_{k}", steps=step, schedule="concurrent",
                                final_loss=losses[k], wall_s=time.perf_counter() - t0)
    return losses


def _checkpoint(run: RunDir, ckpts: list[Checkpointer], step: int) -> None:
    """Every block at ``step`` (a refresh boundary), so a resumed run restarts them together: each is staged beside
    its last checkpoint, then the step is recorded (the commit point), then each is put in place. A kill before the
    record leaves the last checkpoints; after it, a resume puts the rest in place (it left blocks at mixed steps)."""
    for ckpt in ckpts:
        ckpt.stage(step)
    atomic_write_bytes(_committed_path(run), f"{step}\n".encode())
    for ckpt in ckpts:
        ckpt.commit()


def _committed_path(run: RunDir) -> Path:
    """The step of the concurrent run's last whole checkpoint (its commit point)."""
    return run.root / "blocks" / "concurrent.step"


def _finish_checkpoint(run: RunDir, ckpts: list[Checkpointer]) -> None:
    """A checkpoint a kill interrupted: put its staged blocks in place if its step was recorded, else drop them."""
    path = _committed_path(run)
    committed = int(path.read_text()) if path.exists() else None
    for ckpt in ckpts:
        staged = ckpt.staged_step()
        if staged is None:  # nothing staged, or killed inside its commit (the state waits beside: Checkpointer.resume)
            continue
        if staged == committed:
            ckpt.commit()
        else:
            ckpt.discard()


def _resume(run: RunDir, ckpts: list[Checkpointer]) -> int:
    """Restore every block at the same step, or start at 0; mixed steps mean a run of another schedule."""
    _finish_checkpoint(run, ckpts)
    present = [k for k, c in enumerate(ckpts) if c.exists()]
    if not present:
        return 0
    retry = "Resume it with the schedule that wrote it, or choose a new --out"
    if len(present) != len(ckpts):
        raise CheckpointError(f"{run.root} holds checkpoints of blocks {present} only; a concurrent run checkpoints "
                              f"them together. {retry}")
    steps = {c.resume() for c in ckpts}
    if len(steps) != 1:
        raise CheckpointError(f"{run.root} holds blocks at different steps {sorted(steps)}; a concurrent run "
                              f"checkpoints them together. {retry}")
    step = steps.pop()
    log.info("concurrent: resuming at step %d of %d per block", step, ckpts[0].cfg.train.steps)
    return step


def schedule_of(cfg: RunConfig) -> Schedule:
    """The schedule a run trains with (diffusion blocks are always independent)."""
    return get_objective(cfg).schedule()
