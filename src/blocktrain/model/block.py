"""One block: a complete, shallow denoiser of the next byte's embedding.

Input at position t: the clean byte context x_{<=t} and z_t, a noisy embedding
of byte x_{t+1} at noise level sigma_t (and, through causal attention, z_{<t}:
noisy copies of bytes already in the context). With EDM preconditioning
(Karras et al. 2022, Eq. 7):

    h_0   = ByteEmb(x) + PosEmb + W_in (c_in(sigma) * z)
    F     = LN(Layers(h_0; adaLN(c_noise(sigma))))
    y_hat = c_skip(sigma) * z + c_out(sigma) * F
    logits = Head(y_hat)

The block's own head turns the denoised embedding y_hat into next-byte logits.
"""

from __future__ import annotations

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.embedding import make_target_embedding
from blocktrain.model.layers import SigmaEmbedding, TransformerLayer, init_weights
from blocktrain.model.preconditioning import Preconditioning


class BlockDenoiser(nn.Module):
    """L/B causal Transformer layers conditioned on sigma through adaLN."""

    def __init__(self, cfg: ModelConfig, sigma_data: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.precond = Preconditioning(sigma_data)
        d = cfg.d_model
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d)
        self.pos_emb = nn.Embedding(cfg.context, d)
        self.z_in = nn.Linear(d, d)
        self.sigma_emb = SigmaEmbedding(d)
        self.mod = nn.Linear(d, 4 * d)  # adaLN-single: one modulation for all layers
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, conditioned=True) for _ in range(cfg.layers_per_block)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB_SIZE)
        init_weights(self)
        # Zero-init z's path into the layers: F starts as a causal LM's estimate
        # from the context alone, and learns how far to trust z (at init c_in*z
        # would be ~10x louder than the byte embedding and drown it). z still
        # reaches the head through the skip, c_skip(sigma) * z: a block does not
        # start as a plain LM (sigma_data 0.5 is a hyperparameter here, not the
        # per-coordinate spread of E's unit rows, 1/sqrt(d)).
        nn.init.zeros_(self.z_in.weight)
        # Zero-init adaLN: at init every layer computes a plain LayerNorm.
        nn.init.zeros_(self.mod.weight)
        # Frozen, shared target embedding E (persistent buffer: saved, never trained).
        self.register_buffer("target_embedding", make_target_embedding(d, cfg.embed_seed))

    @property
    def E(self) -> torch.Tensor:  # noqa: N802 - paper symbol
        return self.target_embedding  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """x: (b, t) bytes, z: (b, t, d), sigma: scalar, (b,), (b, 1) or (b, t) -> logits (b, t, 256).

        A per-sequence sigma keeps the adaLN conditioning at (b, 1, d) instead
        of a full (b, t, d) activation in every layer.
        """
        b, t = x.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} bytes exceeds the context of {self.cfg.context}")
        sigma = torch.as_tensor(sigma, dtype=z.dtype, device=z.device)
        if sigma.dim() == 0:
            sigma = sigma.view(1, 1).expand(b, 1)  # () -> (b, 1)
        elif sigma.dim() == 1:
            sigma = sigma.view(b, 1)  # (b,) -> (b, 1)
        s = sigma.unsqueeze(-1)  # (b, 1|t) -> (b, 1|t, 1)
        pos = torch.arange(t, device=x.device)
        h = self.tok_emb(x.long()) + self.pos_emb(pos) + self.z_in(self.precond.c_in(s) * z)
        mod = self.mod(self.sigma_emb(self.precond.c_noise(sigma)))  # (b, 1|t, 4d)
        for layer in self.layers:
            h = layer(h, mod)
        f = self.ln_f(h)  # F: the network's estimate in embedding space
        y_hat = self.precond.c_skip(s) * z + self.precond.c_out(s) * f
        return self.head(y_hat)

    def denoised(self, logits: torch.Tensor) -> torch.Tensor:
        """D = softmax(logits) @ E: the expected target embedding, (b, t, d), in fp32 under any autocast (the solver
        divides D's error by sigma)."""
        with torch.autocast(self.E.device.type, enabled=False):
            return torch.softmax(logits.float(), dim=-1) @ self.E.float()
