"""Sampling a byte from a model's logits: the one sampler of local and remote generation.

Temperature (0: greedy, the argmax, drawing nothing from the generator), top-k (0: off) and top-p (nucleus
sampling, Holtzman et al. 2020; 1: off) apply in that order. Local ``generate``, the pipeline client's ar and
baseline modes, speculative decoding's drafts and verdicts, and the sweep stage all draw through here, so a
served ar continuation equals a local one at the same seed. Spec samples ar's distribution on a stack run (its bytes
differ, its distribution does not); on diffusion blocks it samples the chain under one noise per position, where ar
draws fresh noise for every byte: close, not the same sampler (docs/serving.md, the modes).
"""

from __future__ import annotations

import torch

from blocktrain.device import to_device

EMPTY_PROMPT = b"\n"  # what generation continues when the prompt is empty (a model needs one byte of history)


MIN_TEMPERATURE = 1e-6  # the lowest temperature sampled at: logits / 1e-6 stay finite in fp32


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits (n, V) -> the sampling distribution (n, V) in fp32 after temperature, top-k and top-p.

    temperature <= 0: one-hot on the argmax; one below MIN_TEMPERATURE samples at it (greedy in effect: a smaller one
    overflowed the scaled logits to inf and the distribution to NaN). top_k = 0 keeps all bytes; top_p = 1 keeps all
    (nucleus sampling, Holtzman et al. 2020: the smallest set of most likely bytes whose mass reaches top_p).
    """
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    scaled = logits.float() / max(temperature, MIN_TEMPERATURE)
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the strictly more likely bytes
        drop_sorted = before >= top_p  # the most likely byte always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_probs(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs (n, V) -> (n,) int64 on probs' device, without waiting for that device.

    The exponential race: argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. picks v with probability p_v. It is the draw
    torch.multinomial(probs, 1) makes, equal to it bit for bit on the CPU (same noise, same order), less the
    validity check multinomial reads back from the device. E is drawn on the host by the seeded CPU ``generator``
    and copied over, so a draw is the same on every device (given equal probs).
    """
    if generator.device.type != "cpu":
        raise ValueError(f"the sampler draws its noise with a seeded CPU generator, got one on {generator.device}")
    e = torch.empty(probs.shape, dtype=probs.dtype, device=generator.device).exponential_(1, generator=generator)  # (n, V)
    return (probs / to_device(e, probs.device)).argmax(dim=-1)  # from pinned memory on CUDA: queued, not waited for


def sample_rows(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator, top_p: float = 1.0,
) -> torch.Tensor:
    """One byte per row of (n, 256) logits (n,) int64: the argmax at temperature <= 0 (nothing drawn from the
    generator), else a draw from :func:`filtered_probs`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return sample_probs(filtered_probs(logits, temperature, top_k, top_p), generator)


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator, top_p: float = 1.0
) -> int:
    """One byte from (256,) logits: :func:`sample_rows` on a single row."""
    return int(sample_rows(logits.unsqueeze(0), temperature, top_k, generator, top_p)[0])


def sample_byte(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, g: torch.Generator) -> int:
    """One byte from raw logits (256,) a stage returned: normalised first, then :func:`sample_from_logits` (with
    top_p = 1 the same draw as the local ``generate``, which samples from log-probs)."""
    return sample_from_logits(torch.log_softmax(logits.float(), -1), temperature, top_k, g, top_p)
