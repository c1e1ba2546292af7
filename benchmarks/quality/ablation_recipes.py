"""Training recipes for the composition ablation (``chain_ablation.py`` is the entry point).

A thin caller of the library: the training loop is
:func:`blocktrain.train.loop.train_steps`, the diffusion loss and chain are
the :mod:`blocktrain.objectives` diffusion objective's ``block_loss`` and
``step`` (:func:`blocktrain.diffusion.sampler.chain_step`), and the
``library-stack`` recipe is the library's stack objective. Only what the
library does not have lives here: the recipes' own inputs (ensemble, selfcond,
softblend), the [x || z] layout (concat) and the feature-channel probes
(features, stack).

Every recipe trains in-process with fixed seeds and data streams, so a row is
reproduced by its command. Block k's chain sigmas are
s_0 = sigma_max > s_1 > ... > s_B = sigma_min (the preset's solver: one Euler step per block).

The z a block meets at inference, after Euler steps z <- r z + (1 - r) D with
r = s_next / s (Karras et al. 2022, Eq. 4, with D = softmax(logits) @ E), is

    z_k = s_k * eps + (1 - s_k / sigma_max) * D_bar,    D_bar a convex blend of earlier D's,

which the ``selfcond`` and ``softblend`` recipes imitate without any other block.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from blocktrain.config import ModelConfig, Objective, RunConfig
from blocktrain.data.stream import TrainStream
from blocktrain.diffusion.sampler import chain_step, initial_noise
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.layers import init_weights
from blocktrain.model.loss import lm_loss
from blocktrain.objectives import get_objective
from blocktrain.objectives.diffusion import DiffusionObjective
from blocktrain.objectives.stack import StackObjective
from blocktrain.seeds import block_stream, init_seed
from blocktrain.train.loop import train_steps
from blocktrain.train.step import lr_at, make_optimizer

log = logging.getLogger(__name__)

B = 4
HARNESS_SEED = 1  # run seed of every ablation row: block k is initialised from init_seed(HARNESS_SEED, k)
E2E_TORCH_SEED = 1  # torch.manual_seed of the harness's E2E reference (kept from the first rows)
E2E_HARNESS_STREAM = 99  # stream id of the harness's E2E data (kept from the first rows)
FEATURES = ("features", "stack")  # feature-channel probes: blocks pass F instead of D
LIBRARY_STACK = "library-stack"  # the library's stack objective (blocktrain.objectives.stack)
CHAIN_AWARE = ("chain", "boost", *FEATURES, LIBRARY_STACK)  # block k trains on the output of frozen blocks 0..k-1
RECIPES = ("naive", "chain", "boost", "ensemble", "selfcond", "softblend", "concat", *FEATURES, LIBRARY_STACK)


@dataclass(frozen=True)
class Variant:
    """One ablation row's knobs beyond the preset."""

    mode: str  # recipe name, one of RECIPES
    block_steps: int  # optimiser steps per block
    refresh_rounds: int = 0  # chain-aware only: 0 trains blocks one after another; R > 0 trains them
    # concurrently in rounds and refreshes the frozen snapshots of earlier blocks every R rounds
    round_steps: int = 10  # local steps per round when refresh_rounds > 0
    catchup_steps: int = 0  # with refresh_rounds > 0: the last steps of each block, trained in block order
    # against the final blocks before it (a progressive finish after the concurrent phase)

    def __post_init__(self) -> None:
        if self.mode not in RECIPES:
            raise ValueError(f"unknown recipe {self.mode!r}; pick one of {', '.join(RECIPES)}")
        if self.block_steps < 1 or self.round_steps < 1 or self.refresh_rounds < 0:
            raise ValueError("block_steps and round_steps must be >= 1 and refresh_rounds >= 0")
        if not 0 <= self.catchup_steps <= self.block_steps:
            raise ValueError(f"catchup_steps must lie in 0..block_steps ({self.block_steps}), got {self.catchup_steps}")


def objective_for(cfg: RunConfig, mode: str) -> DiffusionObjective | StackObjective:
    """The library objective a recipe builds on: the stack objective for ``library-stack``, else diffusion."""
    if cfg.model.n_blocks != B:
        raise ValueError(f"the harness composes B={B} blocks; the config has n_blocks={cfg.model.n_blocks}")
    kind = Objective.STACK if mode == LIBRARY_STACK else Objective.DIFFUSION
    obj = get_objective(cfg if cfg.objective is kind else _with_objective(cfg, kind))
    assert isinstance(obj, DiffusionObjective | StackObjective)
    return obj


def _with_objective(cfg: RunConfig, kind: Objective) -> RunConfig:
    return dataclasses.replace(cfg, objective=kind)


def fit(module: nn.Module, cfg: RunConfig, steps: int, loss_at: Callable[[int], torch.Tensor],
        opt: torch.optim.Optimizer | None = None, start: int = 0) -> float:
    """Library optimiser steps ``start..steps-1`` (AdamW, the preset's schedule and clipping) through the one
    training loop; returns the last training loss."""
    opt = opt or make_optimizer(module, cfg.train)[0]
    return train_steps(module, opt, lambda s: (loss_at(s), {}), range(start, steps),
                       lr=lambda s: lr_at(s, cfg.train), grad_clip=cfg.train.grad_clip).last_loss


class ConcatBlock(BlockDenoiser):
    """The [x || z] input layout: x_1, z_1, x_2, z_2, ... under one causal mask.

    The z slot at t attends to x_<=t and z_<=t; its output is the block's F at t.
    Twice the tokens of the additive layout, so about twice its FLOPs.
    """

    def __init__(self, cfg: ModelConfig, sigma_data: float) -> None:
        super().__init__(cfg, sigma_data)
        self.slot = nn.Embedding(2, cfg.d_model)  # 0: byte slot, 1: z slot
        init_weights(self.slot)

    def forward(self, x: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        b, t = x.shape
        d = self.cfg.d_model
        sigma = torch.as_tensor(sigma, dtype=z.dtype).reshape(-1, 1).expand(b, 1)  # () or (b,) -> (b, 1)
        s = sigma.unsqueeze(-1)  # (b, 1) -> (b, 1, 1)
        pos = self.pos_emb(torch.arange(t))
        hx = self.tok_emb(x.long()) + pos + self.slot.weight[0]
        hz = self.z_in(self.precond.c_in(s) * z) + pos + self.slot.weight[1]
        h = torch.stack([hx, hz], dim=2).reshape(b, 2 * t, d)  # (b, t, 2, d) -> (b, 2t, d)
        mod = self.mod(self.sigma_emb(self.precond.c_noise(sigma)))  # (b, 1, 4d)
        for layer in self.layers:
            h = layer(h, mod)
        f = self.ln_f(h).reshape(b, t, 2, d)[:, :, 1]  # (b, 2t, d) -> (b, t, 2, d) -> z slots (b, t, d)
        y_hat = self.precond.c_skip(s) * z + self.precond.c_out(s) * f
        return self.head(y_hat)


class FeatureBlock(BlockDenoiser):
    """A block that also reads the frozen final features F = LN(h) of the block before it.

    An ablation of the channel, not of the training: blocks pass F, a (b, t, d)
    tensor the size of z, instead of D = softmax(logits) @ E. Each block is fed
    pure noise at sigma_max, so the diffusion input carries nothing. Not the
    library's stack objective (that one hands on the residual stream h itself and
    embeds the bytes once; see the ``library-stack`` recipe): every block here
    re-embeds the bytes and reads LN(h) through a learned projection.
    """

    def __init__(self, cfg: ModelConfig, sigma_data: float, identity: bool = False) -> None:
        super().__init__(cfg, sigma_data)
        self.feat_in = nn.Linear(cfg.d_model, cfg.d_model)
        init_weights(self.feat_in)
        if identity:  # "stack": block k starts by continuing from block k-1's features
            nn.init.eye_(self.feat_in.weight)

    def forward_feat(
        self, x: torch.Tensor, z: torch.Tensor, sigma: float, feat: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits (b, t, 256), F (b, t, d))."""
        t = x.shape[1]
        s = torch.tensor(sigma)
        h = self.tok_emb(x.long()) + self.pos_emb(torch.arange(t)) + self.z_in(self.precond.c_in(s) * z)
        if feat is not None:
            h = h + self.feat_in(feat)
        mod = self.mod(self.sigma_emb(self.precond.c_noise(s.view(1, 1))))  # () -> (1, 1) -> (1, 1, 4d)
        for layer in self.layers:
            h = layer(h, mod)
        f = self.ln_f(h)
        return self.head(self.precond.c_skip(s) * z + self.precond.c_out(s) * f), f


def _noise(x: torch.Tensor, d: int, sigma: float, g: torch.Generator) -> torch.Tensor:
    """sigma * eps of shape (b, t, d) for bytes x (b, t)."""
    return initial_noise((int(x.shape[0]), int(x.shape[1])), d, sigma, g)


def feature_chain(
    blocks: Sequence[nn.Module], x: torch.Tensor, g: torch.Generator, sigma_max: float, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run blocks in order, each on fresh noise at sigma_max and the previous block's F; -> (last logits, last F)."""
    feat: torch.Tensor | None = None
    logits = torch.empty(0)
    for blk in blocks:
        assert isinstance(blk, FeatureBlock)
        logits, feat = blk.forward_feat(x, _noise(x, d, sigma_max, g), sigma_max, feat)
    assert feat is not None
    return logits, feat


class _Boosted(nn.Module):
    """Block k of ``boost`` as the chain sees it: its logits added to the running sum of the blocks before it.

    Duck-types :class:`BlockDenoiser` for :func:`chain_step` (``cfg``, ``forward``, ``denoised``),
    so D = softmax(running sum) @ E and the Euler step is the library's.
    """

    def __init__(self, block: BlockDenoiser, prev: torch.Tensor) -> None:
        super().__init__()
        self.block = block
        self.cfg = block.cfg
        self.prev = prev  # running logit sum of blocks 0..k-1 (b, t, 256)

    def forward(self, x: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.block(x, z, sigma) + self.prev

    def denoised(self, logits: torch.Tensor) -> torch.Tensor:
        return self.block.denoised(logits)


def chain_state(
    mode: str, objective: DiffusionObjective, blocks: Sequence[nn.Module], x: torch.Tensor, g: torch.Generator, upto: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """The library's chain (``objective.step``) through blocks[0:upto] from z = sigma_max * eps.

    Returns z at s_upto, the readout logits (boost: the running sum) and every step's readout logits.
    """
    z = objective.initial_carry(x, g)
    total: torch.Tensor | None = None
    steps: list[torch.Tensor] = []
    for k in range(upto):
        is_last = k == objective.cfg.model.n_blocks - 1
        if mode == "boost" and total is not None:
            blk = cast(BlockDenoiser, _Boosted(cast(BlockDenoiser, blocks[k]), total))
            z, total = chain_step(blk, k, x, z, objective.partition, objective.cfg.diffusion, is_last)
        else:
            z, logits = objective.step(blocks[k], k, x, z, want_logits=True, is_last=is_last)
            assert logits is not None
            total = logits
        steps.append(total)
    return z, total, steps


def train_e2e(cfg: RunConfig, train: np.ndarray) -> E2ETransformer:
    torch.manual_seed(E2E_TORCH_SEED)
    m = E2ETransformer(cfg.model)
    ts = TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=E2E_HARNESS_STREAM)

    def loss_at(step: int) -> torch.Tensor:
        x, y = ts.batch(step)
        return lm_loss(m(x), y)

    fit(m, cfg, cfg.train.steps, loss_at)
    return m.eval()


def _make_block(cfg: RunConfig, mode: str, k: int) -> nn.Module:
    torch.manual_seed(init_seed(HARNESS_SEED, k))
    if mode in FEATURES:
        return FeatureBlock(cfg.model, cfg.diffusion.sigma_data, identity=mode == "stack")
    if mode == "concat":
        return ConcatBlock(cfg.model, cfg.diffusion.sigma_data)
    return objective_for(cfg, mode).build_block(k)


def _frozen(mode: str, cfg: RunConfig, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Forward-only copies of finished blocks for later blocks' training (the stack objective's own freeze)."""
    if mode == LIBRARY_STACK:
        obj = objective_for(cfg, mode)
        return [obj.freeze(b, torch.float32) for b in blocks]
    return [copy.deepcopy(b).eval() for b in blocks]


def _block_loss_fn(
    mode: str, k: int, blk: nn.Module, preds: Callable[[], Sequence[nn.Module]], cfg: RunConfig, ts: TrainStream
) -> Callable[[int], torch.Tensor]:
    """The training loss of block k at a step; ``preds`` gives the frozen earlier blocks (chain-aware recipes)."""
    smax = cfg.diffusion.sigma_max
    d = cfg.model.d_model
    obj = objective_for(cfg, mode)

    def loss_at(step: int) -> torch.Tensor:
        x, y = ts.batch(step)
        g = ts.generator(step, 1)
        b, t = x.shape
        if mode == LIBRARY_STACK:  # the library's stack loss on the frozen blocks 0..k-1
            return obj.block_loss(blk, k, x, y, g, preds()[:k]).loss
        assert isinstance(blk, BlockDenoiser) and isinstance(obj, DiffusionObjective)
        if mode == "ensemble":  # a plain LM fed pure noise at sigma_max
            return lm_loss(blk(x, _noise(x, d, smax, g), torch.tensor(smax)), y)
        if mode in ("naive", "concat"):  # the library's diffusion block loss
            return obj.block_loss(blk, k, x, y, g).loss
        if mode in FEATURES:  # frozen blocks 0..k-1 give F; block k trains on it
            feat = None
            if k > 0:
                with torch.no_grad():
                    _, feat = feature_chain(preds()[:k], x, g, smax, d)
            assert isinstance(blk, FeatureBlock)
            return lm_loss(blk.forward_feat(x, _noise(x, d, smax, g), smax, feat)[0], y)
        if mode in ("selfcond", "softblend"):
            sigma = obj.partition.sample(k, (b, 1), g)  # (b, 1), one sigma per sequence
            eps = torch.randn(b, t, d, generator=g)
            s = sigma.unsqueeze(-1)  # (b, 1) -> (b, 1, 1)
            if mode == "selfcond":  # D_bar = the block's own detached estimate, dropped for half the sequences
                with torch.no_grad():
                    d_bar = blk.denoised(blk(x, s * eps, sigma))
                keep = (torch.rand(b, 1, 1, generator=g) < 0.5).float()
                d_bar = keep * d_bar
            else:  # D_bar = a soft blend: weight u ~ U(0, 1) on E[y], the rest on a random peaked mixture of rows
                u = torch.rand(b, t, 1, generator=g)
                w = torch.softmax(3.0 * torch.randn(b, t, 256, generator=g), -1)
                w = u * F.one_hot(y.long(), 256).float() + (1 - u) * w
                d_bar = w @ blk.E
            z = s * eps + (1 - s / smax) * d_bar
            return lm_loss(blk(x, z, sigma), y)
        # chain-aware: z from frozen earlier blocks through the library's chain, exactly the inference input
        with torch.no_grad():
            z, prev, _ = chain_state(mode, obj, preds(), x, g, k)
        logits = blk(x, z, torch.tensor(obj.partition.block_steps(k, 1)[0]))
        if mode == "boost" and prev is not None:
            logits = logits + prev
        return lm_loss(logits, y)

    return loss_at


def train_blocks(v: Variant, cfg: RunConfig, train: np.ndarray) -> tuple[list[nn.Module], int]:
    """Train the B blocks of a variant; returns them (eval mode) and the number of frozen block forwards (one per batch)."""
    if v.refresh_rounds > 0:
        return _train_concurrent(v, cfg, train)
    blocks: list[nn.Module] = []
    frozen = 0
    for k in range(B):
        blk = _make_block(cfg, v.mode, k)
        ts = TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=block_stream(k))
        done = _frozen(v.mode, cfg, blocks)

        def preds(done: list[nn.Module] = done) -> list[nn.Module]:
            return done

        last = fit(blk, cfg, v.block_steps, _block_loss_fn(v.mode, k, blk, preds, cfg, ts))
        frozen += (k if v.mode in CHAIN_AWARE else 1 if v.mode == "selfcond" else 0) * v.block_steps
        blocks.append(blk.eval())
        log.info("block %d: final training loss %.3f", k, last)
    return blocks, frozen


def _train_concurrent(v: Variant, cfg: RunConfig, train: np.ndarray) -> tuple[list[nn.Module], int]:
    """All blocks train at once in rounds of ``round_steps``; block k's frozen copies of
    blocks 0..k-1 are the published weights, refreshed every ``refresh_rounds`` rounds."""
    if v.mode not in CHAIN_AWARE:
        raise ValueError(f"--refresh-rounds only applies to the chain-aware recipes {CHAIN_AWARE}, not {v.mode!r}")
    blocks = [_make_block(cfg, v.mode, k) for k in range(B)]
    opts = [make_optimizer(b, cfg.train)[0] for b in blocks]
    streams = [TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=block_stream(k)) for k in range(B)]
    holder = {"snaps": _frozen(v.mode, cfg, blocks)}  # round 0: everyone holds the initial weights
    fns = [_block_loss_fn(v.mode, k, blocks[k], lambda: holder["snaps"], cfg, streams[k]) for k in range(B)]
    concurrent = v.block_steps - v.catchup_steps
    for r in range(math.ceil(concurrent / v.round_steps)):
        if r > 0 and r % v.refresh_rounds == 0:
            holder["snaps"] = _frozen(v.mode, cfg, blocks)
        for k in range(B):
            fit(blocks[k], cfg, min((r + 1) * v.round_steps, concurrent), fns[k], opts[k], start=r * v.round_steps)
    for k in range(B if v.catchup_steps else 0):  # blocks 0..k-1 are final when block k catches up
        holder["snaps"] = _frozen(v.mode, cfg, blocks)
        fit(blocks[k], cfg, v.block_steps, fns[k], opts[k], start=concurrent)
    return [b.eval() for b in blocks], sum(range(B)) * v.block_steps
