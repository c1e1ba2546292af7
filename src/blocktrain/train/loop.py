"""The optimisation loop shared by block and E2E training.

Resumable: model weights and AdamW state are checkpointed together, and all
randomness (data windows, noise) is a pure function of (seed, stream, step),
so a resumed run continues exactly where the killed one stopped. Ctrl-C saves
a checkpoint before exiting.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from blocktrain.checkpoint.run import load_model, load_optimizer_tensors, optimizer_tensors, save_model
from blocktrain.checkpoint.safetensors_io import load_file, save_file
from blocktrain.config import Precision, RunConfig
from blocktrain.device import autocast
from blocktrain.errors import CheckpointError
from blocktrain.progress import progress_bar
from blocktrain.train.memory import peak_rss_bytes
from blocktrain.train.metrics import JsonlWriter
from blocktrain.train.step import lr_at, make_optimizer, optimizer_bytes, optimizer_step

__all__ = ["TrainSummary", "run_training"]

log = logging.getLogger(__name__)

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]  # step -> (loss, extra metrics)
EvalFn = Callable[[], dict[str, float]]


@dataclass(frozen=True)
class TrainSummary:
    name: str  # "block_k" or "e2e"
    steps: int  # steps completed in total (including resumed ones)
    wall_s: float  # wall-clock seconds of this process's training
    final_loss: float  # last training loss (NaN if no step ran)
    params: int  # trainable parameters
    optimizer_bytes: int  # bytes of AdamW state
    baseline_rss: int  # RSS just before the model was built
    peak_rss: int  # peak RSS of the process
    train_mem_bytes: int  # peak_rss - baseline_rss
    eval: dict[str, float]  # final evaluation figures
    precision: str  # arithmetic of the forward/backward pass ("bf16" or "fp32")
    device: str  # where it trained
    seconds_per_step: float  # median wall time of one step (data, forward, backward, update), first step excluded
    flops_per_step: float  # model FLOPs of one step (6 N tokens + attention; frozen forwards included)
    achieved_flops: float  # flops_per_step / seconds_per_step, FLOP/s


def run_training(
    *,
    name: str,
    module: nn.Module,
    cfg: RunConfig,
    step_fn: StepFn,
    ckpt_path: Path,
    state_path: Path,
    metrics_path: Path,
    bytes_per_step: int,
    baseline_rss: int,
    save_meta: dict[str, str],
    eval_fn: EvalFn | None = None,
    progress: bool = True,
    device: torch.device | None = None,
    precision: Precision = Precision.FP32,
    flops_per_step: float = 0.0,
) -> TrainSummary:
    """Train ``module`` (already on ``device``) for cfg.train.steps steps of ``step_fn`` under ``precision``."""
    tc = cfg.train
    device = device or torch.device("cpu")
    opt, names = make_optimizer(module, tc)
    start = 0
    if ckpt_path.exists():
        ckpt = load_model(ckpt_path, module, cfg, save_meta["kind"], **{k: v for k, v in save_meta.items() if k != "kind"})
        start = ckpt.step
        if start > 0:
            if not state_path.exists():
                raise CheckpointError(f"{state_path} is missing; cannot resume {ckpt_path} at step {start}")
            st, st_meta = load_file(state_path)
            if int(st_meta.get("step", "-1")) != start:
                raise CheckpointError(f"{state_path} is at step {st_meta.get('step')}, weights at {start}; delete both")
            load_optimizer_tensors(opt, names, st)
        log.info("%s: resuming at step %d of %d", name, start, tc.steps)
    metrics = JsonlWriter(metrics_path)

    def checkpoint(step: int) -> None:
        save_file(state_path, optimizer_tensors(opt, names), {"step": str(step), "name": name})
        save_model(ckpt_path, module, cfg, step=step, **save_meta)

    if start == 0:
        checkpoint(0)  # step-0 weights: initial state is reproducible and resumable
    module.train()
    t0 = time.perf_counter()
    last_loss = float("nan")
    done = start  # optimiser steps applied so far: what a checkpoint records
    bar = progress_bar(total=tc.steps, initial=start, desc=name, unit="step", disable=not progress, dynamic_ncols=True)
    step_times: list[float] = []
    try:
        for step in range(start, tc.steps):
            ts = time.perf_counter()
            lr = lr_at(step, tc)
            with autocast(precision, device):
                loss, extra = step_fn(step)
            gnorm = optimizer_step(module, opt, loss, lr, tc.grad_clip)
            done = step + 1
            last_loss = float(loss.detach())  # also waits for an asynchronous device
            step_times.append(time.perf_counter() - ts)
            elapsed = time.perf_counter() - t0
            rate = (done - start) * bytes_per_step / max(elapsed, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", bytes_s=f"{rate:,.0f}")
            if done % tc.log_every == 0 or done == tc.steps:
                metrics.write(step=done, loss=last_loss, lr=lr, grad_norm=gnorm, bytes_per_s=rate, step_s=step_times[-1], **extra)
            if done % tc.checkpoint_every == 0:
                checkpoint(done)
            if eval_fn is not None and tc.eval_every and done % tc.eval_every == 0:
                metrics.write(step=done, event="eval", **eval_fn())
                module.train()
    except KeyboardInterrupt:
        log.warning("%s: interrupted; saving a checkpoint at step %d", name, done)
        checkpoint(done)
        raise
    finally:
        bar.close()
    checkpoint(done)
    wall = time.perf_counter() - t0
    peak = peak_rss_bytes()
    final_eval = eval_fn() if eval_fn is not None else {}
    if final_eval:
        metrics.write(step=done, event="eval", **final_eval)
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    timed = step_times[1:] or step_times  # the first step of a process pays one-off kernel set-up
    s_per_step = statistics.median(timed) if timed else float("nan")
    summary = TrainSummary(
        name=name,
        steps=done,
        wall_s=wall,
        final_loss=last_loss,
        params=params,
        optimizer_bytes=optimizer_bytes(module),
        baseline_rss=baseline_rss,
        peak_rss=peak,
        train_mem_bytes=peak - baseline_rss,
        eval=final_eval,
        precision=precision.value,
        device=str(device),
        seconds_per_step=s_per_step,
        flops_per_step=flops_per_step,
        achieved_flops=flops_per_step / s_per_step if timed else float("nan"),
    )
    metrics.write(event="summary", **{k: v for k, v in summary.__dict__.items()})
    return summary
