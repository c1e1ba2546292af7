"""The one training loop: every trainer's optimiser steps go through :func:`train_steps`.

    for step in steps:  before hooks -> lr -> autocast(loss) -> optimizer_step -> after hooks

Block and E2E training (:mod:`.run`), the concurrent stack schedule, the worker's
local rounds, the in-process averaging rounds and the benchmark scripts all call
it; what differs between them (logging, checkpoints, evaluation, progress, a
round's deadline) is a :class:`Hook`. A step counts as done once its optimiser
update is applied, so a Ctrl-C inside a hook tells the hooks the step is done and
a resumed run does not repeat it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from blocktrain.config import Precision
from blocktrain.device import CPU, autocast
from blocktrain.train.metrics import JsonlWriter
from blocktrain.train.step import optimizer_step

__all__ = ["EvalHook", "Hook", "LossFn", "MetricsHook", "ProgressHook", "StepRecord", "train_steps"]

LossFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]  # step -> (loss, extra metrics)


@dataclass(frozen=True)
class StepRecord:
    done: int  # schedule position after this step (its index + 1)
    loss: float  # training loss of the step
    lr: float  # learning rate it applied
    grad_norm: float  # global gradient norm before clipping
    seconds: float  # wall time of the whole step (data, forward, backward, update)
    metrics: dict[str, float] = field(default_factory=dict)  # the loss function's extra figures


class Hook:
    """What a trainer adds to the loop; every method is optional (the defaults do nothing)."""

    def before(self, step: int) -> bool:
        """Called before ``step``; False stops the loop without running it."""
        return True

    def after(self, rec: StepRecord) -> None:
        """Called once the step's update is applied."""

    def interrupted(self, done: int) -> None:
        """Ctrl-C: ``done`` steps are applied (the exception is re-raised afterwards)."""


@dataclass
class LoopResult:
    done: int  # schedule position reached (first step not run)
    last_loss: float  # loss of the last step run (NaN if none)
    step_seconds: list[float]  # wall time of every step run


def train_steps(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    loss_at: LossFn,
    steps: range,
    *,
    lr: Callable[[int], float],
    grad_clip: float,
    precision: Precision = Precision.FP32,
    device: torch.device | None = None,
    hooks: Sequence[Hook] = (),
) -> LoopResult:
    """Optimiser steps ``steps`` of ``module`` on ``loss_at(step)`` at ``lr(step)``; see the module docstring."""
    device = device or CPU
    result = LoopResult(done=steps.start, last_loss=float("nan"), step_seconds=[])
    module.train()
    try:
        for step in steps:
            if not all(h.before(step) for h in hooks):
                break
            t0 = time.perf_counter()
            rate = lr(step)
            with autocast(precision, device):
                loss, extra = loss_at(step)
            gnorm = optimizer_step(module, opt, loss, rate, grad_clip)
            result.done = step + 1
            result.last_loss = float(loss.detach())  # also waits for an asynchronous device
            result.step_seconds.append(time.perf_counter() - t0)
            rec = StepRecord(result.done, result.last_loss, rate, gnorm, result.step_seconds[-1], extra)
            for h in hooks:
                h.after(rec)
    except KeyboardInterrupt:
        for h in hooks:
            h.interrupted(result.done)
        raise
    return result


class ProgressHook(Hook):
    """Advances a tqdm bar and shows the loss, and bytes/s (given ``bytes_per_step``) or the lr."""

    def __init__(self, bar: Any, bytes_per_step: int = 0) -> None:
        self.bar = bar
        self.bytes_per_step = bytes_per_step
        self.t0 = time.perf_counter()
        self.steps = 0

    def after(self, rec: StepRecord) -> None:
        self.steps += 1
        self.bar.update(1)
        if self.bytes_per_step:
            self.bar.set_postfix(loss=f"{rec.loss:.3f}", bytes_s=f"{self.rate():,.0f}")
        else:
            self.bar.set_postfix(loss=f"{rec.loss:.3f}", lr=f"{rec.lr:.2e}")

    def rate(self) -> float:
        """Training bytes per second since the hook was made."""
        return self.steps * self.bytes_per_step / max(time.perf_counter() - self.t0, 1e-9)


class MetricsHook(Hook):
    """A JSONL line every ``every`` steps and at step ``last``: loss, lr, gradient norm, step time, extras."""

    def __init__(self, writer: JsonlWriter, every: int, last: int = 0, progress: ProgressHook | None = None) -> None:
        self.writer = writer
        self.every = every
        self.last = last
        self.progress = progress  # its bytes/s goes in the line too

    def after(self, rec: StepRecord) -> None:
        if rec.done % self.every == 0 or rec.done == self.last:
            rate = {"bytes_per_s": self.progress.rate()} if self.progress and self.progress.bytes_per_step else {}
            self.writer.write(step=rec.done, loss=rec.loss, lr=rec.lr, grad_norm=rec.grad_norm, **rate,
                              step_s=rec.seconds, **rec.metrics)


class EvalHook(Hook):
    """Evaluates every ``every`` steps (0: never during training) and logs the figures as an ``eval`` event."""

    def __init__(self, evaluate: Callable[[], dict[str, float]], every: int, writer: JsonlWriter, module: nn.Module) -> None:
        self.evaluate = evaluate
        self.every = every
        self.writer = writer
        self.module = module

    def after(self, rec: StepRecord) -> None:
        if self.every and rec.done % self.every == 0:
            self.writer.write(step=rec.done, event="eval", **self.evaluate())
            self.module.train()
