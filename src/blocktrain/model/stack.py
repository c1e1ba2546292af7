"""One block of the residual-stream stack: L/B causal layers and a next-byte head.

Block k of B (greedy layer-wise training with deep supervision; Bengio et al.
2007, Lee et al. 2015, Belilovsky et al. 2019)::

    k = 0:  h_1     = Layers_0(ByteEmb(x) + PosEmb)
    k > 0:  h_{k+1} = Layers_k(h_k)                   (h_k from block k-1, detached)
            h_{k+1} = Layers_k(sum_j alpha_kj h_j)     (dense inputs: a learned mix of h_0 and earlier outputs)
    head:   logits_k = W_k LN_k(HeadLayers_k(h_{k+1})) [+ logits of block k-1's frozen head on h_{k+1}]

The bracketed term is the ``residual`` head (boosting in one logit space:
W_k starts at zero, so prefix k starts as block k-1's head read on h_{k+1}).
The composed model is blocks 0..B-1 in order plus the last block's head, and
every prefix 0..k with block k's head is a byte-level language model of its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.layers import Cache, TransformerLayer, init_weights


class FrozenHead(nn.Module):
    """A forward-only copy of an earlier block's head (its own frozen head included): h (b, t, d) -> logits (b, t, 256)."""

    def __init__(self, d: int, n_heads: int, mlp_ratio: int, layers: int, prev: FrozenHead | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(d, n_heads, mlp_ratio, conditioned=False) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB_SIZE)
        self.prev = prev
        self.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h
        for layer in self.layers:
            out = layer(out)
        logits = self.head(self.ln_f(out))
        return logits if self.prev is None else logits + self.prev(h)

    @torch.no_grad()
    def load_from(self, block: StackBlock) -> None:
        """Copy ``block``'s head (its layers, LayerNorm, Linear and own frozen head) into this one."""
        pairs: list[tuple[nn.Module, nn.Module]] = [(self.layers, block.head_layers), (self.ln_f, block.ln_f),
                                                    (self.head, block.head)]
        if self.prev is not None:
            assert block.prev_head is not None
            pairs.append((self.prev, block.prev_head))
        copy_parameters(pairs)


class StackBlock(nn.Module):
    """Block ``k``: reads bytes (k = 0) or the residual stream h_k (k > 0), returns h_{k+1}.

    ``prev_head`` (residual heads): the frozen head of block k-1, added to this block's logits.
    ``frozen_head``: the head's own parameters take no gradient (a shared head, copied from block 0).
    ``dense_inputs``: block k > 0 reads a mix of that many stream states (b, t, m, d), the last one h_k;
    the weights alpha start at (0, ..., 0, 1), so the block starts as a plain stack block.
    """

    def __init__(
        self, cfg: ModelConfig, k: int, head_layers: int = 0, *, prev_head: FrozenHead | None = None,
        frozen_head: bool = False, dense_inputs: int = 0,
    ) -> None:
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
        self.mix = nn.Parameter(torch.eye(dense_inputs)[-1]) if dense_inputs and k > 0 else None  # alpha_k (m,)
        self.prev_head = prev_head
        if prev_head is not None:  # boosting: this block's own head starts at zero
            assert isinstance(self.head, nn.Linear)
            nn.init.zeros_(self.head.weight)
        if frozen_head:
            for m in (self.head_layers, self.ln_f, self.head):
                m.requires_grad_(False)

    def embed(self, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
        """x (b, t) bytes at positions pos.. -> h_0 (b, t, d) in fp32 (block 0 only)."""
        if self.tok_emb is None or self.pos_emb is None:
            raise ValueError(f"block {self.k} reads the residual stream, not bytes; only block 0 embeds")
        t = x.shape[1]
        if pos + t > self.cfg.context:
            raise ValueError(f"sequence of {pos + t} bytes exceeds the context of {self.cfg.context}")
        return (self.tok_emb(x.long()) + self.pos_emb(torch.arange(pos, pos + t, device=x.device))).float()

    def forward(self, inp: torch.Tensor, cache: Cache | None = None, pos: int = 0) -> torch.Tensor:
        """Bytes (b, t) for block 0, else h_k (b, t, d) or stream states (b, t, m, d) -> h_{k+1} (b, t, d).

        With ``cache`` (one sequence's keys and values), ``inp`` holds positions pos.. and the cache, holding
        positions 0..pos-1, is extended by them (its layers are named ``"k.j"``).
        """
        if self.k == 0:
            h = self.embed(inp, pos)
        elif self.mix is not None:
            if inp.dim() != 4 or inp.shape[2] != self.mix.shape[0]:
                raise ValueError(f"block {self.k} mixes {self.mix.shape[0]} stream states (b, t, m, d); got {tuple(inp.shape)}")
            with torch.autocast(inp.device.type, enabled=False):  # the residual stream stays fp32
                h = torch.einsum("btmd,m->btd", inp.float(), self.mix.float())  # (b, t, m, d) -> (b, t, d)
        else:
            h = inp.float()
        for j, layer in enumerate(self.layers):
            h = layer(h, cache=cache, name=f"{self.k}.{j}")
        return h

    def logits(self, h: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """Block k's local head on h_{k+1} (b, t, d) -> next-byte logits (b, t, 256); ``cache`` as in forward
        (its head layers are named ``"head.j"``; a residual head is position-wise and caches nothing)."""
        out = h
        for j, layer in enumerate(self.head_layers):
            out = layer(out, cache=cache, name=f"head.{j}")
        logits = self.head(self.ln_f(out))
        return logits if self.prev_head is None else logits + self.prev_head(h)

    @torch.no_grad()
    def zero_branches(self) -> None:
        """Zero every layer's output projections: the block then passes h_k through unchanged (h_{k+1} = h_k)."""
        for layer in self.layers:
            assert isinstance(layer, TransformerLayer)
            for m in (layer.attn.proj, layer.mlp.out):
                nn.init.zeros_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.no_grad()
    def copy_from(self, other: StackBlock, *, layers: bool, head: bool) -> None:
        """Copy ``other``'s layers and/or its head (where the shapes agree) into this block."""
        pairs: list[tuple[nn.Module, nn.Module]] = []
        if layers:
            pairs.append((self.layers, other.layers))
        if head:
            pairs += [(self.ln_f, other.ln_f), (self.head, other.head)]
            if len(self.head_layers) == len(other.head_layers):
                pairs.append((self.head_layers, other.head_layers))
        copy_parameters(pairs)


@torch.no_grad()
def copy_parameters(pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Copy each source module's parameters into its destination (same structure), as fp32."""
    for mine, theirs in pairs:
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            p.copy_(q.float())


def frozen_copy(block: StackBlock, dtype: torch.dtype = torch.bfloat16) -> StackBlock:
    """A forward-only copy of ``block`` for the worker of a later block.

    Matmul weights are stored in ``dtype``: fp32 as trained; bf16 halves their
    memory (under bf16 autocast a matmul casts its fp32 weights to bf16 anyway,
    so the copy computes exactly what the block computes); torch.int8 quarters it
    (:class:`StoredLinear`). Embedding tables, LayerNorms and the residual stream
    stay fp32. The local head is dropped: a later block
    never uses it (a later block that needs it holds its own copy). Run a bf16
    copy under bf16 autocast.
    """
    frozen = copy.deepcopy(block)
    frozen.head_layers = nn.ModuleList()  # the head is not part of a frozen copy
    frozen.ln_f = nn.Identity()
    frozen.head = nn.Identity()
    frozen.prev_head = None
    if dtype is not torch.float32:
        for parent in list(frozen.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, StoredLinear(child, dtype))
    frozen.requires_grad_(False)
    return frozen.eval()


class StoredLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in bf16, or in int8 with a per-output-row absmax scale
    (W ~ q * s, q = round(W / s), s = max_j |W_ij| / 127), and computed in the input's dtype: the weight is
    dequantised for each forward, one layer at a time."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        if dtype is torch.int8:
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127  # (out, 1)
            self.register_buffer("weight", torch.round(w / scale).to(torch.int8))
            self.register_buffer("scale", scale)
        elif dtype is torch.bfloat16:
            self.register_buffer("weight", w.to(dtype))
            self.scale = None
        else:
            raise ValueError(f"frozen weights are stored in float32, bfloat16 or int8, not {dtype}")
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().to(torch.float32 if dtype is torch.int8 else dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype)
        if self.scale is not None:
            w = w * self.scale.to(x.dtype)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
