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

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Preconditioning:
    """EDM preconditioning coefficients for a given sigma_data (Karras et al. 2022, Eq. 7)."""

    sigma_data: float  # data standard deviation assumed by the preconditioning

    def c_skip(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.sigma_data**2 / (sigma**2 + self.sigma_data**2)

    def c_out(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma * self.sigma_data / torch.sqrt(sigma**2 + self.sigma_data**2)

    def c_in(self, sigma: torch.Tensor) -> torch.Tensor:
        return 1.0 / torch.sqrt(sigma**2 + self.sigma_data**2)

    @staticmethod
    def c_noise(sigma: torch.Tensor) -> torch.Tensor:
        return torch.log(sigma) / 4.0


def edm_loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """lambda(sigma) of Karras et al. (2022), Eq. (8), normalised to mean 1 over the batch.

    The normalisation keeps the weighted cross-entropy on the nats scale, so
    losses of different blocks remain comparable.
    """
    lam = (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2
    return lam / lam.mean()
