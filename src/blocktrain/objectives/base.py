"""The objective seam: what a block is trained on and how blocks compose.

Every user of blocks (trainers, the worker, the coordinator's evaluation, the
assembled model, serving stages) calls an :class:`Objective` instead of a
particular loss or chain. An objective answers three questions:

* **loss** -- the local loss of block k on a batch, given frozen copies of the
  blocks before it (``frozen_inputs(k)`` of them; 0 for the diffusion objective);
* **composition** -- the logits of a block sequence, folded block by block
  through :meth:`Objective.step` from :meth:`Objective.initial_carry`, and the
  logits of its single-block references (every prefix for ``stack``, every
  block alone for ``diffusion``) to measure the compositional gain against;
* **hand-off** -- the tensor that crosses from one block, or one stage, to the
  next (``z`` for diffusion, the residual stream ``h`` for stack).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from blocktrain.config import FrozenStorage, RunConfig, Schedule
from blocktrain.device import CPU


@dataclass(frozen=True)
class LocalLoss:
    loss: torch.Tensor  # scalar to minimise (fp32)
    metrics: dict[str, float | torch.Tensor]  # extra figures for the log (device scalars are read when logged)


class Objective(Protocol):
    """One block objective; see the module docstring."""

    name: str  # "diffusion" or "stack"
    cfg: RunConfig
    reference_name: str  # JSON key of the single-block references' CE: "prefix_ce" or "blocks_alone_ce"
    reference_label: str  # how a printed table names those references: "prefix CE" or "blocks alone"
    deterministic: bool  # composing draws no noise: one "chain" is all there is
    trains_in_order: bool  # block k trains only once blocks 0..k-1 have finished (it reads frozen copies of them)
    blocks_alike: bool  # every block has the same parameters (names and shapes): one template serves all
    gain_reference: str  # the reference a composed model's gain is measured against: "first" (prefix 0) or "best" block
    composed_is_last_reference: bool  # single_block_logits' last entry is the composed model (a stack's last prefix)
    prefix_drafts: bool  # block 0 alone is the composed model's first prefix, so the first stage drafts for spec serving
    serves_sweep: bool  # its stages serve the sweep mode: a traversal refines every output byte at once (no byte-per-pass)
    serving_span: str  # "module:Class" of the span that serves these blocks (serve/ builds it; this layer names it)

    def schedule(self) -> Schedule:
        """The schedule a run of this objective trains with."""

    def checkpoint_meta(self, k: int) -> dict[str, str]:
        """Metadata a checkpoint of block k carries (beyond its kind and index), and loading checks."""

    def optional_meta(self) -> tuple[str, ...]:
        """Keys of :meth:`checkpoint_meta` that checkpoints written by earlier releases may lack."""

    def check_composable(self, blocks: Sequence[nn.Module]) -> None:
        """CheckpointError when these trained blocks cannot compose (blocks of different runs)."""

    def traversal_flops_per_byte(self, blocks: Sequence[nn.Module]) -> float:
        """Forward FLOPs per scored byte of one traversal of the composed blocks."""

    def single_block_logits(
        self, blocks: Sequence[nn.Module], x: torch.Tensor, seed: int = 0, only: int | None = None,
    ) -> list[torch.Tensor]:
        """Logits of the single-block references on bytes x: every prefix (stack), or each block alone (diffusion),
        with the noise of ``seed``; ``only=k``: reference k's alone (a one-element list)."""

    def build_block(self, k: int) -> nn.Module:
        """A freshly initialised block k (fp32, on CPU)."""

    def frozen_inputs(self, k: int) -> int:
        """How many earlier blocks block k trains on (frozen)."""

    def block_steps(self, k: int) -> int:
        """Optimiser steps block k trains for (train.steps unless the objective splits the budget unequally)."""

    def block_lr(self, k: int) -> float:
        """Peak lr of block k's schedule (train.lr unless the objective trains some blocks at another), as its
        trainer, a worker, the in-process rounds and the coordinator's audit replay all read it."""

    def inherit(self, block: nn.Module, k: int, earlier: Sequence[nn.Module], *, at_init: bool) -> None:
        """Copy into block k what it takes from the whole earlier blocks 0..k-1 (warm start, frozen heads)."""

    def inherits(self) -> bool:
        """Whether :meth:`inherit` takes anything, so block k's trainer needs the earlier blocks whole."""

    def serving_blocker(self) -> str | None:
        """Why a pipeline of stages cannot serve this objective's runs (a message saying what to do), or None."""

    def outer_step(self) -> str:
        """The outer step decentralised training uses unless told otherwise: "nesterov" or "average"
        (measured per objective in benchmarks/results/averaging-study.md)."""

    def freeze(self, block: nn.Module, dtype: torch.dtype) -> nn.Module:
        """The forward-only copy of a finished block that later blocks' workers hold."""

    def block_loss(
        self, block: nn.Module, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator,
        frozen: Sequence[nn.Module] = (),
    ) -> LocalLoss:
        """Local loss of block k on bytes x (b, t) with next bytes y (b, t)."""

    def local_logits(
        self, block: nn.Module, k: int, x: torch.Tensor, generator: torch.Generator, frozen: Sequence[nn.Module] = (),
    ) -> torch.Tensor:
        """Block k's own next-byte logits without the target: its prefix (stack) or itself on pure noise (diffusion)."""

    def initial_carry(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        """What enters block 0 besides the bytes (z_0 = sigma_max eps, or nothing)."""

    def step(
        self, block: nn.Module, k: int, x: torch.Tensor, carry: torch.Tensor | None, *, want_logits: bool, is_last: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block k's share of a traversal: (the carry handed to block k+1, logits if wanted)."""

    def reference_logits(self, blocks: Sequence[nn.Module], x: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        """Logits of each single-block reference: prefix 0..k (stack) or block k alone (diffusion)."""

    def train_flops_per_token(self, k: int) -> float:
        """Training FLOPs per token of block k's step, frozen forward passes included."""


@torch.no_grad()
def compose_logits(
    objective: Objective, blocks: Sequence[nn.Module], x: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """One traversal of all blocks: logits (b, t, 256) of the composed model at every position of x (b, t)."""
    n = objective.cfg.model.n_blocks
    if len(blocks) != n:
        raise ValueError(f"composing needs all {n} blocks, got {len(blocks)}")
    carry = objective.initial_carry(x, generator)
    logits: torch.Tensor | None = None
    for k, block in enumerate(blocks):
        carry, logits = objective.step(block, k, x, carry, want_logits=k == n - 1, is_last=k == n - 1)
    assert logits is not None
    return logits


def frozen_dtype(storage: FrozenStorage, precision_is_bf16: bool) -> torch.dtype:
    """The dtype frozen copies store their matmul weights in (``TrainConfig.frozen_storage``; auto: bf16 when the
    worker computes in bf16, else fp32; torch.int8 for int8)."""
    if storage is FrozenStorage.AUTO:
        return torch.bfloat16 if precision_is_bf16 else torch.float32
    return {FrozenStorage.FP32: torch.float32, FrozenStorage.BF16: torch.bfloat16, FrozenStorage.INT8: torch.int8}[storage]


@torch.no_grad()
def whole_blocks(objective: Objective, states: Sequence[Mapping[str, torch.Tensor]]) -> list[nn.Module]:
    """Blocks 0..n-1 rebuilt from their trainable weights (fp32, CPU), each completed by what it inherits
    from the blocks before it (:meth:`Objective.inherit`: a stack variant's frozen heads)."""
    blocks: list[nn.Module] = []
    for k, state in enumerate(states):
        with torch.device(CPU):
            block = objective.build_block(k)
        params = dict(block.named_parameters())
        for name, tensor in state.items():
            params[name].copy_(tensor)
        objective.inherit(block, k, blocks, at_init=False)
        blocks.append(block)
    return blocks
