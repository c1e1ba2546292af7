"""One block of the residual-stream stack: L/B causal layers and a private next-byte head.

Block k of B (greedy layer-wise training with deep supervision; Bengio et al.
2007, Lee et al. 2015, Belilovsky et al. 2019)::

    k = 0:  h_1     = Layers_0(ByteEmb(x) + PosEmb)
    k > 0:  h_{k+1} = Layers_k(h_k)                   (h_k from block k-1, detached)
    head:   logits_k = W_k LN_k(HeadLayers_k(h_{k+1}))

The composed model is blocks 0..B-1 in order plus the last block's head, and
every prefix 0..k with block k's head is a byte-level language model of its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.layers import TransformerLayer, init_weights


class StackBlock(nn.Module):
    """Block ``k``: reads bytes (k = 0) or the residual stream h_k (k > 0), returns h_{k+1}."""

    def __init__(self, cfg: ModelConfig, k: int, head_layers: int = 0) -> None:
        super().__init__()
        if not 0 <= k < cfg.n_blocks:
            raise ValueError(f"block index {k} is outside 0..{cfg.n_blocks - 1}")
        self.cfg = cfg
        self.k = k
        d = cfg.d_model
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d) if k == 0 else None
        self.pos_emb = nn.Embedding(cfg.context, d) if k == 0 else None
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, conditioned=False) for _ in range(cfg.layers_per_block)
        )
        self.head_layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, conditioned=False) for _ in range(head_layers)
        )
        self.ln_f: nn.Module = nn.LayerNorm(d)
        self.head: nn.Module = nn.Linear(d, VOCAB_SIZE)
        init_weights(self)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, t) bytes -> h_0 (b, t, d) in fp32 (block 0 only)."""
        if self.tok_emb is None or self.pos_emb is None:
            raise ValueError(f"block {self.k} reads the residual stream, not bytes; only block 0 embeds")
        t = x.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} bytes exceeds the context of {self.cfg.context}")
        pos = torch.arange(t, device=x.device)
        return (self.tok_emb(x.long()) + self.pos_emb(pos)).float()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Bytes (b, t) for block 0, else h_k (b, t, d) -> h_{k+1} (b, t, d)."""
        h = self.embed(inp) if self.k == 0 else inp.float()
        for layer in self.layers:
            h = layer(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Block k's local head on h_{k+1} (b, t, d) -> next-byte logits (b, t, 256)."""
        for layer in self.head_layers:
            h = layer(h)
        return self.head(self.ln_f(h))

    def trunk_modules(self) -> list[nn.Module]:
        """What a later block's worker needs of this block: everything but the local head."""
        mods: list[nn.Module] = [m for m in (self.tok_emb, self.pos_emb) if m is not None]
        return [*mods, self.layers]


def frozen_copy(block: StackBlock, dtype: torch.dtype = torch.bfloat16) -> StackBlock:
    """A forward-only copy of ``block`` for the worker of a later block.

    Matmul weights are stored in ``dtype`` (bf16 halves their memory; under
    bf16 autocast a matmul casts its fp32 weights to bf16 anyway, so the copy
    computes exactly what the block computes). Embedding tables, LayerNorms and
    the residual stream stay fp32. The local head is dropped: a later block
    never uses it. Run a bf16 copy under bf16 autocast.
    """
    frozen = copy.deepcopy(block)
    frozen.head_layers = nn.ModuleList()  # the head is not part of a frozen copy
    frozen.ln_f = nn.Identity()
    frozen.head = nn.Identity()
    for m in frozen.modules():
        if isinstance(m, nn.Linear):
            m.to(dtype)
    frozen.requires_grad_(False)
    return frozen.eval()
