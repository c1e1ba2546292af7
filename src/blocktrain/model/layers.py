"""Pre-norm causal Transformer layers, optionally conditioned by adaLN.

With conditioning, each LayerNorm's shift and scale come from a per-token
conditioning vector through a zero-initialised linear map (Peebles & Xie 2023,
"Scalable Diffusion Models with Transformers", adaLN), so at initialisation a
conditioned layer computes exactly what an unconditioned one does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (b, t, d) -> (b, h, t, d/h)
        q = q.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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


class AdaLayerNorm(nn.Module):
    """LayerNorm whose shift/scale are ``Linear(cond)``, zero-initialised (adaLN)."""

    def __init__(self, d_model: int, conditioned: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, elementwise_affine=not conditioned)
        self.mod: nn.Linear | None = None
        if conditioned:
            self.mod = nn.Linear(d_model, 2 * d_model)
            nn.init.zeros_(self.mod.weight)
            nn.init.zeros_(self.mod.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        h = self.norm(x)
        if self.mod is None:
            return h
        assert cond is not None, "a conditioned layer needs a conditioning vector"
        shift, scale = self.mod(cond).chunk(2, dim=-1)
        return h * (1 + scale) + shift


class TransformerLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, conditioned: bool) -> None:
        super().__init__()
        self.ln1 = AdaLayerNorm(d_model, conditioned)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = AdaLayerNorm(d_model, conditioned)
        self.mlp = MLP(d_model, mlp_ratio)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x, cond))
        return x + self.mlp(self.ln2(x, cond))


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

    adaLN modulation layers stay zero (they are re-zeroed by their owner).
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
    for m in module.modules():
        if isinstance(m, AdaLayerNorm) and m.mod is not None:
            nn.init.zeros_(m.mod.weight)
            nn.init.zeros_(m.mod.bias)
