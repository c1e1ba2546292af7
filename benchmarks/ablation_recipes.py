"""Training recipes for the composition ablation (``chain_ablation.py`` is the entry point).

Every recipe trains in-process with fixed seeds and data streams, so a row is
reproduced bit for bit by its command. Block k's chain sigmas are
s_0 = sigma_max > s_1 > ... > s_B = sigma_min (one Euler step per block).

The z a block meets at inference, after Euler steps z <- r z + (1 - r) D with
r = s_next / s (Karras et al. 2022, Eq. 4, with D = softmax(logits) @ E), is

    z_k = s_k * eps + (1 - s_k / sigma_max) * D_bar,    D_bar a convex blend of earlier D's,

which the ``selfcond`` and ``softblend`` recipes imitate without any other block.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blocktrain.config import RunConfig
from blocktrain.data.stream import TrainStream
from blocktrain.diffusion.loss import block_loss, lm_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import initial_noise
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.layers import init_weights
from blocktrain.train.loop import lr_at, make_optimizer

B = 4
FEATURES = ("features", "stack")  # recipes whose blocks pass F instead of D
CHAIN_AWARE = ("chain", "boost", *FEATURES)  # recipes whose block k trains on the output of frozen blocks 0..k-1


@dataclass(frozen=True)
class Variant:
    """One ablation row's knobs beyond the preset."""

    mode: str  # recipe name: naive, chain, boost, ensemble, selfcond, softblend, concat, features, stack
    block_steps: int  # optimiser steps per block
    refresh_rounds: int = 0  # chain-aware only: 0 trains blocks one after another; R > 0 trains them
    # concurrently in rounds and refreshes the frozen snapshots of earlier blocks every R rounds
    round_steps: int = 10  # local steps per round when refresh_rounds > 0
    catchup_steps: int = 0  # with refresh_rounds > 0: the last steps of each block, trained in block order
    # against the final blocks before it (a progressive finish after the concurrent phase)


def fit(module: nn.Module, cfg: RunConfig, steps: int, loss_at: Callable[[int], torch.Tensor]) -> float:
    """AdamW with the preset's schedule and clipping; returns the last training loss."""
    opt, _ = make_optimizer(module, cfg.train)
    loss = torch.zeros(())
    for step in range(steps):
        loss = _step(module, opt, cfg, step, loss_at)
    return float(loss)


def _step(module: nn.Module, opt: torch.optim.Optimizer, cfg: RunConfig, step: int, loss_at: Callable[[int], torch.Tensor]) -> torch.Tensor:
    for gr in opt.param_groups:
        gr["lr"] = lr_at(step, cfg.train)
    loss = loss_at(step)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.train.grad_clip or float("inf"))  # as train/loop.py
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class ConcatBlock(BlockDenoiser):
    """The [x || z] input layout: x_1, z_1, x_2, z_2, ... under one causal mask.

    The z slot at t attends to x_<=t and z_<=t; its output is the block's F at t.
    Twice the tokens of the additive layout, so about twice its FLOPs.
    """

    def __init__(self, cfg, sigma_data: float) -> None:  # type: ignore[no-untyped-def]
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
    pure noise at sigma_max, so the diffusion input carries nothing.
    """

    def __init__(self, cfg, sigma_data: float, identity: bool = False) -> None:  # type: ignore[no-untyped-def]
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
        mod = self.mod(self.sigma_emb(self.precond.c_noise(s.view(1, 1))))  # (1, 1, 4d)
        for layer in self.layers:
            h = layer(h, mod)
        f = self.ln_f(h)
        return self.head(self.precond.c_skip(s) * z + self.precond.c_out(s) * f), f


def feature_chain(
    blocks: list[BlockDenoiser], x: torch.Tensor, g: torch.Generator, sigma_max: float, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run blocks in order, each on fresh noise at sigma_max and the previous block's F; -> (last logits, last F)."""
    feat: torch.Tensor | None = None
    logits = torch.empty(0)
    for blk in blocks:
        assert isinstance(blk, FeatureBlock)
        logits, feat = blk.forward_feat(x, initial_noise(tuple(x.shape), d, sigma_max, g), sigma_max, feat)  # type: ignore[arg-type]
    assert feat is not None
    return logits, feat


def chain_state(
    mode: str, blocks: list[BlockDenoiser], part: NoisePartition, x: torch.Tensor, g: torch.Generator, upto: int, sigma_max: float, d: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Euler chain through blocks[0:upto] from z = sigma_max*eps (eps of width d).

    Returns z at s_upto, the readout logits (boost: the running sum) and every step's readout logits.
    """
    z = initial_noise(tuple(x.shape), d, sigma_max, g)  # type: ignore[arg-type]
    total: torch.Tensor | None = None
    steps: list[torch.Tensor] = []
    for k in range(upto):
        s, s_next = part.block_steps(k, 1)
        logits = blocks[k](x, z, torch.tensor(s))
        total = logits if (total is None or mode != "boost") else total + logits
        steps.append(total)
        d_hat = torch.softmax(total, -1) @ blocks[k].E  # D = softmax(logits) @ E
        z = z + (s_next - s) * (z - d_hat) / s  # Euler step, Karras et al. (2022) Eq. (4)
    return z, total, steps


def train_e2e(cfg: RunConfig, train) -> E2ETransformer:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    m = E2ETransformer(cfg.model)
    ts = TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=99)

    def loss_at(step: int) -> torch.Tensor:
        x, y = ts.batch(step)
        return lm_loss(m(x), y)

    fit(m, cfg, cfg.train.steps, loss_at)
    return m.eval()


def _make_block(cfg: RunConfig, mode: str, k: int) -> BlockDenoiser:
    torch.manual_seed(1009 + k)
    if mode in FEATURES:
        return FeatureBlock(cfg.model, cfg.diffusion.sigma_data, identity=mode == "stack")
    cls = ConcatBlock if mode == "concat" else BlockDenoiser
    return cls(cfg.model, cfg.diffusion.sigma_data)


def _block_loss_fn(
    mode: str, k: int, blk: BlockDenoiser, preds: Callable[[], list[BlockDenoiser]], cfg: RunConfig, part: NoisePartition, ts: TrainStream
) -> Callable[[int], torch.Tensor]:
    """The training loss of block k at a step; ``preds`` gives the frozen earlier blocks (chain-aware recipes)."""
    smax = cfg.diffusion.sigma_max
    d = cfg.model.d_model

    def loss_at(step: int) -> torch.Tensor:
        x, y = ts.batch(step)
        g = ts.generator(step, 1)
        b, t = x.shape
        if mode == "ensemble":  # a plain LM fed pure noise at sigma_max
            return lm_loss(blk(x, initial_noise((b, t), d, smax, g), torch.tensor(smax)), y)
        if mode in ("naive", "concat"):
            return block_loss(blk, k, x, y, part, cfg.diffusion, g).loss
        if mode in FEATURES:  # frozen blocks 0..k-1 give F; block k trains on it
            feat = None
            if k > 0:
                with torch.no_grad():
                    _, feat = feature_chain(preds()[:k], x, g, smax, d)
            assert isinstance(blk, FeatureBlock)
            return lm_loss(blk.forward_feat(x, initial_noise((b, t), d, smax, g), smax, feat)[0], y)  # type: ignore[arg-type]
        if mode in ("selfcond", "softblend"):
            sigma = part.sample(k, (b, 1), g)  # (b, 1), one sigma per sequence
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
        # chain-aware: z from frozen earlier blocks, exactly the inference input
        with torch.no_grad():
            z, prev, _ = chain_state(mode, preds(), part, x, g, k, smax, d)
        logits = blk(x, z, torch.tensor(part.block_steps(k, 1)[0]))
        if mode == "boost" and prev is not None:
            logits = logits + prev
        return lm_loss(logits, y)

    return loss_at


def train_blocks(v: Variant, cfg: RunConfig, train, part: NoisePartition) -> tuple[list[BlockDenoiser], int]:  # type: ignore[no-untyped-def]
    """Train the B blocks of a variant; returns them (eval mode) and the number of frozen block forwards (one per batch)."""
    if v.refresh_rounds > 0:
        return _train_concurrent(v, cfg, train, part)
    blocks: list[BlockDenoiser] = []
    frozen = 0
    for k in range(B):
        blk = _make_block(cfg, v.mode, k)
        ts = TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=1000 * k)
        done = list(blocks)

        def preds(done: list[BlockDenoiser] = done) -> list[BlockDenoiser]:
            return done

        last = fit(blk, cfg, v.block_steps, _block_loss_fn(v.mode, k, blk, preds, cfg, part, ts))
        frozen += (k if v.mode in CHAIN_AWARE else 1 if v.mode == "selfcond" else 0) * v.block_steps
        blocks.append(blk.eval())
        sys.stderr.write(f"block {k}: final training loss {last:.3f}\n")
    return blocks, frozen


def _train_concurrent(v: Variant, cfg: RunConfig, train, part: NoisePartition) -> tuple[list[BlockDenoiser], int]:  # type: ignore[no-untyped-def]
    """All blocks train at once in rounds of ``round_steps``; block k's frozen copies of
    blocks 0..k-1 are the published weights, refreshed every ``refresh_rounds`` rounds."""
    if v.mode not in CHAIN_AWARE:
        raise ValueError(f"--refresh-rounds only applies to the chain-aware recipes {CHAIN_AWARE}, not {v.mode!r}")
    blocks = [_make_block(cfg, v.mode, k) for k in range(B)]
    opts = [make_optimizer(b, cfg.train)[0] for b in blocks]
    streams = [TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=1000 * k) for k in range(B)]
    snaps = [copy.deepcopy(b).eval() for b in blocks]  # round 0: everyone holds the initial weights
    holder = {"snaps": snaps}
    fns = [_block_loss_fn(v.mode, k, blocks[k], lambda: holder["snaps"], cfg, part, streams[k]) for k in range(B)]
    concurrent = v.block_steps - v.catchup_steps
    for r in range(math.ceil(concurrent / v.round_steps)):
        if r > 0 and r % v.refresh_rounds == 0:
            holder["snaps"] = [copy.deepcopy(b).eval() for b in blocks]
        for k in range(B):
            blocks[k].train()
            for step in range(r * v.round_steps, min((r + 1) * v.round_steps, concurrent)):
                _step(blocks[k], opts[k], cfg, step, fns[k])
    for k in range(B if v.catchup_steps else 0):  # blocks 0..k-1 are final when block k catches up
        holder["snaps"] = [copy.deepcopy(b).eval() for b in blocks]
        blocks[k].train()
        for step in range(concurrent, v.block_steps):
            _step(blocks[k], opts[k], cfg, step, fns[k])
    return [b.eval() for b in blocks], sum(range(B)) * v.block_steps
