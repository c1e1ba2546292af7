"""Autoregressive byte generation with temperature and top-k.

For a BlockTrain model each new byte costs one traversal of the chain
(B block steps); for the E2E model one forward pass.
"""

from __future__ import annotations

import torch

from blocktrain.data.stream import GENERATE_SAMPLER, mix_seed
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.progress import progress_bar


def sample_from_logits(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Sample one byte from (256,) logits; temperature 0 means greedy."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


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
) -> bytes:
    if n_bytes < 0:
        raise ValueError("n_bytes must be >= 0")
    out = bytearray(prompt or b"\n")
    g = torch.Generator().manual_seed(mix_seed(seed, GENERATE_SAMPLER))
    for i in progress_bar(range(n_bytes), desc="generate", unit="byte", disable=not progress):
        ctx = torch.tensor(list(out[-model.context :]), dtype=torch.uint8).unsqueeze(0)
        logp = model.log_probs(ctx, chains=1, seed=mix_seed(seed, i))  # (1, 1, t, 256)
        out.append(sample_from_logits(logp[0, 0, -1], temperature, top_k, g))
    return bytes(out[len(prompt or b"\n") :])
