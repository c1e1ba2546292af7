"""The chain: blocks composed at inference as steps of the probability-flow ODE.

Karras et al. (2022), Eq. (4) and Alg. 1: with D(z; sigma) = softmax(logits) @ E,

    dz/dsigma = (z - D(z; sigma)) / sigma
    Euler:  z <- z + (s_next - s) * (z - D) / s
    Heun:   z' = Euler step;  d' = (z' - D(z'; s_next)) / s_next;
            z <- z + (s_next - s) * (d + d') / 2        (Euler on the final step)

The chain starts at z = sigma_max * eps and block k integrates from s_k down to
s_{k+1}; block B-1 ends at sigma_min. The logits of the last evaluation give
p(next byte) (``Readout.LAST_STEP``), or one extra evaluation of the last block
at sigma_min does (``Readout.SIGMA_MIN``). Nothing here sees the true next byte.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from blocktrain.config import DiffusionConfig, Readout, Solver
from blocktrain.device import CPU
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.model.block import BlockDenoiser
from blocktrain.noise import normal


def initial_noise(
    shape: tuple[int, int], dim: int, sigma_max: float, generator: torch.Generator, device: torch.device = CPU
) -> torch.Tensor:
    """z_0 = sigma_max * eps, eps ~ N(0, I), shape (b, t, dim), drawn on ``device`` by the counter generator keyed
    from the seeded host ``generator`` (:mod:`blocktrain.noise`), so a chain's draw is the same on every device.

    eps at position p is a function of the seed and p only, the same in every row: a byte's chain, and so its
    score, depends neither on how many bytes follow it nor on where its window sits in a batch (a draw per row
    numbered its elements (row * t + p) * dim + j, so row r > 0 moved with t and every row with its place)."""
    b, t = shape
    eps = normal((1, t, dim), generator, device)  # (1, t, dim): element (p, j) is draw p * dim + j whatever t
    return eps.mul_(sigma_max).expand(b, t, dim).contiguous()  # (1, t, dim) -> (b, t, dim), one draw for every row


def position_noise(b: int, t: int, context: int, dim: int, generator: torch.Generator,
                   device: torch.device = CPU) -> torch.Tensor:
    """eps (b, t, dim) on ``device`` for positions 0..t-1 of a draw for the whole context (b, context, dim); only
    those t positions are computed.

    A position's noise then does not depend on the length of the text it belongs to:
    speculative decoding scores a text plus its draft in one traversal and needs the
    chain's p at position j to be what a text one byte past j would get.
    """
    if not 1 <= t <= context:
        raise ValueError(f"need 1 <= t <= context, got t={t}, context={context}")
    return normal((b, context, dim), generator, device, keep=t)


def block_steps(
    block: BlockDenoiser,
    k: int,
    x: torch.Tensor,
    z: torch.Tensor,
    partition: NoisePartition,
    cfg: DiffusionConfig,
    is_last: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run block ``k``'s solver steps on z. Returns (z at s_{k+1}, logits of its last evaluation)."""
    sigmas = partition.block_steps(k, cfg.steps_per_block)
    logits = torch.empty(0)
    for j, (s, s_next) in enumerate(itertools.pairwise(sigmas)):
        logits = block(x, z, z.new_full((), s))
        d = (z - block.denoised(logits)) / s
        z_next = z + (s_next - s) * d
        final = is_last and j == len(sigmas) - 2
        if cfg.solver is Solver.HEUN and not final:
            logits2 = block(x, z_next, z.new_full((), s_next))
            d2 = (z_next - block.denoised(logits2)) / s_next
            z_next = z + (s_next - s) * 0.5 * (d + d2)
            logits = logits2
        z = z_next
    return z, logits


@torch.no_grad()
def chain_logits(
    blocks: Sequence[BlockDenoiser],
    x: torch.Tensor,
    partition: NoisePartition,
    cfg: DiffusionConfig,
    generator: torch.Generator,
    z0: torch.Tensor | None = None,
) -> torch.Tensor:
    """One traversal of the block stack: logits (b, t, 256) for every position of x (b, t)."""
    if len(blocks) != partition.n_blocks:
        raise ValueError(f"chain needs {partition.n_blocks} blocks, got {len(blocks)}")
    d = blocks[0].cfg.d_model
    z = z0 if z0 is not None else initial_noise(tuple(x.shape), d, cfg.sigma_max, generator, x.device)  # type: ignore[arg-type]
    logits = torch.empty(0)
    for k, block in enumerate(blocks):
        z, logits = chain_step(block, k, x, z, partition, cfg, is_last=k == len(blocks) - 1)
    return logits


def chain_step(
    block: BlockDenoiser,
    k: int,
    x: torch.Tensor,
    z: torch.Tensor,
    partition: NoisePartition,
    cfg: DiffusionConfig,
    is_last: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block k's share of the chain: its solver steps, plus the sigma_min readout when it is the last block."""
    z, logits = block_steps(block, k, x, z, partition, cfg, is_last)
    if is_last and cfg.readout is Readout.SIGMA_MIN:
        logits = block(x, z, z.new_full((), cfg.sigma_min))
    return z, logits


@torch.no_grad()
def block_alone_logits(
    block: BlockDenoiser,
    k: int,
    x: torch.Tensor,
    partition: NoisePartition,
    generator: torch.Generator,
) -> torch.Tensor:
    """Block ``k`` used alone: fed pure noise z = s_k * eps at the top of its own slice."""
    s = partition.slices[k].step_hi
    z = initial_noise(tuple(x.shape), block.cfg.d_model, s, generator, x.device)  # type: ignore[arg-type]
    return block(x, z, z.new_full((), s))


def evaluations_per_traversal(cfg: DiffusionConfig, n_blocks: int) -> int:
    """Block forward passes one traversal costs (for compute accounting)."""
    return solver_evaluations(cfg, n_blocks) + (1 if cfg.readout is Readout.SIGMA_MIN else 0)


def solver_evaluations(cfg: DiffusionConfig, n_blocks: int) -> int:
    """The evaluations of one traversal's solver steps, each followed by the denoiser D = softmax(logits) @ E (a
    256 x d product per token; the sigma_min readout computes none)."""
    per_block = cfg.steps_per_block * (2 if cfg.solver is Solver.HEUN else 1)
    return n_blocks * per_block - (1 if cfg.solver is Solver.HEUN else 0)  # the chain's last step is Euler's
