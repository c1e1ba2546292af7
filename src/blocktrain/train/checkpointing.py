"""Checkpoint and resume of one trained module: its weights and its AdamW state, saved and restored together.

The one place resume is written: :func:`blocktrain.train.run.run_training` keeps
one :class:`Checkpointer`, the concurrent stack schedule one per block. Both files
record the step. A save writes the new pair beside the old one (``<file>.next``,
:meth:`Checkpointer.stage`), then renames the weights and then the state into place
(:meth:`Checkpointer.commit`), so a kill between any two writes leaves a pair a
resume can load; a pair whose steps disagree otherwise is refused.
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
            load_optimizer_tensors(self.opt, self.names, self._state_at(step))
        return step

    def _state_at(self, step: int) -> dict[str, torch.Tensor]:
        """The optimiser state saved with the weights at ``step``: the state file, or the new state a save wrote beside
        it when it was killed between the weights and the state's rename (renamed into place now)."""
        found = []
        for path in (self.state, self._pending):
            if path.exists():
                tensors, meta = load_file(path)
                if int(meta.get("step", "-1")) == step:
                    if path == self._pending:
                        path.replace(self.state)
                    return tensors
                found.append(f"{path} is at step {meta.get('step')}")
        if not found:
            raise CheckpointError(f"{self.state} is missing; cannot resume {self.weights} at step {step}: "
                                  "delete the weights to start again")
        raise CheckpointError(f"{'; '.join(found)}, {self.weights} at {step}; delete both")

    @property
    def _pending(self) -> Path:
        """Where a save writes the new optimiser state before the weights (renamed into place after them)."""
        return self.state.with_name(self.state.name + ".next")

    @property
    def _pending_weights(self) -> Path:
        """Where :meth:`stage` writes the new weights (renamed into place by :meth:`commit`)."""
        return self.weights.with_name(self.weights.name + ".next")

    def stage(self, step: int) -> None:
        """Write the checkpoint at ``step`` beside the current one (the current one stays what a resume loads until
        :meth:`commit`): for modules checkpointed together, committed once every one is staged."""
        save_file(self._pending, optimizer_tensors(self.opt, self.names), {"step": str(step), "name": self.name})
        save_model(self._pending_weights, self.module, self.cfg, step=step, **self.meta)

    def staged_step(self) -> int | None:
        """The step of a checkpoint staged and not committed (None: none, or only part of one)."""
        if not (self._pending_weights.exists() and self._pending.exists()):
            return None
        return int(load_file(self._pending_weights)[1].get("step", "-1"))

    def commit(self) -> None:
        """Put the staged checkpoint in place: its weights, then its state (a resume then finds the state beside)."""
        self._pending_weights.replace(self.weights)
        self._pending.replace(self.state)

    def discard(self) -> None:
        """Drop a checkpoint staged and never committed."""
        self._pending_weights.unlink(missing_ok=True)
        self._pending.unlink(missing_ok=True)

    def save(self, step: int) -> None:
        self.stage(step)
        self.commit()

    def after(self, rec: StepRecord) -> None:
        if self.every and rec.done % self.every == 0:
            self.save(rec.done)

    def interrupted(self, done: int) -> None:
        log.warning("%s: interrupted; saving a checkpoint at step %d", self.name, done)
        self.save(done)
