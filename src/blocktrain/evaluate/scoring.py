"""Cross-entropy of a whole split, every byte scored exactly once.

Windows come from :func:`blocktrain.data.dataset.eval_windows`: after the first
window each scored byte has at least half a window of context. The headline is
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
) -> ScoreResult:
    """Score ``data`` (uint8) with ``log_prob_fn``; ``max_bytes`` truncates the split first."""
    n = len(data) if max_bytes is None else min(len(data), max_bytes + 1)
    arr = np.asarray(data[:n], dtype=np.uint8)
    windows = eval_windows(n, context)
    total = None  # (K,) summed log-probs of chain k
    total_mix = 0.0
    count = 0
    chains = 1
    for i in progress_bar(range(0, len(windows), batch_size), desc=desc, unit="batch", disable=not progress, dynamic_ncols=True):
        batch = windows[i : i + batch_size]
        length = batch[0][1]
        idx = np.array([s for s, _, _ in batch])[:, None] + np.arange(length + 1)[None, :]
        win = torch.from_numpy(arr[idx])  # (b, length+1)
        x, y = win[:, :-1], win[:, 1:].long()
        logp = log_prob_fn(x)  # (K, b, t, 256)
        chains = logp.shape[0]
        lp_y = logp.gather(-1, y.unsqueeze(0).expand(chains, -1, -1).unsqueeze(-1)).squeeze(-1)  # (K, b, t)
        mask = torch.zeros_like(lp_y[0], dtype=torch.bool)
        for j, (_, _, first) in enumerate(batch):
            mask[j, first:] = True
        per_chain = (lp_y * mask).sum(dim=(1, 2)).double()
        total = per_chain if total is None else total + per_chain
        mix = torch.logsumexp(lp_y, dim=0) - math.log(chains)
        total_mix += float((mix * mask).sum())
        count += int(mask.sum())
    assert total is not None and count == n - 1, f"scored {count} of {n - 1} bytes"
    ce = -float(total[0]) / count
    return ScoreResult(
        ce_nats_per_byte=ce,
        bits_per_byte=ce / math.log(2),
        perplexity=math.exp(ce),
        bytes_scored=count,
        chains=chains,
        ce_mixture_nats_per_byte=(-total_mix / count) if chains > 1 else None,
        ce_per_chain=tuple(-float(v) / count for v in total),
    )
