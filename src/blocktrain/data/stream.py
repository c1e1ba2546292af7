"""Random training windows, reproducible from (seed, stream, step).

A batch is a pure function of its coordinates, so resuming a run needs only the
step number, and two workers with different stream ids never repeat each other.

The offsets are drawn on the host by a seeded CPU generator, so a batch is the same on every device (an audit on a
CPU replays a GPU worker's batches). On an accelerator the split is kept resident there (up to
``RESIDENT_MAX_BYTES``) and each batch is cut from it on the device: only the (batch,) offsets cross, from pinned
memory without a wait, so no step waits for the host. On the CPU the split stays a memory map.
"""

from __future__ import annotations

import hashlib
import struct
import weakref

import numpy as np
import torch

from blocktrain.device import CPU, to_device
from blocktrain.errors import DataError

RESIDENT_MAX_BYTES = 2**30  # bytes: a split up to this size is kept on an accelerator; a larger one is cut on the host
# id(split array) -> its copies by device, dropped with the array (a WeakKeyDictionary cannot hold an ndarray: it is
# not hashable, and every accelerator's stream failed on it)
_RESIDENT: dict[int, dict[torch.device, torch.Tensor]] = {}


def resident(data: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """``data`` (uint8) as one tensor on the accelerator ``device``, copied once per split and device; None on the
    CPU or for a split over RESIDENT_MAX_BYTES."""
    if device.type == "cpu" or data.nbytes > RESIDENT_MAX_BYTES:
        return None
    key = id(data)
    per_device = _RESIDENT.get(key)
    if per_device is None:
        per_device = _RESIDENT[key] = {}
        weakref.finalize(data, _RESIDENT.pop, key, None)  # the id may name another array once this one is gone
    if device not in per_device:
        per_device[device] = torch.from_numpy(np.array(data, dtype=np.uint8)).to(device)  # (n,)
    return per_device[device]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and platforms."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TrainStream:
    """Batches of (x, y) random windows from a uint8 array; y is x shifted by one byte."""

    def __init__(self, data: np.ndarray, context: int, batch_size: int, seed: int, stream: int = 0,
                 device: torch.device = CPU) -> None:
        if len(data) < context + 2:
            raise DataError(f"training split has {len(data)} bytes, fewer than one window of {context + 1}")
        self.data = data
        self.device = device  # where batch() returns its windows
        self._text = resident(data, device)  # (n,) on the device, or None: windows cut on the host
        self._span = None if self._text is None else torch.arange(context + 1, device=device)  # (t+1,)
        self.context = context
        self.batch_size = batch_size
        self.seed = seed
        self.stream = stream

    def generator(self, step: int, purpose: int = 0) -> torch.Generator:
        """A generator for ``step``; purpose 0 draws windows, others draw noise."""
        return torch.Generator().manual_seed(mix_seed(self.seed, self.stream, step, purpose))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y (batch, context) uint8 on ``device``: step ``step``'s windows, y shifted by one byte."""
        g = self.generator(step, purpose=0)
        hi = len(self.data) - self.context - 1
        offsets = torch.randint(0, hi, (self.batch_size,), generator=g, device=g.device)  # (batch,) on the host
        if self._text is not None and self._span is not None:
            win = self._text[to_device(offsets, self.device)[:, None] + self._span[None, :]]  # (batch, context+1), cut on the device
        else:
            # (batch, context+1) windows gathered with one fancy index
            idx = offsets.numpy()[:, None] + np.arange(self.context + 1)[None, :]
            win = torch.from_numpy(np.asarray(self.data[idx], dtype=np.uint8))
            if self.device.type != "cpu":  # a split too large to keep there: one copy per batch, from pinned
                win = to_device(win, self.device)  # memory, queued (a pageable copy waited for the device each step)
        return win[:, :-1], win[:, 1:]
