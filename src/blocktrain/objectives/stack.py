"""The ``stack`` objective: a residual-stream stack with a next-byte head per block.

Block k trains on next-byte cross-entropy of its own head, reading the
residual stream h_k that frozen copies of blocks 0..k-1 compute from the bytes
(no gradient crosses blocks). The hand-off between blocks and stages is h
(b, t, d). The single-block references are the prefixes: blocks 0..k with
block k's head, each a language model of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blocktrain.config import RunConfig
from blocktrain.diffusion.loss import lm_loss
from blocktrain.model.flops import forward_flops_per_token, train_flops_per_token
from blocktrain.model.stack import StackBlock, frozen_copy
from blocktrain.objectives.base import LocalLoss


class StackObjective:
    name = "stack"
    reference_name = "prefix_ce"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def build_block(self, k: int) -> StackBlock:
        return StackBlock(self.cfg.model, k, self.cfg.stack.head_layers)

    def frozen_inputs(self, k: int) -> int:
        return k

    def freeze(self, block: nn.Module, dtype: torch.dtype) -> StackBlock:
        assert isinstance(block, StackBlock)
        return frozen_copy(block, dtype)

    @torch.no_grad()
    def residual_input(self, k: int, x: torch.Tensor, frozen: Sequence[nn.Module]) -> torch.Tensor:
        """h_k (b, t, d) for block k > 0 from frozen blocks 0..k-1, or the bytes x for block 0."""
        if len(frozen) != k:
            raise ValueError(f"block {k} trains on frozen copies of blocks 0..{k - 1}; got {len(frozen)} blocks")
        h = x
        for block in frozen:
            h = block(h)
        return h.float() if k else x

    def block_loss(
        self, block: nn.Module, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator,
        frozen: Sequence[nn.Module] = (),
    ) -> LocalLoss:
        assert isinstance(block, StackBlock)
        logits = block.logits(block(self.residual_input(k, x, frozen)))
        return LocalLoss(lm_loss(logits, y), {})

    @torch.no_grad()
    def local_logits(
        self, block: nn.Module, k: int, x: torch.Tensor, generator: torch.Generator, frozen: Sequence[nn.Module] = (),
    ) -> torch.Tensor:
        assert isinstance(block, StackBlock)
        return block.logits(block(self.residual_input(k, x, frozen)))

    def initial_carry(self, x: torch.Tensor, generator: torch.Generator) -> None:
        return None  # block 0 reads the bytes themselves

    def step(
        self, block: nn.Module, k: int, x: torch.Tensor, carry: torch.Tensor | None, *, want_logits: bool, is_last: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert isinstance(block, StackBlock)
        h = block(x if k == 0 else carry)
        return h, block.logits(h) if want_logits else None

    @torch.no_grad()
    def reference_logits(self, blocks: Sequence[nn.Module], x: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        out = []
        carry: torch.Tensor | None = None
        for k, block in enumerate(blocks):
            carry, logits = self.step(block, k, x, carry, want_logits=True, is_last=k == len(blocks) - 1)
            assert logits is not None
            out.append(logits)
        return out

    def train_flops_per_token(self, k: int) -> float:
        m = self.cfg.model
        with torch.device("meta"):
            blocks = [self.build_block(j) for j in range(k + 1)]
        # frozen trunks run forward only (their heads are not part of a frozen copy)
        frozen = sum(forward_flops_per_token(b.layers, m.d_model, m.context) for b in blocks[:k])
        return frozen + train_flops_per_token(blocks[k], m.d_model, m.context)
