"""Aggregation of one round's deltas and the outer step.

Given deltas Delta_i with sample counts n_i (all against version v):

* ``mean``:          Delta_bar = sum_i n_i Delta_i / sum_i n_i
* ``median``:        coordinate-wise median of the Delta_i
* ``trimmed_mean``:  coordinate-wise mean after dropping the ``trim`` fraction
  of largest and smallest values at every coordinate

Outer step (DiLoCo, Douillard et al. 2023): with the outer gradient
g = -Delta_bar,

* ``average``:   step = eta * Delta_bar (eta = 1: plain averaging)
* ``nesterov``:  m <- mu m + g;  step = -eta (g + mu m)

The published step is rounded to bfloat16, and both coordinator and workers
compute W_{v+1} = W_v + float32(step_bf16)
(:func:`blocktrain.protocol.weights.apply_step`), so they hold bit-identical
weights while the pull costs half the block's fp32 size. The choices
(:class:`.settings.Aggregation`, :class:`.settings.OuterOptimizer`) are settings.
"""

from __future__ import annotations

import torch

from blocktrain.coordinator.settings import Aggregation, OuterOptimizer


def aggregate(
    deltas: list[dict[str, torch.Tensor]],
    samples: list[int],
    method: Aggregation,
    trim: float = 0.2,
) -> dict[str, torch.Tensor]:
    """Combine same-version deltas into Delta_bar (float32)."""
    if not deltas:
        raise ValueError("aggregate() needs at least one delta")
    names = list(deltas[0])
    out: dict[str, torch.Tensor] = {}
    if method is Aggregation.MEAN:
        w = torch.tensor(samples, dtype=torch.float64)
        w = w / w.sum()
        for n in names:
            acc = torch.zeros_like(deltas[0][n], dtype=torch.float64)
            for wi, d in zip(w.tolist(), deltas, strict=True):
                acc += wi * d[n].double()
            out[n] = acc.float()
        return out
    for n in names:
        stacked = torch.stack([d[n].float() for d in deltas])  # (m, ...)
        if method is Aggregation.MEDIAN:
            out[n] = stacked.median(dim=0).values if len(deltas) % 2 else _even_median(stacked)
        else:
            m = stacked.shape[0]
            cut = int(trim * m)
            if 2 * cut >= m:
                cut = (m - 1) // 2
            srt = stacked.sort(dim=0).values
            out[n] = srt[cut : m - cut].mean(dim=0)
    return out


def _even_median(stacked: torch.Tensor) -> torch.Tensor:
    srt = stacked.sort(dim=0).values
    m = srt.shape[0]
    return 0.5 * (srt[m // 2 - 1] + srt[m // 2])


def outer_step(
    delta_bar: dict[str, torch.Tensor],
    method: OuterOptimizer,
    lr: float,
    momentum: float,
    buf: dict[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Return (bf16 step to publish, new momentum buffer)."""
    if method is OuterOptimizer.AVERAGE:
        return {n: (lr * d).to(torch.bfloat16) for n, d in delta_bar.items()}, None
    new_buf: dict[str, torch.Tensor] = {}
    step: dict[str, torch.Tensor] = {}
    for n, d in delta_bar.items():
        g = -d
        m = g.clone() if buf is None else momentum * buf[n] + g
        new_buf[n] = m
        step[n] = (-lr * (g + momentum * m)).to(torch.bfloat16)
    return step, new_buf

