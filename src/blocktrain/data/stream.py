"""Random training windows, reproducible from (seed, stream, step).

A batch is a pure function of its coordinates, so resuming a run needs only the
step number, and two workers with different stream ids never repeat each other.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from blocktrain.errors import DataError


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and platforms."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TrainStream:
    """Batches of (x, y) random windows from a uint8 array; y is x shifted by one byte."""

    def __init__(self, data: np.ndarray, context: int, batch_size: int, seed: int, stream: int = 0) -> None:
        if len(data) < context + 2:
            raise DataError(f"training split has {len(data)} bytes, fewer than one window of {context + 1}")
        self.data = data
        self.context = context
        self.batch_size = batch_size
        self.seed = seed
        self.stream = stream

    def generator(self, step: int, purpose: int = 0) -> torch.Generator:
        """A generator for ``step``; purpose 0 draws windows, others draw noise."""
        return torch.Generator().manual_seed(mix_seed(self.seed, self.stream, step, purpose))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.generator(step, purpose=0)
        hi = len(self.data) - self.context - 1
        offsets = torch.randint(0, hi, (self.batch_size,), generator=g, device=g.device).numpy()
        # (batch, context+1) windows gathered with one fancy index
        idx = offsets[:, None] + np.arange(self.context + 1)[None, :]
        win = torch.from_numpy(np.asarray(self.data[idx], dtype=np.uint8))
        return win[:, :-1], win[:, 1:]
