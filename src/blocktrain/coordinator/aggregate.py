"""Aggregation of one round's deltas and the outer step.

Given deltas Delta_i with sample counts n_i (all against version v):

* ``mean``:          Delta_bar = sum_i n_i Delta_i / sum_i n_i
* ``median``:        coordinate-wise median of the Delta_i, weighted by n_i (the smallest value whose sorted
  cumulative weight reaches half the total; the mean of it and the next where it meets half exactly): with equal
  n_i the plain median, and a push claiming few samples (a round cut at its deadline, or a lazy one) a small vote
* ``trimmed_mean``:  coordinate-wise mean after dropping the ``trim`` fraction
  of largest and smallest values at every coordinate
* ``agree_mean``:    the mean, shrunk where the workers disagree on the sign:
  Delta_bar_j * |sum_i n_i sign(Delta_ij)| / sum_i n_i (per-coordinate sign agreement in [0, 1])

Outer step (DiLoCo, Douillard et al. 2023): with the outer gradient
g = -Delta_bar,

* ``average``:   step = eta * Delta_bar (eta = 1: plain averaging)
* ``nesterov``:  m <- mu m + g;  step = -eta (g + mu m)
* ``adam``:      FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2):
                 m <- beta1 m + (1 - beta1) Delta_bar;  u <- beta2 u + (1 - beta2) Delta_bar^2;
                 step = eta s_v m / (sqrt(u) + tau)   (beta1 = mu, beta2 = ``outer_beta2``, tau = ``outer_eps``; s_v the
                 round's mean inner lr over the peak, so the outer step decays with the inner schedule, as the
                 deltas the other steps scale do)

With ``outer_cap`` c, a step longer than c ||Delta_bar|| is scaled down to it (an outer step that cannot amplify
the round's mean delta more than c-fold).

Shared inner moments (:mod:`blocktrain.train.inner`, issue 43): with the workers' pushed estimates v_i (and m_i),
the round publishes v_bar = hold(aggregate(clip(v_i))): every v_i is clipped coordinate-wise around the round's
coordinate-wise median and its tensor's typical scale (:func:`shared_moments`), aggregated like the deltas, then
held within a factor ``moment_step`` of the previously published v_bar; m_bar is aggregated like the deltas
and clipped into [-sqrt(v_bar), sqrt(v_bar)] (Adam's normalised step m / sqrt(v) stays within one lr). So no worker,
however hostile, moves the shared v to zero or infinity. With ``moment_mean_v`` (m shared too), the published v is
that of the M workers' mean gradient rather than of one worker's: v = E[g^2] = mu^2 + sigma^2 for one worker's batch,
mu^2 + sigma^2 / M for their mean, so v_M = m_bar^2 + (v_bar - m_bar^2) / M (m_bar^2 estimates mu^2; clamped to
[m_bar^2, v_bar]): the step one machine at M times the batch would take. The hold then compares v_M with the
previously published v_M (the same units), and m_bar is clipped again into +-sqrt(v_M).

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
from blocktrain.protocol.moments import M_PREFIX, V_PREFIX, decode_moments, encode_moments
from blocktrain.protocol.weights import apply_step
from blocktrain.train.step import ADAMW_BETAS

MOMENTUM_PREFIX = "momentum/"  # durable outer state: momentum buffer tensor names
RESIDUAL_PREFIX = "residual/"  # durable outer state: the step encoder's error-feedback residual
SECOND_PREFIX = "second/"  # durable outer state: outer Adam's second moment u
SHARED_PREFIX = "shared/"  # durable outer state: the published inner moments (m/NAME, v/NAME), as decoded


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
            if len(set(samples)) > 1:
                out[n] = _weighted_median(stacked, samples)
            else:
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


def _weighted_median(stacked: torch.Tensor, samples: list[int]) -> torch.Tensor:
    """Coordinate-wise median of ``stacked`` (m, ...) under integer weights ``samples`` (module docstring); with
    equal weights it is :func:`_even_median` for even m and the middle value for odd m, exactly."""
    srt, order = stacked.sort(dim=0)  # (m, ...) each
    w = torch.tensor(samples, dtype=torch.int64, device=stacked.device)[order]  # (m, ...): the weight of each value
    cum = w.cumsum(dim=0)  # (m, ...), int64: a claim is bounded by its round's budget, which is not bounded here
    twice, total = 2 * cum, cum[-1:]  # twice the cumulative weight against the total (1, ...): half, in integers
    first = (twice >= total).int().argmax(dim=0, keepdim=True)  # (1, ...): the first reaching half
    at = srt.gather(0, first)  # (1, ...)
    exact = twice.gather(0, first) == total  # half met exactly: average with the next value
    nxt = srt.gather(0, (first + 1).clamp(max=srt.shape[0] - 1))
    return torch.where(exact, 0.5 * (at + nxt), at)[0]


def _even_median(stacked: torch.Tensor) -> torch.Tensor:
    srt = stacked.sort(dim=0).values
    m = srt.shape[0]
    return 0.5 * (srt[m // 2 - 1] + srt[m // 2])


def outer_step(
    delta_bar: dict[str, torch.Tensor],
    settings: CoordinatorSettings,
    buf: dict[str, torch.Tensor] | None,
    second: dict[str, torch.Tensor] | None = None,
    lr_scale: float = 1.0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """Return (float32 step, new momentum buffer, new second moment): the outer step of the module docstring."""
    method = settings.outer
    if method is None:
        raise ValueError("no outer step chosen; resolve it with CoordinatorSettings.for_objective(objective.outer_step())")
    lr, mu = settings.eta(method), settings.outer_momentum
    new_buf: dict[str, torch.Tensor] | None = None
    new_second: dict[str, torch.Tensor] | None = None
    if method is OuterOptimizer.AVERAGE:
        step = {n: lr * d for n, d in delta_bar.items()}
    elif method is OuterOptimizer.NESTEROV:
        new_buf, step = {}, {}
        for n, d in delta_bar.items():
            g = -d
            m = g.clone() if buf is None else mu * buf[n] + g
            new_buf[n] = m
            step[n] = -lr * (g + mu * m)
    else:  # FedAdam on the pseudo-gradient's negative, Delta_bar
        new_buf, new_second, step = {}, {}, {}
        b2, tau = settings.outer_beta2, settings.outer_eps
        for n, d in delta_bar.items():
            m = (1 - mu) * d if buf is None else mu * buf[n] + (1 - mu) * d
            u = (1 - b2) * d * d if second is None else b2 * second[n] + (1 - b2) * d * d
            new_buf[n], new_second[n] = m, u
            step[n] = lr * lr_scale * m / (u.sqrt() + tau)
    if settings.outer_cap is not None:
        bound = settings.outer_cap * _norm(delta_bar)
        length = _norm(step)
        if length > bound > 0:
            step = {n: t * (bound / length) for n, t in step.items()}
    return step, new_buf, new_second


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double().pow(2).sum() for t in tensors.values()), torch.zeros((), dtype=torch.float64))))


def shared_moments(
    moments: list[dict[str, torch.Tensor]],
    samples: list[int],
    settings: CoordinatorSettings,
    previous: dict[str, torch.Tensor] | None,
    workers: int | None = None,
    carried: float = 0.0,
) -> dict[str, torch.Tensor]:
    """The published inner moments of a round from the workers' pushed estimates (module docstring).

    With c = ``moment_clip``, med the coordinate-wise median of the round's v_i and s the median over the workers of
    each v tensor's mean (its typical scale), every v_i is clipped into [med / c, c max(med, s)] (a coordinate most
    workers never touched, a rare byte's embedding row, keeps its honest values) and aggregated like the deltas;
    m is aggregated like the deltas and clipped by sqrt(v); with ``moment_mean_v``, v becomes the mean gradient's
    (module docstring). Then v is held within [prev / step, prev x step] of the previously published v (step =
    ``moment_step``; c s where prev is 0: a coordinate no round has published yet), and m clipped by sqrt(v) again.
    ``workers``: M, the workers whose moments these are (a group mean counts its members; None: one per push);
    ``carried``: d, the share of each pushed v that is ``previous``'s v (:func:`carried_share`; 0: none)."""
    names = list(moments[0])
    vs = [n for n in names if n.startswith(V_PREFIX)]
    clipped: list[dict[str, torch.Tensor]] = [dict(x) for x in moments]
    c = settings.moment_clip
    scale: dict[str, torch.Tensor] = {}
    for n in vs:
        stacked = torch.stack([x[n].float() for x in moments])  # (workers, *shape)
        med = stacked.median(dim=0).values if len(moments) % 2 else _even_median(stacked)
        means = stacked.reshape(len(moments), -1).mean(dim=1)  # (workers,) each one's tensor mean
        scale[n] = means.median() if len(moments) % 2 else _even_median(means[:, None])[0]
        for x in clipped:
            x[n] = torch.minimum(torch.maximum(x[n].float(), med / c), c * torch.maximum(med, scale[n]))
    out = aggregate(clipped, samples, settings.aggregation, settings.trim_fraction)
    pairs = {n: V_PREFIX + n[len(M_PREFIX):] for n in names
             if n.startswith(M_PREFIX) and V_PREFIX + n[len(M_PREFIX):] in out}  # m name -> its v's
    for n in vs:
        out[n] = out[n].clamp_min(0.0)
    for n, v in pairs.items():
        _clip_m(out, n, v)
        if settings.moment_mean_v:
            out[v] = _mean_gradient_v(out[v], out[n].square(), workers or len(moments),
                                      None if previous is None else previous.get(v), carried)
    for n in vs:  # held against the previous published v, in the same units: after the conversion (held before it,
        # the workers' v, about M times the mean gradient's, was capped at moment_step x the published one, and
        # the published v shrank every round past M = moment_step workers, down to m^2)
        if previous is not None and n in previous:
            prev = previous[n].to(out[n].device)
            hi = torch.where(prev > 0, prev * settings.moment_step, c * scale[n])  # a coordinate never published: s
            out[n] = torch.minimum(torch.maximum(out[n], prev / settings.moment_step), hi)
    for n, v in pairs.items():  # the hold may have lowered v below m^2
        _clip_m(out, n, v)
    return out


def _mean_gradient_v(v_bar: torch.Tensor, mu2: torch.Tensor, M: int, prev: torch.Tensor | None,
                     d: float) -> torch.Tensor:
    """The v one machine at M times the batch would hold, from v_bar, the aggregate of M workers' v (module docstring).

    A worker's pushed v is d P + (1 - d) G_i, d = beta2^n after n inner steps from the published P it loaded (d = 0
    with no P: a fresh start's bias-corrected v is G_i alone), G_i its own gradients' EMA of g^2. Only G_i is one
    worker's; the M-fold batch has d P + (1 - d) G_M, G_M = mu^2 + (G - mu^2) / M. (Dividing all of v_bar - mu^2 by
    M divided the carried d P by M again every share: in a model of it, v settled 22% low at M = 4, H = 25, and
    further below its target the more of P a round kept.)"""
    if prev is None or d <= 0.0:
        return mu2 + (v_bar - mu2) / M
    kept = d * prev.to(v_bar.device)
    fresh = (v_bar - kept) / (1.0 - d)  # G, the workers' own, from the carried part
    return kept + (1.0 - d) * (mu2 + (fresh - mu2).clamp_min(0.0) / M)


def carried_share(steps: int, every: int, beta2: float = ADAMW_BETAS[1]) -> float:
    """d = beta2^n, the share of a pushed v that is the published v its worker loaded, n = ``steps`` x ``every``
    inner steps later (H steps a round, moments published every ``every`` rounds; a round cut short keeps more)."""
    return beta2 ** (max(1, steps) * every)


def _clip_m(out: dict[str, torch.Tensor], m: str, v: str) -> None:
    """Clip the published m into +-sqrt(v), in place (|m| <= sqrt(v) for any gradients' moments)."""
    bound = out[v].sqrt()
    out[m] = torch.minimum(torch.maximum(out[m], -bound), bound)


@dataclass
class OuterState:
    """What the outer step carries from one round of a block to the next (persisted with each version)."""

    momentum: dict[str, torch.Tensor] | None = None  # Nesterov buffer, or outer Adam's first moment (None: none yet)
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # the step encoder's error-feedback residual
    second: dict[str, torch.Tensor] | None = None  # outer Adam's second moment u (None: none yet, or no outer Adam)
    shared: dict[str, torch.Tensor] | None = None  # the published inner moments, as the workers decode them

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat, prefixed tensors for a safetensors blob (empty: nothing to persist)."""
        out = {MOMENTUM_PREFIX + n: t for n, t in (self.momentum or {}).items()}
        out.update({RESIDUAL_PREFIX + n: t for n, t in self.residual.items()})
        out.update({SECOND_PREFIX + n: t for n, t in (self.second or {}).items()})
        out.update({SHARED_PREFIX + n: t for n, t in (self.shared or {}).items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> OuterState:
        """Inverse of :meth:`tensors`; a blob of unprefixed names is a momentum buffer (format before residuals)."""
        prefixes = (MOMENTUM_PREFIX, RESIDUAL_PREFIX, SECOND_PREFIX, SHARED_PREFIX)
        if not any(n.startswith(prefixes) for n in tensors):
            return cls(momentum=dict(tensors) or None)

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}

        return cls(momentum=part(MOMENTUM_PREFIX) or None, residual=part(RESIDUAL_PREFIX),
                   second=part(SECOND_PREFIX) or None, shared=part(SHARED_PREFIX) or None)


@dataclass(frozen=True)
class RoundResult:
    weights: dict[str, torch.Tensor]  # W_{v+1}
    step: dict[str, torch.Tensor]  # the encoded step as published (wire tensors)
    state: OuterState  # carried to the next round
    kept: tuple[int, ...]  # indices of the deltas the aggregate used (the others disagreed: settings.agree_min)
    moments: dict[str, torch.Tensor] | None = None  # the published inner moments as encoded (None: none this round)


def next_version(
    weights: dict[str, torch.Tensor],
    deltas: list[dict[str, torch.Tensor]],
    samples: list[int],
    settings: CoordinatorSettings,
    state: OuterState,
    moments: list[dict[str, torch.Tensor]] | None = None,
    lr_scale: float = 1.0,
    members: list[int] | None = None,
    carried: float = 0.0,
) -> RoundResult:
    """Close one round: screen (``agree_min``), aggregate, outer step, encode the step with error feedback, apply it;
    with ``moments`` (the pushed inner moment estimates, one per delta), publish their bounded aggregate too.
    ``lr_scale``: s_v of the round (:func:`blocktrain.train.step.round_lr_scale`), which outer Adam's step follows;
    ``members``: how many workers each update's moments stand for (a group mean's members; None: one each);
    ``carried``: the share of each pushed v that is the previously published v (:func:`carried_share`).

    W_{v+1} = W_v + decode(encode(step + e)); the workers apply the same decoded step and load the same decoded
    moments.
    """
    if settings.outer is None:
        raise ValueError("no outer step chosen; resolve it with CoordinatorSettings.for_objective(objective.outer_step())")
    kept = agreeing(deltas, settings.agree_min) if settings.agree_min is not None else list(range(len(deltas)))
    delta_bar = aggregate([deltas[i] for i in kept], [samples[i] for i in kept], settings.aggregation, settings.trim_fraction)
    step, buf, second = outer_step(delta_bar, settings, state.momentum, state.second, lr_scale)
    codec = ErrorFeedback(settings.step_compression, state.residual)
    wire = codec.encode(step)
    new = apply_step(weights, decode_delta(wire, settings.step_compression))
    lossless = settings.step_compression is Compression.NONE
    shared, published = state.shared, None
    if moments:
        workers = sum(members[i] for i in kept) if members is not None else None
        mean = shared_moments([moments[i] for i in kept], [samples[i] for i in kept], settings, state.shared, workers,
                              carried)
        published = encode_moments(mean, settings.moment_codec)
        shared = decode_moments(published, settings.moment_codec, {n: tuple(w.shape) for n, w in weights.items()})
    return RoundResult(new, wire, OuterState(buf, {} if lossless else codec.residual, second, shared), tuple(kept),
                       published)
