"""The shared, frozen, L2-normalised target embedding E."""

from __future__ import annotations

import torch

from blocktrain.config import VOCAB_SIZE


def make_target_embedding(dim: int, seed: int) -> torch.Tensor:
    """E in R^{256 x dim}: Gaussian rows from ``seed``, each scaled to unit L2 norm.

    Every block of a model derives the same E from the same seed, so no block
    needs another block's weights; checkpoints store E and loading checks it.
    """
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(VOCAB_SIZE, dim, generator=g, dtype=torch.float32)
    return e / e.norm(dim=-1, keepdim=True)
