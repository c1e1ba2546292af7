"""The end-to-end (E2E) reference: a plain causal byte-level Transformer."""

from __future__ import annotations

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.layers import TransformerLayer, init_weights


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (b, t) uint8/long bytes -> logits (b, t, 256) for the byte after each position."""
        t = x.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} bytes exceeds the context of {self.cfg.context}")
        pos = torch.arange(t, device=x.device)
        h = self.tok_emb(x.long()) + self.pos_emb(pos)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln_f(h))
