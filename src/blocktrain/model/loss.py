"""The next-byte cross-entropy every objective and the E2E reference train on."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blocktrain.config import VOCAB_SIZE


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain next-byte cross-entropy in fp32 (E2E reference, stack heads); logits (b, t, 256), y (b, t)."""
    # (b, t, 256) -> (b*t, 256)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), y.reshape(-1).long())
