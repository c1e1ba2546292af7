"""Aggregation of one round's deltas and the outer step.

Given deltas Delta_i with sample counts n_i (all against version v):

* ``mean``:          Delta_bar = sum_i n_i Delta_i / sum_i n_i
* ``median``:        coordinate-wise median of the Delta_i
* ``trimmed_mean``:  coordinate-wise mean after dropping the ``trim`` fraction
  of largest and smallest values at every coordinate
* ``agree_mean``:    the mean, shrunk where the workers disagree on the sign:
  Delta_bar_j * |sum_i n_i sign(Delta_ij)| / sum_i n_i (per-coordinate sign agreement in [0, 1])

Outer step (DiLoCo, Douillard et al. 2023): with the outer gradient
g = -Delta_bar,

* ``average``:   step = eta * Delta_bar (eta = 1: plain averaging)
* ``nesterov``:  m <- mu m + g;  step = -eta (g + mu m)

The published step is encoded like a delta (:mod:`blocktrain.protocol.delta`:
int8 by default, with the coordinator's own error feedback), and both
coordinator and workers compute W_{v+1} = W_v + decode(step)
(:func:`blocktrain.protocol.weights.apply_step`), so they hold bit-identical
weights while the pull costs a quarter of the block's fp32 size. The choices
(:class:`.settings.Aggregation`, :class:`.settings.OuterOptimizer`, the step's
encoding) are settings. :func:`next_version` is one whole round close, pure: the
coordinator and its in-process reference (:mod:`.simulate`) both call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blocktrain.coordinator.settings import Aggregation, CoordinatorSettings, OuterOptimizer
from blocktrain.protocol.delta import Compression, ErrorFeedback, decode_delta
from blocktrain.protocol.weights import apply_step

MOMENTUM_PREFIX = "momentum/"  # durable outer state: momentum buffer tensor names
RESIDUAL_PREFIX = "residual/"  # durable outer state: the step encoder's error-feedback residual


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
    if method in (Aggregation.MEAN, Aggregation.AGREE_MEAN):
        w = torch.tensor(samples, dtype=torch.float64, device=deltas[0][names[0]].device)
        w = w / w.sum()
        for n in names:
            acc = torch.zeros_like(deltas[0][n], dtype=torch.float64)
            votes = torch.zeros_like(acc)
            for wi, d in zip(w.tolist(), deltas, strict=True):
                acc += wi * d[n].double()
                if method is Aggregation.AGREE_MEAN:
                    votes += wi * d[n].sign().double()
            out[n] = (acc * votes.abs() if method is Aggregation.AGREE_MEAN else acc).float()
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


def agreeing(deltas: list[dict[str, torch.Tensor]], min_cos: float) -> list[int]:
    """Indices i whose cos(Delta_i, med) >= ``min_cos``, med the coordinate-wise median of the round's deltas: an update
    that points away from what the round's majority agrees on (a sign flip, a pull toward zero, noise) is dropped.
    All of them when fewer than 3, or when none would pass (the round never publishes nothing)."""
    if len(deltas) < 3:
        return list(range(len(deltas)))
    flat = torch.stack([torch.cat([d[n].reshape(-1).float() for n in sorted(d)]) for d in deltas])  # (m, params)
    med = flat.median(dim=0).values if len(deltas) % 2 else _even_median(flat)  # (params,)
    cos = torch.nn.functional.cosine_similarity(flat.double(), med.double()[None], dim=1, eps=1e-30)  # (m,)
    keep = [i for i, c in enumerate(cos.tolist()) if c >= min_cos]
    return keep or list(range(len(deltas)))


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
    """Return (float32 step, new momentum buffer): DiLoCo's outer step (Douillard et al. 2023, Alg. 1)."""
    if method is OuterOptimizer.AVERAGE:
        return {n: lr * d for n, d in delta_bar.items()}, None
    new_buf: dict[str, torch.Tensor] = {}
    step: dict[str, torch.Tensor] = {}
    for n, d in delta_bar.items():
        g = -d
        m = g.clone() if buf is None else momentum * buf[n] + g
        new_buf[n] = m
        step[n] = -lr * (g + momentum * m)
    return step, new_buf


@dataclass
class OuterState:
    """What the outer step carries from one round of a block to the next (persisted with each version)."""

    momentum: dict[str, torch.Tensor] | None = None  # Nesterov buffer m (None: none yet, or plain averaging)
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # the step encoder's error-feedback residual

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat, prefixed tensors for a safetensors blob (empty: nothing to persist)."""
        out = {MOMENTUM_PREFIX + n: t for n, t in (self.momentum or {}).items()}
        out.update({RESIDUAL_PREFIX + n: t for n, t in self.residual.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> OuterState:
        """Inverse of :meth:`tensors`; a blob of unprefixed names is a momentum buffer (format before residuals)."""
        if not any(n.startswith((MOMENTUM_PREFIX, RESIDUAL_PREFIX)) for n in tensors):
            return cls(momentum=dict(tensors) or None)
        m = {n[len(MOMENTUM_PREFIX):]: t for n, t in tensors.items() if n.startswith(MOMENTUM_PREFIX)}
        r = {n[len(RESIDUAL_PREFIX):]: t for n, t in tensors.items() if n.startswith(RESIDUAL_PREFIX)}
        return cls(momentum=m or None, residual=r)


@dataclass(frozen=True)
class RoundResult:
    weights: dict[str, torch.Tensor]  # W_{v+1}
    step: dict[str, torch.Tensor]  # the encoded step as published (wire tensors)
    state: OuterState  # carried to the next round
    kept: tuple[int, ...]  # indices of the deltas the aggregate used (the others disagreed: settings.agree_min)


def next_version(
    weights: dict[str, torch.Tensor],
    deltas: list[dict[str, torch.Tensor]],
    samples: list[int],
    settings: CoordinatorSettings,
    state: OuterState,
) -> RoundResult:
    """Close one round: screen (``agree_min``), aggregate, outer step, encode the step with error feedback, apply it.

    W_{v+1} = W_v + decode(encode(step + e)); the workers apply the same decoded step.
    """
    if settings.outer is None:
        raise ValueError("no outer step chosen; resolve it with CoordinatorSettings.for_objective(objective.outer_step())")
    kept = agreeing(deltas, settings.agree_min) if settings.agree_min is not None else list(range(len(deltas)))
    delta_bar = aggregate([deltas[i] for i in kept], [samples[i] for i in kept], settings.aggregation, settings.trim_fraction)
    step, buf = outer_step(delta_bar, settings.outer, settings.eta(settings.outer), settings.outer_momentum,
                           state.momentum)
    codec = ErrorFeedback(settings.step_compression, state.residual)
    wire = codec.encode(step)
    new = apply_step(weights, decode_delta(wire, settings.step_compression))
    lossless = settings.step_compression is Compression.NONE
    return RoundResult(new, wire, OuterState(buf, {} if lossless else codec.residual), tuple(kept))

