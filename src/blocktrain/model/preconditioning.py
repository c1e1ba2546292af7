"""EDM preconditioning of a denoiser block (Karras, Aittala, Aila, Laine 2022, Table 1 and Eq. 7).

    D(z; sigma) = c_skip(sigma) * z + c_out(sigma) * F(c_in(sigma) * z; c_noise(sigma))

It lives with the model, which applies it in its forward pass; the diffusion objective's loss weighting and
noise schedule (``blocktrain.diffusion``) build on it.
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
