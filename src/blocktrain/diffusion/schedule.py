"""EDM preconditioning and loss weighting.

Karras, Aittala, Aila, Laine (2022), "Elucidating the Design Space of
Diffusion-Based Generative Models", Table 1 and Eq. (7)-(8):

    D(z; sigma) = c_skip(sigma) * z + c_out(sigma) * F(c_in(sigma) * z; c_noise(sigma))
    c_skip  = sigma_data^2 / (sigma^2 + sigma_data^2)
    c_out   = sigma * sigma_data / sqrt(sigma^2 + sigma_data^2)
    c_in    = 1 / sqrt(sigma^2 + sigma_data^2)
    c_noise = ln(sigma) / 4
    lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2
"""

from __future__ import annotations

import torch

from blocktrain.model.preconditioning import Preconditioning  # noqa: F401  (the diffusion package names it)


def edm_loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """lambda(sigma) of Karras et al. (2022), Eq. (8), normalised to mean 1 over the batch.

    The normalisation keeps the weighted cross-entropy on the nats scale, so
    losses of different blocks remain comparable.
    """
    lam = (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2
    return lam / lam.mean()
