"""Checkpoint and resume of one trained module: its weights and its AdamW state, saved and restored together.

The one place resume is written: :func:`blocktrain.train.run.run_training` keeps
one :class:`Checkpointer`, the concurrent stack schedule one per block. Both files
record the step; a resume refuses a pair whose steps disagree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from blocktrain.checkpoint.run import load_model, load_optimizer_tensors, optimizer_tensors, save_model
from blocktrain.checkpoint.safetensors_io import load_file, save_file
from blocktrain.config import RunConfig
from blocktrain.errors import CheckpointError
from blocktrain.train.loop import Hook, StepRecord

log = logging.getLogger(__name__)


class Checkpointer(Hook):
    """Weights at ``weights``, optimiser state at ``state``; as a loop hook, saves every ``every`` steps and on Ctrl-C."""

    def __init__(self, name: str, module: nn.Module, opt: torch.optim.Optimizer, names: dict[int, str], cfg: RunConfig,
                 weights: Path, state: Path, meta: dict[str, str], every: int = 0) -> None:
        self.name = name
        self.module = module
        self.opt = opt
        self.names = names  # optimiser parameter index -> parameter name
        self.cfg = cfg
        self.weights = weights
        self.state = state
        self.meta = meta  # save_model metadata; "kind" names the checkpoint kind
        self.every = every  # steps between checkpoints (0: only when asked)

    def exists(self) -> bool:
        return self.weights.exists()

    def resume(self) -> int:
        """Load the checkpoint if there is one; returns the step it holds (0 when there is none)."""
        if not self.weights.exists():
            return 0
        expect = {k: v for k, v in self.meta.items() if k != "kind"}
        step = load_model(self.weights, self.module, self.cfg, self.meta["kind"], **expect).step
        if step > 0:
            if not self.state.exists():
                raise CheckpointError(f"{self.state} is missing; cannot resume {self.weights} at step {step}: "
                                      "delete the weights to start again")
            tensors, meta = load_file(self.state)
            if int(meta.get("step", "-1")) != step:
                raise CheckpointError(f"{self.state} is at step {meta.get('step')}, {self.weights} at {step}; delete both")
            load_optimizer_tensors(self.opt, self.names, tensors)
        return step

    def save(self, step: int) -> None:
        save_file(self.state, optimizer_tensors(self.opt, self.names), {"step": str(step), "name": self.name})
        save_model(self.weights, self.module, self.cfg, step=step, **self.meta)

    def after(self, rec: StepRecord) -> None:
        if self.every and rec.done % self.every == 0:
            self.save(rec.done)

    def interrupted(self, done: int) -> None:
        log.warning("%s: interrupted; saving a checkpoint at step %d", self.name, done)
        self.save(done)
