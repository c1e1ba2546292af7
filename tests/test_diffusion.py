from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

from blocktrain.config import DiffusionConfig, Slicing, Solver
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import block_steps, evaluations_per_traversal
from blocktrain.diffusion.schedule import edm_loss_weight
from blocktrain.model.preconditioning import Preconditioning


def test_preconditioning_matches_edm_table_1() -> None:
    p = Preconditioning(sigma_data=0.5)
    s = torch.tensor([0.1, 1.0, 10.0])
    assert torch.allclose(p.c_skip(s), 0.25 / (s**2 + 0.25))
    assert torch.allclose(p.c_out(s), s * 0.5 / torch.sqrt(s**2 + 0.25))
    assert torch.allclose(p.c_in(s), 1 / torch.sqrt(s**2 + 0.25))
    assert torch.allclose(p.c_noise(s), torch.log(s) / 4)
    # Unit-variance training target: c_skip^2 sigma_d^2... identity c_skip + c_out^2/sigma_d^2 = 1
    assert torch.allclose(p.c_skip(s) + p.c_out(s) ** 2 / 0.25, torch.ones(3))


def test_loss_weight_mean_one() -> None:
    w = edm_loss_weight(torch.tensor([1.0, 2.0, 5.0]), 0.5)
    assert math.isclose(float(w.mean()), 1.0, rel_tol=1e-6)
    assert w[0] > w[2]


def test_equal_probability_slices() -> None:
    cfg = DiffusionConfig(overlap=0.0)
    part = NoisePartition(cfg, 4)
    b = part.boundaries()
    assert b[0] == 10.0 and b[-1] == 1.0
    assert all(x > y for x, y in itertools.pairwise(b))
    masses = [part._cdf(b[k]) - part._cdf(b[k + 1]) for k in range(4)]
    assert max(masses) - min(masses) < 1e-9


def test_overlap_widens_within_range() -> None:
    part = NoisePartition(DiffusionConfig(overlap=0.1), 4)
    for s in part.slices:
        assert 1.0 <= s.sigma_lo <= s.step_lo <= s.step_hi <= s.sigma_hi <= 10.0
    # interior slices overlap their neighbours
    assert part.slices[1].sigma_hi > part.slices[0].step_lo
    assert part.slices[0].sigma_lo < part.slices[1].step_hi


def test_log_uniform_slices() -> None:
    part = NoisePartition(DiffusionConfig(slicing=Slicing.LOG_UNIFORM, overlap=0.0), 4)
    logs = [math.log(x) for x in part.boundaries()]
    widths = [a - b for a, b in itertools.pairwise(logs)]
    assert max(widths) - min(widths) < 1e-9


@pytest.mark.parametrize("k", range(4))
def test_samples_stay_in_slice_and_follow_lognormal(k: int) -> None:
    part = NoisePartition(DiffusionConfig(), 4)
    g = torch.Generator().manual_seed(0)
    s = part.sample(k, (20000,), g)
    sl = part.slices[k]
    assert float(s.min()) >= sl.sigma_lo - 1e-6 and float(s.max()) <= sl.sigma_hi + 1e-6
    # Inside the slice, the density decreases in sigma for ln-sigma above P_mean: median below mid-point.
    assert float(s.median()) < 0.5 * (sl.sigma_lo + sl.sigma_hi)


def test_block_index_out_of_range_for_sampling() -> None:
    part = NoisePartition(DiffusionConfig(), 4)
    with pytest.raises(ValueError, match="out of range"):
        part.sample(4, (2,), torch.Generator())


def test_block_steps_geometric() -> None:
    part = NoisePartition(DiffusionConfig(steps_per_block=3), 4)
    s = part.block_steps(2)
    assert len(s) == 4
    assert math.isclose(s[0], part.slices[2].step_hi) and math.isclose(s[-1], part.slices[2].step_lo)
    assert math.isclose(s[1] / s[0], s[2] / s[1], rel_tol=1e-9)


class _ConstDenoiser(torch.nn.Module):
    """D(z) = E[0] whatever z: lets us check the Euler update by hand."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.E = torch.nn.functional.normalize(torch.randn(256, d), dim=-1)

    def forward(self, x: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        logits = torch.full((*x.shape, 256), -1e4)
        logits[..., 0] = 0.0
        return logits

    def denoised(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, -1) @ self.E


def test_euler_step_by_hand() -> None:
    cfg = DiffusionConfig()
    part = NoisePartition(cfg, 4)
    blk = _ConstDenoiser(8)
    x = torch.zeros(1, 3, dtype=torch.long)
    z = torch.randn(1, 3, 8)
    z_new, _ = block_steps(blk, 1, x, z, part, cfg, is_last=False)  # type: ignore[arg-type]
    s, s_next = part.slices[1].step_hi, part.slices[1].step_lo
    d_hat = blk.E[0]
    expect = z + (s_next - s) * (z - d_hat) / s
    assert torch.allclose(z_new, expect, atol=1e-6)
    # The exact ODE solution for a constant D: z - D scales with sigma; Heun is exact here.
    heun = replace(cfg, solver=Solver.HEUN)
    z_heun, _ = block_steps(blk, 1, x, z, part, heun, is_last=False)  # type: ignore[arg-type]
    assert torch.allclose(z_heun, d_hat + (s_next / s) * (z - d_hat), atol=1e-5)


def test_evaluation_counts() -> None:
    assert evaluations_per_traversal(DiffusionConfig(), 4) == 4
    assert evaluations_per_traversal(DiffusionConfig(steps_per_block=2), 4) == 8
    assert evaluations_per_traversal(DiffusionConfig(solver=Solver.HEUN), 4) == 7
