"""The counter noise generator: exact integer hashes, a normal distribution, a draw that does not depend on its cut,
and the same numbers on every device."""

from __future__ import annotations

import math

import pytest
import torch

from blocktrain import noise
from blocktrain.noise import MAX_ELEMENTS, mix32, normal, normal_pairs


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 on Python integers: the reference the int32 tensor version must equal bit for bit."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_pair(p: int, key: int) -> tuple[float, float]:
    """Elements (2p, 2p + 1) by the module docstring's formulas, in float64 from Python integers."""
    k_lo, k_hi = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    h1 = lowbias32(lowbias32(p ^ k_lo) ^ k_hi)
    h2 = lowbias32(h1 ^ k_lo)
    u1, u2 = ((h1 >> 8) + 1) * 2.0**-24, ((h2 >> 8) + 1) * 2.0**-24
    r = math.sqrt(-2 * math.log(u1))
    return r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)


def test_mix32_equals_the_reference_hash_bit_for_bit() -> None:
    values = [0, 1, 2, 0xFFFF, 2**31 - 1, 2**31, 2**31 + 12345, 2**32 - 1, *range(1000, 1100)]
    signed = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    got = (mix32(signed).to(torch.int64) & 0xFFFFFFFF).tolist()
    assert got == [lowbias32(v) for v in values]


@pytest.mark.parametrize("key", [0, 1, 2**62 - 1, 0x1234_5678_9ABC_DEF])
def test_pairs_equal_the_reference_formula(key: int) -> None:
    p = torch.tensor([0, 1, 7, 2**20, 2**31 - 1], dtype=torch.int64)
    got = normal_pairs(p, key).double()
    want = torch.tensor([reference_pair(int(i), key) for i in p], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # fp32 rounding of log, cos, sin and sqrt


def test_a_draw_is_standard_normal_and_uncorrelated() -> None:
    x = normal((1 << 20,), torch.Generator().manual_seed(0)).double()
    n = x.numel()
    # tolerances: about 5 standard errors of each statistic at n = 2^20
    assert abs(float(x.mean())) < 5 / math.sqrt(n)
    assert abs(float(x.var()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((x**4).mean()) - 3) < 5 * math.sqrt(96 / n)
    srt = x.sort().values
    cdf = 0.5 * (1 + torch.erf(srt / math.sqrt(2)))
    ks = float((cdf - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max())
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at the 1% level
    for a, b in ((x[:-1], x[1:]), (x[0::2], x[1::2]), (x[:-64], x[64:])):  # neighbours, Box-Muller halves, a stride
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 5 / math.sqrt(a.numel())
    y = normal((1 << 20,), torch.Generator().manual_seed(1)).double()
    assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 5 / math.sqrt(n)  # another seed: another draw


def test_a_generator_advances_one_draw_and_a_seed_repeats() -> None:
    g, h = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = normal((4, 5), g), normal((2,), g)
    assert torch.equal(a, normal((4, 5), h)) and torch.equal(b, normal((2,), h))
    assert not torch.equal(a.view(-1)[:2], b)
    assert g.get_state().equal(h.get_state())


@pytest.mark.parametrize("shape", [(3, 10, 6), (3, 10, 5), (2, 7, 3, 3), (1, 4)])
def test_keep_computes_the_cut_of_the_whole_draw(shape: tuple[int, ...]) -> None:
    whole = normal(shape, torch.Generator().manual_seed(9))
    for keep in (1, 3, shape[1]):
        assert torch.equal(normal(shape, torch.Generator().manual_seed(9), keep=keep), whole[:, :keep])
    with pytest.raises(ValueError, match="keep"):
        normal(shape, torch.Generator(), keep=shape[1] + 1)


def test_the_draw_is_made_on_the_device_named() -> None:
    out = normal((2, 3, 4), torch.Generator().manual_seed(0), torch.device("meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, 4) and out.dtype == torch.float32


def test_too_large_a_draw_is_refused_before_anything_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noise, "MAX_ELEMENTS", 100)
    with pytest.raises(ValueError, match="draw in parts"):
        normal((11, 10), torch.Generator())
    assert MAX_ELEMENTS == 2**32  # the real bound keeps pair indices within an int32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_what_the_cpu_draws() -> None:
    cpu = normal((8, 64, 96), torch.Generator().manual_seed(4))
    gpu = normal((8, 64, 96), torch.Generator().manual_seed(4), torch.device("cuda"))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=2e-6)
