"""The block-local training objective: sigma-weighted next-byte cross-entropy.

For block k with slice S_k (see :mod:`blocktrain.diffusion.partition`):

    sigma ~ LogNormal(P_mean, P_std^2) restricted to S_k      (per sequence)
    z     = E[y] + sigma * eps,  eps ~ N(0, I)
    L_k   = E[ lambda(sigma) * CE(Head(D_theta(z; sigma, x)), y) ]

with lambda from Karras et al. (2022), Eq. (8) (or uniform). The noisy input
reveals y when sigma is small, so this loss is *not* a quality measure; quality
is measured only through the full chain (:mod:`blocktrain.diffusion.sampler`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blocktrain.config import VOCAB_SIZE, DiffusionConfig, LossWeighting
from blocktrain.device import to_device
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.schedule import edm_loss_weight
from blocktrain.model.block import BlockDenoiser
from blocktrain.noise import normal


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # weighted CE to minimise, scalar
    noised_ce: torch.Tensor  # unweighted CE given the noised target (leaky; for monitoring only), a scalar
    mean_sigma: torch.Tensor  # mean sigma of the batch, a scalar


def block_loss(
    block: BlockDenoiser,
    k: int,
    x: torch.Tensor,
    y: torch.Tensor,
    partition: NoisePartition,
    cfg: DiffusionConfig,
    generator: torch.Generator,
) -> LossOutput:
    """Weighted CE of block ``k`` on bytes ``x`` (b, t) with next bytes ``y`` (b, t)."""
    b, t = x.shape
    sigma = to_device(partition.sample(k, (b, 1), generator), x.device)  # one sigma per sequence, as at inference
    eps = normal((b, t, block.cfg.d_model), generator, x.device)  # drawn on x's device, the same on every device
    z = block.E[y.long()] + sigma.unsqueeze(-1) * eps  # (b, t, d)
    logits = block(x, z, sigma)
    # (b, t, 256) -> (b*t, 256)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), y.reshape(-1).long(), reduction="none").view(b, t)
    if cfg.loss_weighting is LossWeighting.EDM:
        w = edm_loss_weight(sigma, cfg.sigma_data)
    else:
        w = torch.ones_like(sigma)
    # w (b, 1) broadcasts over positions
    return LossOutput(loss=(w * ce).mean(), noised_ce=ce.mean().detach(), mean_sigma=sigma.mean())
