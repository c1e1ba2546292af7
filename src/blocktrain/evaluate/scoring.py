"""Cross-entropy of a whole split, every byte scored exactly once.

Windows come from :func:`blocktrain.data.dataset.eval_windows`: after the first
window each scored byte has at least half a window of context, and a byte's score never depends on the bytes
after it (the windows are laid out from the start; a short last window is padded after its end, never scored
there, so every batch is read at the full context). The headline is
chain 0 (a fixed seed, K=1); with K>1 chains the mixture p = mean_k p_k is
scored beside it. The true next byte is used only to read off log p(y).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from blocktrain.data.dataset import eval_windows
from blocktrain.device import CPU
from blocktrain.progress import progress_bar

LogProbFn = Callable[[torch.Tensor], torch.Tensor]  # x (b, t) -> log p (K, b, t, 256)


@dataclass(frozen=True)
class ScoreResult:
    ce_nats_per_byte: float  # headline CE: chain 0 (K=1, fixed seed)
    bits_per_byte: float  # ce / ln 2
    perplexity: float  # exp(ce), per byte
    bytes_scored: int  # number of target bytes scored
    chains: int  # K
    ce_mixture_nats_per_byte: float | None  # CE of the K-chain mixture (None if K=1)
    ce_per_chain: tuple[float, ...] = ()  # CE of each of the K log-prob sets, in order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_split(
    log_prob_fn: LogProbFn,
    data: np.ndarray,
    context: int,
    *,
    batch_size: int = 32,
    max_bytes: int | None = None,
    progress: bool = False,
    desc: str = "eval",
    on_bytes: Callable[[torch.Tensor], None] | None = None,
    device: torch.device | None = None,
) -> ScoreResult:
    """Score ``data`` (uint8) with ``log_prob_fn``; ``max_bytes`` truncates the split first.

    The split moves to ``device`` (the host by default) once, and every batch is cut from it there, so ``log_prob_fn``
    receives x (b, t) on the device; the sums stay there until the last batch.

    ``on_bytes`` receives, batch by batch, chain 0's log-prob of each scored byte, in the order of the text
    (all of them together are log p(data[j] | data[:j]) for j = 1..n-1), on the device."""
    n = len(data) if max_bytes is None else min(len(data), max_bytes + 1)
    windows = eval_windows(n, context)
    device = device or CPU
    text = torch.from_numpy(np.array(data[:n], dtype=np.uint8)).to(device)  # (n,): the split, resident on the device
    starts = torch.tensor([s for s, _, _ in windows], device=device)  # (w,)
    lengths = torch.tensor([length for _, length, _ in windows], device=device)  # (w,)
    firsts = torch.tensor([first for _, _, first in windows], device=device)  # (w,)
    pos = torch.arange(context, device=device)  # (t,): every window is read at the full width, a short last one padded
    span = torch.arange(context + 1, device=device)  # (t+1,)
    count = sum(length - first for _, length, first in windows)  # bytes scored, known before any is
    scored, ends = _scored_places(windows, context, device) if on_bytes is not None else (None, None)
    total: torch.Tensor | None = None  # (K,) float64 summed log-probs of chain k, on the device until the end
    total_mix = torch.zeros((), dtype=torch.float64, device=device)
    chains = 1
    for i in progress_bar(range(0, len(windows), batch_size), desc=desc, unit="batch", disable=not progress, dynamic_ncols=True):
        sl = slice(i, i + batch_size)
        idx = (starts[sl, None] + span[None, :]).clamp(max=n - 1)  # (b, t+1)
        win = text[idx]  # (b, t+1): a padded tail repeats the last byte and is not scored
        x, y = win[:, :-1], win[:, 1:].long()
        logp = log_prob_fn(x)  # (K, b, t, 256)
        chains = logp.shape[0]
        lp_y = logp.gather(-1, y.unsqueeze(0).expand(chains, -1, -1).unsqueeze(-1)).squeeze(-1)  # (K, b, t)
        mask = (pos[None, :] >= firsts[sl, None]) & (pos[None, :] < lengths[sl, None])  # (b, t): the scored positions
        per_chain = torch.where(mask, lp_y, 0.0).sum(dim=(1, 2)).double()  # an unscored -inf or NaN stays out (0 x inf)
        if scored is not None and ends is not None and on_bytes is not None:  # the batch's scored places, selected
            # (a boolean mask's selection waits for the device to count its rows): row-major, the text's order
            flat = scored[ends[i]:ends[min(i + batch_size, len(windows))]] - i * context
            on_bytes(lp_y[0].reshape(-1).index_select(0, flat))  # (scored,)
        total = per_chain if total is None else total + per_chain
        mix = torch.logsumexp(lp_y, dim=0) - math.log(chains)
        total_mix += torch.where(mask, mix, 0.0).sum().double()
    assert total is not None and count == n - 1, f"scored {count} of {n - 1} bytes"
    sums = total.tolist()  # the one wait for the device: after the last batch
    ce = -sums[0] / count
    return ScoreResult(
        ce_nats_per_byte=ce,
        bits_per_byte=ce / math.log(2),
        perplexity=math.exp(ce),
        bytes_scored=count,
        chains=chains,
        ce_mixture_nats_per_byte=(-float(total_mix) / count) if chains > 1 else None,
        ce_per_chain=tuple(-v / count for v in sums),
    )


def _scored_places(windows: list[tuple[int, int, int]], context: int,
                   device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Each scored byte's place r x context + p in the (windows, context) grid of log-probs, in the text's order, on
    ``device`` (uploaded once); and, per window, where its places begin (the last entry: their count)."""
    firsts = np.array([first for _, _, first in windows], dtype=np.int64)  # (w,)
    counts = np.array([length - first for _, length, first in windows], dtype=np.int64)  # (w,)
    begins = np.concatenate([[0], np.cumsum(counts)])  # (w+1,)
    rows = np.repeat(np.arange(len(windows), dtype=np.int64), counts)  # (scored,)
    within = np.arange(begins[-1], dtype=np.int64) - np.repeat(begins[:-1], counts) + np.repeat(firsts, counts)
    return torch.from_numpy(rows * context + within).to(device), begins.tolist()


def target_log_probs(
    log_prob_fn: LogProbFn, data: bytes | np.ndarray, context: int, *, batch_size: int = 32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """log p(data[j] | data[:j]) for j = 1..n-1 (float64, shape (n-1,)), chain 0, in :func:`score_split`'s windows:
    the local reference a served or harness log-likelihood is checked against."""
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    got: list[torch.Tensor] = []
    score_split(log_prob_fn, arr, context, batch_size=batch_size, on_bytes=got.append, device=device)
    return torch.cat(got).double().cpu()
