"""Pre-norm causal Transformer layers, optionally conditioned by adaLN.

With conditioning, each LayerNorm's shift and scale come from a modulation
vector (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers",
adaLN) that the owner computes once with a zero-initialised linear map and
shares across its layers, each adding a zero-initialised offset (adaLN-single,
see :class:`TransformerLayer`). At initialisation a conditioned layer computes
exactly what an unconditioned one does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@functools.cache
def _square_bias(side: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(side, side) additive causal mask: 0 on and below the diagonal, -inf above."""
    return torch.full((side, side), float("-inf"), device=device).triu(1).to(dtype)


def _causal_bias(t: int, n_past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(t, n_past + t) additive mask: new position i (absolute n_past + i) sees keys 0..n_past + i (0), not later
    ones (-inf); a view of one cached square mask per power of two (a mask per (t, n_past) pair a serving stage meets
    grew without bound)."""
    n = n_past + t
    return _square_bias(1 << max(n - 1, 0).bit_length(), dtype, device)[n_past:n, :n]


def _explicit(q: torch.Tensor) -> bool:
    """bf16 on CPU takes the explicit form: oneDNN's bf16 batched matmuls plus a bf16 softmax (fp32 inside the
    kernel) run fwd+bwd about 2x faster than the CPU flash-attention kernel at T=256, d_h=64
    (``benchmarks/quality/speed_ablation.py``). Everywhere else (fp32, CUDA) SDPA picks its fused kernel."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_past: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h) + M) v, q (b, h, t, d_h) over k, v (b, h, n_past + t, d_h), in q's dtype."""
    t = q.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5) + _causal_bias(t, n_past, q.dtype, q.device)
    return torch.matmul(torch.softmax(s, dim=-1), v)  # s: (b, h, t, n_past + t)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h) + M) v with the causal mask M (Vaswani et al. 2017, Eq. 1); q, k, v (b, h, t, d_h);
    in the explicit form on CPU bf16 (:func:`_explicit`), else SDPA."""
    if _explicit(q) and q.shape[-2] == k.shape[-2]:
        return _explicit_attention(q, k, v, 0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


KV = tuple[torch.Tensor, torch.Tensor]  # keys, values (b, h, t, d_h) of the positions a sequence has seen
Cache = dict[str, KV]  # one sequence's keys and values per attention layer, by the name its owner gives the layer


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: KV | None) -> tuple[torch.Tensor, KV]:
    """Causal attention of new positions q, k, v (b, h, t, d_h) over the ``past`` keys/values plus their own.

    Returns the output (b, h, t, d_h) and the keys/values of every position seen so far. New position i
    (absolute n_past + i) sees positions 0..n_past + i, as :func:`causal_attention` does on the whole sequence.
    """
    n_past, t = (0 if past is None else past[0].shape[2]), q.shape[2]
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    if _explicit(q):  # the form the whole sequence takes (:func:`causal_attention`): served logits equal local ones
        y = _explicit_attention(q, k, v, n_past)  # (SDPA here was 2e-3 off a bf16 CPU model's own forward)
    elif n_past == 0:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif t == 1:
        y = F.scaled_dot_product_attention(q, k, v)
    else:
        mask = torch.ones(t, n_past + t, dtype=torch.bool, device=q.device).tril(diagonal=n_past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y, (k, v)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, cache: Cache | None = None, name: str = "") -> torch.Tensor:
        """x (b, t, d) -> (b, t, d). With ``cache``, x holds the positions after those cached under ``name``,
        which are then extended by x's."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (b, t, d) -> (b, h, t, d/h)
        q = q.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        if cache is None:
            y = causal_attention(q, k, v)
        else:
            y, cache[name] = cached_attention(q, k, v, cache.get(name))
        # (b, h, t, d/h) -> (b, t, d)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model)
        self.out = nn.Linear(ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class _ModulatedLayerNorm(torch.autograd.Function):
    """out = LN(x) * (1 + scale) + shift, saving x and its statistics, not LN(x).

    Autograd on the plain expression would keep the normalised activation
    LN(x) alive for the backward of the product, one extra (b, t, d) tensor
    per norm; here it is recomputed from x, mean and rstd in the backward.
    scale and shift broadcast against x (per sequence (b, 1, d) or per token).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
        rstd = torch.rsqrt(x.var(dim=-1, unbiased=False, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, mean, rstd, scale)
        ctx.shapes = (scale.shape, shift.shape)
        return torch.addcmul(shift, (x - mean) * rstd, 1 + scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        x, mean, rstd, scale = ctx.saved_tensors
        scale_shape, shift_shape = ctx.shapes
        h = (x - mean) * rstd  # recomputed LN(x)
        grad_scale = (grad * h).sum_to_size(scale_shape)
        grad_shift = grad.sum_to_size(shift_shape)
        gh = grad * (1 + scale)  # gradient w.r.t. h
        # d LN / dx: rstd * (gh - mean(gh) - h * mean(gh * h))
        grad_x = rstd * (gh - gh.mean(dim=-1, keepdim=True) - h * (gh * h).mean(dim=-1, keepdim=True))
        return grad_x, grad_scale, grad_shift, None


class AdaLayerNorm(nn.Module):
    """LayerNorm, either with its own affine or modulated by a given (shift, scale) (adaLN)."""

    def __init__(self, d_model: int, conditioned: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, elementwise_affine=not conditioned)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        if shift is None or scale is None:
            return self.norm(x)
        out: torch.Tensor = _ModulatedLayerNorm.apply(x, scale, shift, self.norm.eps)
        return out


class TransformerLayer(nn.Module):
    """Pre-norm layer. Conditioned layers take a shared modulation (adaLN-single).

    A conditioned layer receives ``mod`` = Linear(cond), shape (b, 1|t, 4d), from
    its owner, shared by all its layers, and adds its own learned offset
    ``mod_table`` (4d,), zero-initialised (Chen et al. 2023, "PixArt-alpha",
    adaLN-single). This keeps one (d, 4d) modulation matrix per block instead
    of one per norm, at the same expressiveness for a scalar condition.
    """

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, conditioned: bool) -> None:
        super().__init__()
        self.ln1 = AdaLayerNorm(d_model, conditioned)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = AdaLayerNorm(d_model, conditioned)
        self.mlp = MLP(d_model, mlp_ratio)
        self.mod_table = nn.Parameter(torch.zeros(4 * d_model)) if conditioned else None
        self.recompute = False  # training: keep only x, and recompute the layer's activations in the backward

    def forward(
        self, x: torch.Tensor, mod: torch.Tensor | None = None, cache: Cache | None = None, name: str = ""
    ) -> torch.Tensor:
        """x (b, t, d) -> (b, t, d); with ``cache``, x continues the positions cached under ``name`` (KV-cached)."""
        if self.mod_table is None:
            if self.recompute and cache is None and torch.is_grad_enabled():  # activation checkpointing
                out: torch.Tensor = torch.utils.checkpoint.checkpoint(self._plain, x, use_reentrant=False)
                return out
            return self._plain(x, cache, name)
        assert mod is not None, "a conditioned layer needs its modulation"
        assert not self.recompute, "recompute is built for the stack and E2E layers (unconditioned)"
        shift1, scale1, shift2, scale2 = (mod + self.mod_table).chunk(4, dim=-1)
        x = x + self.attn(self.ln1(x, shift1, scale1), cache, name)
        return x + self.mlp(self.ln2(x, shift2, scale2))

    def _plain(self, x: torch.Tensor, cache: Cache | None = None, name: str = "") -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, name)
        return x + self.mlp(self.ln2(x))


def recompute_layers(module: nn.Module, on: bool) -> None:
    """Activation checkpointing for every unconditioned TransformerLayer of ``module`` (``train.recompute``)."""
    for m in module.modules():
        if isinstance(m, TransformerLayer) and m.mod_table is None:
            m.recompute = on


class SigmaEmbedding(nn.Module):
    """c_noise(sigma) -> Fourier features -> MLP -> conditioning vector."""

    def __init__(self, d_model: int, n_freq: int = 32) -> None:
        super().__init__()
        freqs = torch.exp(torch.linspace(0.0, math.log(100.0), n_freq))
        self.register_buffer("freqs", freqs, persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * n_freq, d_model), nn.SiLU(), nn.Linear(d_model, d_model), nn.SiLU())

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        # (...,) -> (..., n_freq)
        freqs: torch.Tensor = self.freqs  # type: ignore[assignment]
        arg = c_noise.unsqueeze(-1) * freqs
        return self.mlp(torch.cat([torch.sin(arg), torch.cos(arg)], dim=-1))


def init_weights(module: nn.Module) -> None:
    """GPT-2 style init: N(0, 0.02) for linear and embedding weights, zero biases.

    Owners re-zero their adaLN modulation after calling this.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
