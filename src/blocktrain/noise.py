"""Gaussian noise drawn on the device it is used on, the same on every device: a counter-based generator.

torch's CPU and CUDA generators draw different streams from one seed, so noise drawn by a CUDA generator could not
be replayed by a coordinator on a CPU (an audit of a GPU worker), and noise drawn on the host costs an accelerator a
host draw and a waiting copy per step (the paper preset's diffusion block draws 64 x 512 x 768 normals a step:
0.13 s on one core, as long as the block's whole step should take). Here the pair of elements (2p, 2p + 1) is a
pure function of a key and p, computed where it is used:

    a   = mix(p xor k_lo),  h_1 = mix(a xor k_hi),  h_2 = mix(h_1 xor k_lo)   (mix: Wellons' "lowbias32" hash)
    u_j = (floor(h_j / 2^8) + 1) / 2^24                                       in (0, 1], exact in fp32
    eps_2p, eps_2p+1 = sqrt(-2 ln u_1) (cos 2 pi u_2, sin 2 pi u_2)            (Box and Muller 1958)

The integer part runs in int32 whose multiplies wrap mod 2^32 (as every CPU and CUDA integer multiply does), so the
hashes are exact on every device and the normals agree to the fp32 rounding of log, cos and sqrt.
The key is one 62-bit draw from the caller's seeded host generator: callers keep passing generators, and a
generator advances by one draw whatever the shape. On a CPU it costs two to six times torch.randn
(benchmarks/results/noise-speed-cpu.json); on an accelerator it is a few elementwise kernels and no host work.
"""

from __future__ import annotations

import math

import torch

from blocktrain.device import CPU

MAX_ELEMENTS = 2**32  # elements one draw may index (its pair indices stay below 2^31, an int32)
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers (Wellons 2018, "hash prospector")


def as_int32(c: int) -> int:
    """The int32 whose two's-complement bits are the 32-bit value ``c``."""
    c &= 0xFFFFFFFF
    return c - 2**32 if c >= 2**31 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's >> on int32 is arithmetic: the mask drops the sign's copies)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of the 32-bit values in the int32 tensor ``x``: a bijection of 32-bit integers with good avalanche.

    The multiplies wrap mod 2^32, as every CPU and CUDA integer multiply does (AVX2's vpmulld, CUDA's IMAD).
    """
    x = x ^ _srl(x, 16)
    x.mul_(as_int32(_C1))
    x ^= _srl(x, 15)
    x.mul_(as_int32(_C2))
    return x ^ _srl(x, 16)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """(0, 1] fp32 from the top 24 bits of int32 hashes: exact in fp32."""
    return (_srl(h, 8) + 1).to(torch.float32).mul_(2.0**-24)


def draw_key(generator: torch.Generator) -> int:
    """One 62-bit key from the host generator (advances it by one draw)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def normal_pairs(p: torch.Tensor, key: int) -> torch.Tensor:
    """Elements (2p, 2p + 1) under ``key`` for pair indices ``p`` in [0, 2^31) (any integer dtype, shape and
    device): fp32 of shape p.shape + (2,)."""
    k_lo, k_hi = as_int32(key), as_int32(key >> 32)
    h1 = mix32(mix32(p.to(torch.int32) ^ k_lo) ^ k_hi)
    h2 = mix32(h1 ^ k_lo)
    r = _uniform(h1).log_().mul_(-2.0).sqrt_()
    theta = _uniform(h2).mul_(2 * torch.pi)
    return torch.stack([r * torch.cos(theta), r.mul_(torch.sin(theta))], dim=-1)


def normal(shape: tuple[int, ...], generator: torch.Generator, device: torch.device = CPU,
           keep: int | None = None) -> torch.Tensor:
    """N(0, I) fp32 of ``shape`` on ``device``: element i (row-major) is a function of (i, key) alone.

    ``keep``: compute only positions 0..keep-1 of dimension 1 (the draw is still of ``shape``, cut; nothing else of it
    is computed), so a position's noise does not depend on how many positions are kept.
    """
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise ValueError(f"one noise draw indexes at most {MAX_ELEMENTS:,} elements, asked for {n:,}; draw in parts")
    key = draw_key(generator)
    if keep is None:
        pairs = normal_pairs(torch.arange((n + 1) // 2, device=device, dtype=torch.int32), key)  # (ceil(n/2), 2)
        return pairs.view(-1)[:n].view(shape)
    if len(shape) < 2 or not 1 <= keep <= shape[1]:
        raise ValueError(f"keep must be in 1..shape[1] of a shape of two dimensions or more, got {keep} for {shape}")
    inner = math.prod(shape[2:])  # elements per position
    b = shape[0]
    # element index of (row, position, j) in the whole draw: (row * shape[1] + position) * inner + j
    idx = (torch.arange(b, device=device)[:, None] * shape[1] + torch.arange(keep, device=device)[None, :])  # (b, keep)
    idx = idx[:, :, None] * inner + torch.arange(inner, device=device)[None, None, :]  # (b, keep, inner)
    pairs = normal_pairs(idx // 2, key)  # (b, keep, inner, 2)
    # (b, keep, inner, 2) -> (b, keep, inner): each element takes the half its parity names
    out = pairs.gather(-1, (idx % 2)[..., None]).squeeze(-1)
    return out.view(b, keep, *shape[2:])
