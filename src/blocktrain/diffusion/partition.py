"""Partition of the noise range [sigma_min, sigma_max] into B block slices.

The training density of sigma is the EDM log-normal, ln(sigma) ~ N(P_mean, P_std^2)
(Karras et al. 2022, Sec. 5), truncated to [sigma_min, sigma_max]. With
``Slicing.EQUAL_PROB`` the truncated mass is cut into B equal parts; with
``Slicing.LOG_UNIFORM`` the range of ln(sigma) is cut into equal widths.
Each slice is then widened on both sides by ``overlap`` (gamma) times its own
width, measured in the same coordinate (probability mass or ln sigma), and
clipped to the range.

Block 0 holds the *highest* slice (the chain starts from pure noise at
sigma_max) and block B-1 the lowest, ending at sigma_min.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from blocktrain.config import DiffusionConfig, Slicing
from blocktrain.errors import ConfigError

_N = NormalDist()


@dataclass(frozen=True)
class Slice:
    """The noise levels owned by one block."""

    index: int  # block index k (0 = highest sigma)
    sigma_lo: float  # lower edge of the training slice (with overlap)
    sigma_hi: float  # upper edge of the training slice (with overlap)
    step_hi: float  # sigma where this block's inference steps start (no overlap)
    step_lo: float  # sigma where this block's inference steps end (no overlap)


class NoisePartition:
    """Slices of the truncated log-normal, one per block, and the inference schedule."""

    def __init__(self, cfg: DiffusionConfig, n_blocks: int) -> None:
        if n_blocks < 1:
            raise ConfigError(f"n_blocks must be >= 1, got {n_blocks}")
        self.cfg = cfg
        self.n_blocks = n_blocks
        self._u_lo = self._cdf(cfg.sigma_min)
        self._u_hi = self._cdf(cfg.sigma_max)
        if self._u_hi - self._u_lo < 1e-9:
            raise ConfigError(
                f"the log-normal (P_mean={cfg.p_mean}, P_std={cfg.p_std}) has no mass in "
                f"[{cfg.sigma_min}, {cfg.sigma_max}]; widen P_std or move P_mean"
            )
        self.slices = tuple(self._make_slice(k) for k in range(n_blocks))

    # --- coordinates ---------------------------------------------------
    def _cdf(self, sigma: float) -> float:
        return _N.cdf((math.log(sigma) - self.cfg.p_mean) / self.cfg.p_std)

    def _inv_cdf(self, u: float) -> float:
        u = min(max(u, 1e-12), 1 - 1e-12)
        return math.exp(self.cfg.p_mean + self.cfg.p_std * _N.inv_cdf(u))

    def _to_coord(self, sigma: float) -> float:
        return self._cdf(sigma) if self.cfg.slicing is Slicing.EQUAL_PROB else math.log(sigma)

    def _from_coord(self, c: float) -> float:
        return self._inv_cdf(c) if self.cfg.slicing is Slicing.EQUAL_PROB else math.exp(c)

    def boundaries(self) -> list[float]:
        """Sigma boundaries s_0 = sigma_max > s_1 > ... > s_B = sigma_min."""
        lo = self._to_coord(self.cfg.sigma_min)
        hi = self._to_coord(self.cfg.sigma_max)
        width = (hi - lo) / self.n_blocks
        inner = [self._from_coord(hi - k * width) for k in range(1, self.n_blocks)]
        return [self.cfg.sigma_max, *inner, self.cfg.sigma_min]

    def _make_slice(self, k: int) -> Slice:
        bounds = self.boundaries()
        c_hi = self._to_coord(bounds[k])
        c_lo = self._to_coord(bounds[k + 1])
        pad = self.cfg.overlap * (c_hi - c_lo)
        r_lo = self._to_coord(self.cfg.sigma_min)
        r_hi = self._to_coord(self.cfg.sigma_max)
        w_lo = self.cfg.sigma_min if k == self.n_blocks - 1 else self._from_coord(max(r_lo, c_lo - pad))
        w_hi = self.cfg.sigma_max if k == 0 else self._from_coord(min(r_hi, c_hi + pad))
        return Slice(index=k, sigma_lo=w_lo, sigma_hi=w_hi, step_hi=bounds[k], step_lo=bounds[k + 1])

    # --- sampling --------------------------------------------------------
    def sample(self, k: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Draw sigma for block ``k`` from the log-normal restricted to its slice.

        Inverse-CDF sampling: u ~ U(Phi(a), Phi(b)), sigma = exp(P_mean + P_std * Phi^{-1}(u)).
        """
        if not 0 <= k < self.n_blocks:
            raise ConfigError(f"block index {k} is out of range for B={self.n_blocks} (valid: 0..{self.n_blocks - 1})")
        s = self.slices[k]
        u_lo, u_hi = self._cdf(s.sigma_lo), self._cdf(s.sigma_hi)
        u = u_lo + (u_hi - u_lo) * torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
        u = u.clamp(1e-12, 1 - 1e-12)
        ln_sigma = self.cfg.p_mean + self.cfg.p_std * torch.special.ndtri(u)
        return torch.exp(ln_sigma).clamp(s.sigma_lo, s.sigma_hi).to(torch.float32)

    # --- inference schedule ------------------------------------------------
    def block_steps(self, k: int, steps_per_block: int | None = None) -> list[float]:
        """Sigmas visited by block ``k``: geometric from step_hi down to step_lo, n+1 points."""
        n = steps_per_block or self.cfg.steps_per_block
        s = self.slices[k]
        ratio = s.step_lo / s.step_hi
        return [s.step_hi * ratio ** (j / n) for j in range(n + 1)]

    def describe(self) -> list[dict[str, float]]:
        return [
            {
                "block": s.index,
                "sigma_lo": s.sigma_lo,
                "sigma_hi": s.sigma_hi,
                "step_hi": s.step_hi,
                "step_lo": s.step_lo,
            }
            for s in self.slices
        ]
