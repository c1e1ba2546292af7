"""Autoregressive byte generation with temperature, top-k and top-p (:mod:`blocktrain.sampling`).

For a BlockTrain model each new byte costs one traversal of the chain
(B block steps); for the E2E model one forward pass. The model computes on its device; each byte's 256 log-probs
come back to the host, where the seeded CPU generator draws it, so a continuation is the same on every device.
"""

from __future__ import annotations

import torch

from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.progress import progress_bar
from blocktrain.sampling import EMPTY_PROMPT, sample_from_logits
from blocktrain.seeds import Seed


@torch.no_grad()
def generate(
    model: AssembledModel | E2EModel,
    prompt: bytes,
    n_bytes: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    progress: bool = False,
    top_p: float = 1.0,
) -> bytes:
    if n_bytes < 0:
        raise ValueError("n_bytes must be >= 0")
    out = bytearray(prompt or EMPTY_PROMPT)
    g = Seed.SAMPLER.generator(seed)
    for i in progress_bar(range(n_bytes), desc="generate", unit="byte", disable=not progress):
        ctx = torch.tensor(list(out[-model.context :]), dtype=torch.uint8, device=model.device).unsqueeze(0)  # (1, t)
        logp = model.log_probs(ctx, chains=1, seed=Seed.BYTE.derive(seed, i))  # (1, 1, t, 256)
        out.append(sample_from_logits(logp[0, 0, -1].cpu(), temperature, top_k, g, top_p))  # the byte is the output
    return bytes(out[len(prompt or EMPTY_PROMPT) :])
