"""Bytes of activations autograd saves for one training step, block vs E2E (cpu-small).

Counts every distinct storage packed by ``saved_tensors_hooks`` during one forward.

    python benchmarks/quality/saved_activations.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.loss import lm_loss
from blocktrain.presets import cpu_small


def saved_mib(fn: Callable[[], torch.Tensor]) -> float:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / 2**20


def main() -> int:
    cfg = cpu_small()
    b, t = cfg.train.batch_size, cfg.model.context
    x, y = torch.randint(0, 256, (b, t)), torch.randint(0, 256, (b, t))
    block = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
    part = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
    g = torch.Generator().manual_seed(0)
    e2e = E2ETransformer(cfg.model)
    sys.stdout.write(f"block {saved_mib(lambda: block_loss(block, 3, x, y, part, cfg.diffusion, g).loss):.1f} MiB\n")
    sys.stdout.write(f"e2e   {saved_mib(lambda: lm_loss(e2e(x), y)):.1f} MiB\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
