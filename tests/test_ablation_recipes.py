"""The ablation harness (benchmarks/) must score the library's chain, and its recipes must not leak the target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import chain_logits
from blocktrain.model.block import BlockDenoiser
from blocktrain.presets import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
ablation_recipes = pytest.importorskip("ablation_recipes")


def _blocks() -> list[BlockDenoiser]:
    cfg = tiny()
    blocks = []
    for k in range(cfg.model.n_blocks):
        torch.manual_seed(k)
        b = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
        torch.nn.init.normal_(b.z_in.weight, std=0.2)  # make z matter, so a wrong z shows
        torch.nn.init.normal_(b.mod.weight, std=0.2)
        blocks.append(b.eval())
    return blocks


def test_harness_chain_equals_library_chain() -> None:
    cfg = tiny()
    blocks = _blocks()
    part = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = chain_logits(blocks, x, part, cfg.diffusion, torch.Generator().manual_seed(3))
        _, got, steps = ablation_recipes.chain_state(
            "naive", blocks, part, x, torch.Generator().manual_seed(3), len(blocks), cfg.diffusion.sigma_max, cfg.model.d_model
        )
    # The two Euler updates group (s_next - s) * (z - D) / s differently: float32 rounding only.
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert len(steps) == len(blocks)


@pytest.mark.parametrize("mode", ["features", "stack"])
def test_feature_chain_is_causal(mode: str) -> None:
    """Changing byte t must not change the feature chain's logits before t (no look-ahead, no target leak)."""
    cfg = tiny()
    torch.manual_seed(0)
    blocks = [ablation_recipes.FeatureBlock(cfg.model, cfg.diffusion.sigma_data, identity=mode == "stack").eval() for _ in range(4)]
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x2[0, 10] + 1) % 256
    with torch.no_grad():
        a, _ = ablation_recipes.feature_chain(blocks, x, torch.Generator().manual_seed(1), cfg.diffusion.sigma_max, cfg.model.d_model)
        b, _ = ablation_recipes.feature_chain(blocks, x2, torch.Generator().manual_seed(1), cfg.diffusion.sigma_max, cfg.model.d_model)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])
