"""The end-to-end (E2E) reference: a plain causal byte-level Transformer."""

from __future__ import annotations

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.layers import Cache, TransformerLayer, init_weights


class E2ETransformer(nn.Module):
    """Same width, heads, total depth L and context T as the block stack."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg.d_model, cfg.n_heads, cfg.mlp_ratio, conditioned=False) for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB_SIZE)
        init_weights(self)

    def forward(self, x: torch.Tensor, cache: Cache | None = None, pos: int = 0) -> torch.Tensor:
        """x: (b, t) uint8/long bytes at positions pos.. -> logits (b, t, 256) for the byte after each position.

        With ``cache`` (one sequence's keys and values of positions 0..pos-1, layers named by index) it is
        extended by x's positions.
        """
        h = self.embed(x, pos)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache=cache, name=str(i))
        return self.readout(h)

    def embed(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        """x: (b, t) bytes at positions pos.. -> the residual stream (b, t, d) the first layer reads."""
        t = x.shape[1]
        if pos + t > self.cfg.context:
            raise ValueError(f"sequence of {pos + t} bytes exceeds the context of {self.cfg.context}")
        return self.tok_emb(x.long()) + self.pos_emb(torch.arange(pos, pos + t, device=x.device))

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream (b, t, d) after the last layer -> logits (b, t, 256)."""
        return self.head(self.ln_f(h))
