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

from blocktrain.config import RunConfig, Schedule, StackDense, StackHead, StackInit
from blocktrain.model.flops import forward_flops_per_token, train_flops_per_token
from blocktrain.model.layers import recompute_layers
from blocktrain.model.loss import lm_loss
from blocktrain.model.stack import FrozenHead, StackBlock, frozen_copy
from blocktrain.objectives.base import LocalLoss


class StackObjective:
    name = "stack"
    reference_name = "prefix_ce"
    reference_label = "prefix CE"  # blocks 0..k with block k's head
    deterministic = True
    trains_in_order = True
    gain_reference = "first"  # the composed stack is its own last prefix: its gain is over block 0 with its head
    composed_is_last_reference = True
    blocks_alike = False  # block 0 embeds the bytes, the others read h
    prefix_drafts = True  # every prefix is a language model trained to predict the byte the whole stack predicts
    serves_sweep = False  # a stack emits one byte per traversal (ar, spec)
    serving_span = "blocktrain.serve.runtime.stack:StackSpan"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def head_layers(self, k: int) -> int:
        """Layers in block k's head: the private ones, plus the training-time decoder on every block but the last."""
        sc = self.cfg.stack
        if sc.head is StackHead.SHARED and k > 0:
            return self.head_layers(0)  # a copy of block 0's head
        return sc.head_layers + (sc.aux_layers if k < self.cfg.model.n_blocks - 1 else 0)

    def _prev_head(self, k: int) -> FrozenHead | None:
        """The frozen head chain a residual head adds to: block k-1's head, with its own chain."""
        if self.cfg.stack.head is not StackHead.RESIDUAL or k == 0:
            return None
        m = self.cfg.model
        return FrozenHead(m.d_model, m.n_heads, m.mlp_ratio, self.head_layers(k - 1), self._prev_head(k - 1))

    def dense_inputs(self, k: int) -> int:
        """Stream states block k mixes: 0 (it reads h_k), 2 (h_0 and h_k) or k + 1 (h_0..h_k)."""
        dense = self.cfg.stack.dense
        return 0 if dense is StackDense.OFF or k == 0 else 2 if dense is StackDense.EMBED else k + 1

    def build_block(self, k: int) -> StackBlock:
        shared = self.cfg.stack.head is StackHead.SHARED and k > 0
        block = StackBlock(self.cfg.model, k, self.head_layers(k), prev_head=self._prev_head(k), frozen_head=shared,
                           dense_inputs=self.dense_inputs(k))
        recompute_layers(block, self.cfg.train.recompute)
        return block

    def _pick(self, states: torch.Tensor) -> torch.Tensor:
        """What the next block reads of the stream states (b, t, m, d) so far: all, or h_0 and the last."""
        return states[:, :, [0, -1]] if self.cfg.stack.dense is StackDense.EMBED else states

    def outer_step(self) -> str:
        return "nesterov"  # eta 1.0, mu 0.9 beat the plain average on block 0 at H=25 (2.024 vs 2.080)

    def serving_blocker(self) -> str | None:
        if self.cfg.stack.dense is not StackDense.OFF:
            return ("a stack with dense inputs hands every earlier stream state to the next block, and serving stages "
                    "pass h alone; serve a run trained with --dense off")
        return None

    def frozen_inputs(self, k: int) -> int:
        return k

    def block_lr(self, k: int) -> float:
        """Block 0 at train.lr; blocks 1.. at stack.lr_later x train.lr (under ``init copy`` they fine-tune a copy of
        the block before, which a lower peak lr disturbs less)."""
        return self.cfg.train.lr * (self.cfg.stack.lr_later if k > 0 else 1.0)

    def block_steps(self, k: int) -> int:
        """Optimiser steps of block k: train.steps, or a geometric split (ratio r = stack.step_ratio) of the same FLOPs.

        steps_k = round(c r^k S) with c = sum_j F_j / sum_j r^j F_j, F_j block j's training FLOPs per token,
        so that sum_k steps_k F_k = S sum_k F_k: the equal split's FLOPs, frozen forward passes included.
        """
        S, r = self.cfg.train.steps, self.cfg.stack.step_ratio
        if r == 1.0:
            return S
        F = [self.train_flops_per_token(j) for j in range(self.cfg.model.n_blocks)]
        c = sum(F) / sum(r**j * f for j, f in enumerate(F))
        return max(1, round(c * r**k * S))

    @torch.no_grad()
    def inherit(self, block: nn.Module, k: int, earlier: Sequence[nn.Module], *, at_init: bool) -> None:
        """Give block k what it takes from the finished blocks 0..k-1 (``earlier``, whole, heads included).

        At initialisation: ``stack.init`` (a copy of block k-1, or zeroed branches and block k-1's head).
        At initialisation and at every refresh (concurrent schedule): the frozen head a shared or residual
        head reads (block 0's, or block k-1's).
        """
        assert isinstance(block, StackBlock)
        if k == 0:
            return
        if len(earlier) != k:
            raise ValueError(f"block {k} inherits from blocks 0..{k - 1}; got {len(earlier)} blocks")
        prev = earlier[k - 1]
        assert isinstance(prev, StackBlock)
        sc = self.cfg.stack
        if at_init and sc.init is not StackInit.FRESH:
            block.copy_from(prev, layers=sc.init is StackInit.COPY, head=sc.head is StackHead.PRIVATE)
            if sc.init is StackInit.IDENTITY:
                block.zero_branches()
        if sc.head is StackHead.SHARED:
            first = earlier[0]
            assert isinstance(first, StackBlock)
            block.copy_from(first, layers=False, head=True)
        elif sc.head is StackHead.RESIDUAL:
            assert block.prev_head is not None
            block.prev_head.load_from(prev)

    def inherits(self) -> bool:
        """Whether block k > 0 takes anything from the earlier blocks' whole weights (see :meth:`inherit`)."""
        return self.cfg.stack.init is not StackInit.FRESH or self.cfg.stack.head is not StackHead.PRIVATE

    def freeze(self, block: nn.Module, dtype: torch.dtype) -> StackBlock:
        assert isinstance(block, StackBlock)
        return frozen_copy(block, dtype)

    @torch.no_grad()
    def residual_input(self, k: int, x: torch.Tensor, frozen: Sequence[nn.Module]) -> torch.Tensor:
        """h_k (b, t, d) for block k > 0 from frozen blocks 0..k-1, or the bytes x for block 0."""
        if len(frozen) != k:
            raise ValueError(f"block {k} trains on frozen copies of blocks 0..{k - 1}; got {len(frozen)} blocks")
        if k == 0:
            return x
        if self.cfg.stack.dense is StackDense.OFF:
            h = x
            for block in frozen:
                h = block(h)
            return h.float()
        carry: torch.Tensor | None = None
        for j, block in enumerate(frozen):
            carry, _ = self.step(block, j, x, carry, want_logits=False, is_last=False)
        assert carry is not None
        return self._pick(carry)

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
        if self.cfg.stack.dense is StackDense.OFF:
            h = block(x if k == 0 else carry)
            return h, block.logits(h) if want_logits else None
        # dense inputs: the carry is every stream state so far, h_0..h_{k+1} (b, t, k + 2, d)
        if k == 0:
            h = block(x)
            states = torch.stack([block.embed(x), h], dim=2)  # (b, t, 2, d)
        else:
            assert carry is not None
            h = block(self._pick(carry))
            states = torch.cat([carry, h.unsqueeze(2)], dim=2)  # (b, t, k + 1, d) -> (b, t, k + 2, d)
        return states, block.logits(h) if want_logits else None

    @torch.no_grad()
    def reference_logits(self, blocks: Sequence[nn.Module], x: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        out = []
        carry: torch.Tensor | None = None
        for k, block in enumerate(blocks):
            carry, logits = self.step(block, k, x, carry, want_logits=True, is_last=k == len(blocks) - 1)
            assert logits is not None
            out.append(logits)
        return out

    def single_block_logits(
        self, blocks: Sequence[nn.Module], x: torch.Tensor, seed: int = 0, only: int | None = None,
    ) -> list[torch.Tensor]:
        refs = self.reference_logits(blocks, x, torch.Generator())  # the prefixes come in one pass; no noise
        return refs if only is None else [refs[only]]  # ``only=k``: prefix k, as the protocol says

    def schedule(self) -> Schedule:
        return self.cfg.train.schedule

    def checkpoint_meta(self, k: int) -> dict[str, str]:
        return {"objective": self.name}

    def optional_meta(self) -> tuple[str, ...]:
        return ()

    def check_composable(self, blocks: Sequence[nn.Module]) -> None:
        """Stack blocks share nothing to check: block k was trained on the very blocks before it."""

    def traversal_flops_per_byte(self, blocks: Sequence[nn.Module]) -> float:
        """Every trunk, then the last block's head (and a residual head's frozen chain)."""
        m = self.cfg.model
        last = blocks[-1]
        prev = getattr(last, "prev_head", None)
        path = nn.ModuleList([*(b.get_submodule("layers") for b in blocks), last.get_submodule("head_layers"),
                              last.get_submodule("head"), *([prev] if prev is not None else [])])
        return forward_flops_per_token(path, m.d_model, m.context)

    def train_flops_per_token(self, k: int) -> float:
        m = self.cfg.model
        with torch.device("meta"):
            blocks = [self.build_block(j) for j in range(k + 1)]
        # frozen trunks run forward only (their heads are not part of a frozen copy)
        frozen = sum(forward_flops_per_token(b.layers, m.d_model, m.context) for b in blocks[:k])
        # a frozen head (shared or residual) runs forward and backward to its input, but computes no weight gradient
        own = blocks[k]
        head_fixed = not next(own.head.parameters()).requires_grad
        fixed = [mod for mod in (own.prev_head, *([own.head_layers, own.head] if head_fixed else [])) if mod is not None]
        no_wgrad = sum(forward_flops_per_token(mod, m.d_model, m.context) for mod in fixed)
        return frozen + train_flops_per_token(own, m.d_model, m.context) - no_wgrad
