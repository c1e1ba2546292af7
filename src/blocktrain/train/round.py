"""One round of a block: H inner steps on the stream the coordinator named, at the block's schedule position.

The worker (:mod:`blocktrain.worker.loop`), the in-process rounds (:mod:`blocktrain.coordinator.simulate`) and the
coordinator's audit replay (:mod:`blocktrain.coordinator.audit`) all train a round through :func:`train_round`, so
the replay of an honest worker's round is the same computation, step for step:

    for i in range(steps):  x, y = stream.batch(i);  loss = objective.block_loss(block_k, x, y, frozen)
                            lr = lr_at(offset + i)   (offset = version x H: the block's position in its schedule)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from blocktrain.config import Precision, TrainConfig
from blocktrain.data.stream import TrainStream
from blocktrain.device import CPU
from blocktrain.objectives.base import Objective
from blocktrain.train.loop import Figures, Hook, LoopResult, LossFn, train_steps
from blocktrain.train.step import lr_at

Targets = Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # (y, generator) -> the targets trained on


@dataclass(frozen=True)
class BlockTask:
    """What block k trains on: its objective's loss over its frozen inputs, on one device."""

    objective: Objective
    k: int  # the block index
    frozen: Sequence[nn.Module] = ()  # frozen copies of the blocks it reads (stack: 0..k-1)
    device: torch.device = CPU  # where block k, its frozen inputs and its batches live

    def loss_fn(self, block: nn.Module, stream: TrainStream, targets: Targets | None = None) -> LossFn:
        """step i -> block k's loss on the stream's batch i (``targets``: what a hostile replica trains on instead)."""

        def loss_at(i: int) -> tuple[torch.Tensor, Figures]:
            x, y = stream.batch(i)
            if targets is not None:
                y = targets(y, stream.generator(i, purpose=2))
            out = self.objective.block_loss(block, self.k, x.to(self.device), y.to(self.device),
                                            stream.generator(i, purpose=1), self.frozen)
            return out.loss, out.metrics

        return loss_at


def train_round(
    task: BlockTask,
    block: nn.Module,
    opt: torch.optim.Optimizer,
    stream: TrainStream,
    *,
    steps: int,
    offset: int,
    schedule: TrainConfig,
    precision: Precision,
    hooks: Sequence[Hook] = (),
    targets: Targets | None = None,
) -> LoopResult:
    """``steps`` inner steps of ``block`` on ``stream``; step i runs at lr_at(offset + i) of ``schedule``
    (its ``steps`` span the block's rounds x H)."""
    last = schedule.steps - 1
    return train_steps(block, opt, task.loss_fn(block, stream, targets), range(steps),
                       lr=lambda i: lr_at(min(offset + i, last), schedule), grad_clip=schedule.grad_clip,
                       precision=precision, device=task.device, hooks=hooks)
