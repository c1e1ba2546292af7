"""The ``diffusion`` objective: each block an EDM denoiser of the next byte's embedding (the paper's method).

A thin adapter over :mod:`blocktrain.diffusion`: the loss is
:func:`~blocktrain.diffusion.loss.block_loss` (sigma-weighted CE given
z = E[y] + sigma eps), the hand-off is z along the Euler chain of
:func:`~blocktrain.diffusion.sampler.chain_step`, and the single-block
references are the blocks used alone on pure noise. Kept as the reproduction
of the paper; issue 5 measured that its chain scores what one block scores alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, RunConfig, Schedule
from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import (
    block_alone_logits,
    chain_step,
    evaluations_per_traversal,
    initial_noise,
    solver_evaluations,
)
from blocktrain.errors import CheckpointError
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.flops import forward_flops_per_token, train_flops_per_token
from blocktrain.objectives.base import LocalLoss
from blocktrain.seeds import Seed


class DiffusionObjective:
    name = "diffusion"
    reference_name = "blocks_alone_ce"
    reference_label = "blocks alone"  # each block on pure noise
    deterministic = False
    trains_in_order = False
    gain_reference = "best"  # a chain must beat its best block alone
    composed_is_last_reference = False
    blocks_alike = True
    prefix_drafts = False  # block 0 on noise drafts, but it is no prefix of the chain
    serves_sweep = True  # the chain denoises the whole output window in each traversal
    serving_span = "blocktrain.serve.runtime.diffusion:BlockSpan"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.partition = NoisePartition(cfg.diffusion, cfg.model.n_blocks)

    def build_block(self, k: int) -> BlockDenoiser:
        return BlockDenoiser(self.cfg.model, self.cfg.diffusion.sigma_data)

    def block_steps(self, k: int) -> int:
        return self.cfg.train.steps

    def block_lr(self, k: int) -> float:
        return self.cfg.train.lr

    def inherit(self, block: nn.Module, k: int, earlier: Sequence[nn.Module], *, at_init: bool) -> None:
        """Diffusion blocks take nothing from one another."""

    def inherits(self) -> bool:
        return False

    def serving_blocker(self) -> str | None:
        return None

    def outer_step(self) -> str:
        return "average"  # Nesterov (eta 1.0, mu 0.9) lost to the plain average on a diffusion block (2.393 vs 2.356)

    def frozen_inputs(self, k: int) -> int:
        return 0  # a diffusion block never sees another block while it trains

    def freeze(self, block: nn.Module, dtype: torch.dtype) -> nn.Module:
        raise ValueError("diffusion blocks train alone; no block needs a frozen copy of another")

    def block_loss(
        self, block: nn.Module, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator,
        frozen: Sequence[nn.Module] = (),
    ) -> LocalLoss:
        assert isinstance(block, BlockDenoiser)
        out = block_loss(block, k, x, y, self.partition, self.cfg.diffusion, generator)
        return LocalLoss(out.loss, {"noised_ce": out.noised_ce, "mean_sigma": out.mean_sigma})

    def local_logits(
        self, block: nn.Module, k: int, x: torch.Tensor, generator: torch.Generator, frozen: Sequence[nn.Module] = (),
    ) -> torch.Tensor:
        assert isinstance(block, BlockDenoiser)
        return block_alone_logits(block, k, x, self.partition, generator)

    def initial_carry(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        shape = (int(x.shape[0]), int(x.shape[1]))
        return initial_noise(shape, self.cfg.model.d_model, self.cfg.diffusion.sigma_max, generator, x.device)

    def step(
        self, block: nn.Module, k: int, x: torch.Tensor, carry: torch.Tensor | None, *, want_logits: bool, is_last: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert isinstance(block, BlockDenoiser) and carry is not None
        z, logits = chain_step(block, k, x, carry, self.partition, self.cfg.diffusion, is_last)
        return z, logits if want_logits else None

    def reference_logits(self, blocks: Sequence[nn.Module], x: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        out = []
        for k, block in enumerate(blocks):
            assert isinstance(block, BlockDenoiser)
            out.append(block_alone_logits(block, k, x, self.partition, generator))
        return out

    def single_block_logits(
        self, blocks: Sequence[nn.Module], x: torch.Tensor, seed: int = 0, only: int | None = None,
    ) -> list[torch.Tensor]:
        """Each block alone on pure noise, one generator per block: each block alone is its own experiment."""
        ks = range(len(blocks)) if only is None else [only]
        return [self.local_logits(blocks[k], k, x, Seed.REFERENCE.generator(seed, k)) for k in ks]

    def schedule(self) -> Schedule:
        return Schedule.PROGRESSIVE  # diffusion blocks never wait for each other

    def checkpoint_meta(self, k: int) -> dict[str, str]:
        s = self.partition.slices[k]
        return {"objective": self.name, "sigma_lo": repr(s.sigma_lo), "sigma_hi": repr(s.sigma_hi)}

    def optional_meta(self) -> tuple[str, ...]:
        return ("objective",)  # diffusion checkpoints written before objectives existed carry no such field

    def check_composable(self, blocks: Sequence[nn.Module]) -> None:
        e0 = blocks[0].E  # type: ignore[union-attr]
        for k, b in enumerate(blocks):
            if not torch.equal(b.E, e0):  # type: ignore[union-attr,arg-type]
                raise CheckpointError(f"block {k} holds a different target embedding E; blocks are from other runs")

    def traversal_flops_per_byte(self, blocks: Sequence[nn.Module]) -> float:
        """A block's forward (:mod:`blocktrain.model.flops`, as the stack's and the training FLOPs are counted) times
        the block evaluations of one traversal, plus each solver step's denoiser product softmax(logits) @ E (2 x 256
        x d per token: E is a buffer, no Linear, so the module count misses it)."""
        m = self.cfg.model
        per_block = forward_flops_per_token(blocks[0], m.d_model, m.context)
        denoiser = 2.0 * VOCAB_SIZE * m.d_model * solver_evaluations(self.cfg.diffusion, m.n_blocks)
        return per_block * evaluations_per_traversal(self.cfg.diffusion, m.n_blocks) + denoiser

    def train_flops_per_token(self, k: int) -> float:
        m = self.cfg.model
        with torch.device("meta"):
            block = self.build_block(k)
        return train_flops_per_token(block, m.d_model, m.context)
