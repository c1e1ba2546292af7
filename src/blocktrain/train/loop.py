"""The one training loop: every trainer's optimiser steps go through :func:`train_steps`.

    for step in steps:  before hooks -> lr -> autocast(loss) -> optimizer_step -> after hooks

Block and E2E training (:mod:`.run`), the concurrent stack schedule, the worker's
local rounds, the in-process averaging rounds and the benchmark scripts all call
it; what differs between them (logging, checkpoints, evaluation, progress, a
round's deadline) is a :class:`Hook`. A step counts as done once its optimiser
update is applied, so a Ctrl-C inside a hook tells the hooks the step is done and
a resumed run does not repeat it.

No step waits for the device: the loss, the gradient norm and the loss function's figures stay device tensors in
the :class:`StepRecord`, read (and so waited for) only by a hook that logs them, every ``log_every`` steps or once a
second for the progress bar. On CUDA each step is bracketed by two timing events, read after the loop, so
``LoopResult.step_seconds`` is the device's time per step there, not the host's time to queue one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from blocktrain.config import Precision
from blocktrain.device import CPU, autocast, synchronize
from blocktrain.train.metrics import JsonlWriter
from blocktrain.train.step import optimizer_step

__all__ = ["EvalHook", "Figures", "Hook", "LossFn", "MetricsHook", "ProgressHook", "StepRecord", "train_steps"]

Figures = dict[str, "float | torch.Tensor"]  # a loss function's extra figures: floats, or scalars on the device
LossFn = Callable[[int], tuple[torch.Tensor, Figures]]  # step -> (loss, extra figures)


@dataclass(frozen=True)
class StepRecord:
    done: int  # schedule position after this step (its index + 1)
    loss_t: torch.Tensor  # training loss of the step, a scalar on the device
    lr: float  # learning rate it applied
    grad_norm_t: torch.Tensor  # global gradient norm before clipping, a scalar on the device
    seconds: float  # host wall time of the step (data, forward, backward, update queued; waited for on a CPU)
    figures: Figures = field(default_factory=dict)  # the loss function's extra figures

    @property
    def loss(self) -> float:
        """The loss as a number: waits for the device."""
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)

    @property
    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.figures.items()}


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
    step_seconds: list[float]  # wall time of every step run (CUDA: between the step's two timing events)


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
    last: torch.Tensor | None = None
    timer = StepTimer(device)
    try:
        for step in steps:
            if not all(h.before(step) for h in hooks):
                break
            t0 = time.perf_counter()
            if device.type == "cuda":  # a new iteration for CUDA graphs (compile's reduce-overhead); else nothing
                torch.compiler.cudagraph_mark_step_begin()
            timer.start()
            rate = lr(step)
            with autocast(precision, device):
                loss, extra = loss_at(step)
            gnorm = optimizer_step(module, opt, loss, rate, grad_clip, stepped=partial(setattr, result, "done", step + 1))
            timer.stop()
            last = loss.detach()
            result.step_seconds.append(time.perf_counter() - t0)
            rec = StepRecord(result.done, last, rate, gnorm, result.step_seconds[-1], extra)
            for h in hooks:
                h.after(rec)
    except KeyboardInterrupt:
        for h in hooks:
            h.interrupted(result.done)
        raise
    finally:
        synchronize(device)
    if last is not None:
        result.last_loss = float(last)
    result.step_seconds = timer.seconds() or result.step_seconds
    return result


class StepTimer:
    """Device time of each step on CUDA: a pair of timing events around it, read once the loop has ended (no wait
    per step). On other devices the host clock already is the device's (it computes synchronously): nothing here."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple[Any, Any]] = []

    def start(self) -> None:
        if self.cuda:
            self.pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.pairs[-1][0].record()

    def stop(self) -> None:
        if self.cuda:
            self.pairs[-1][1].record()

    def seconds(self) -> list[float]:
        """Each timed step's seconds (the device synchronised first); [] off CUDA."""
        return [a.elapsed_time(b) / 1e3 for a, b in self.pairs]


class ProgressHook(Hook):
    """Advances a tqdm bar and shows the loss, and bytes/s (given ``bytes_per_step``) or the lr."""

    every_s = 1.0  # seconds between two postfix refreshes: each reads the loss, so waits for the device

    def __init__(self, bar: Any, bytes_per_step: int = 0) -> None:
        self.bar = bar
        self.bytes_per_step = bytes_per_step
        self.t0 = time.perf_counter()
        self.steps = 0
        self._shown = -float("inf")  # clock of the last postfix refresh

    def after(self, rec: StepRecord) -> None:
        self.steps += 1
        self.bar.update(1)
        now = time.perf_counter()
        if getattr(self.bar, "disable", False) or now - self._shown < self.every_s:  # a hidden bar never waits
            return
        self._shown = now
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
            loss = rec.loss  # first: reading it waits for the device, so the rate counts the steps done, not queued
            rate = {"bytes_per_s": self.progress.rate()} if self.progress and self.progress.bytes_per_step else {}
            self.writer.write(step=rec.done, loss=loss, lr=rec.lr, grad_norm=rec.grad_norm, **rate,
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
