"""Autoregressive byte generation with temperature, top-k and top-p (:mod:`blocktrain.sampling`).

For a BlockTrain model each new byte costs one traversal of the chain
(B block steps); for the E2E model one forward pass. The text stays on the model's device, each byte drawn there
(:func:`~blocktrain.sampling.sample_rows`) with noise from the seeded CPU generator (the same noise on every device;
the filtered distribution is the device's arithmetic), and nothing is read back before the last byte.
"""

from __future__ import annotations

import torch

from blocktrain.errors import RunError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.progress import progress_bar
from blocktrain.sampling import EMPTY_PROMPT, sample_rows
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
    start = prompt or EMPTY_PROMPT
    out = torch.zeros(len(start) + n_bytes, dtype=torch.uint8, device=model.device)  # (P + n,): the text, filled on
    out[: len(start)] = torch.frombuffer(bytearray(start), dtype=torch.uint8)
    g = Seed.SAMPLER.generator(seed)
    finite = torch.ones((), dtype=torch.bool, device=model.device)  # every byte's log-probs finite (read at the end)
    for i in progress_bar(range(n_bytes), desc="generate", unit="byte", disable=not progress):
        end = len(start) + i
        ctx = out[max(0, end - model.context) : end].unsqueeze(0)  # (1, t): the last context bytes
        logp = model.log_probs(ctx, chains=1, seed=Seed.BYTE.derive(seed, i))  # (1, 1, t, 256)
        finite &= torch.isfinite(logp[0, 0, -1]).all()
        out[end] = sample_rows(logp[0, 0, -1:], temperature, top_k, g, top_p)[0]  # stays on the device
    if not bool(finite):  # a NaN drew byte 0 (the sampler, like multinomial without its check, reads nothing)
        raise RunError("the model's log-probs are not finite (a diverged or damaged checkpoint?): no text from it")
    return bytes(out[len(start) :].tolist())  # the one read back of the text: after the last byte
