"""Shared inner moments on the wire: a worker's pushed AdamW moment estimates and the coordinator's published means.

Names are :mod:`blocktrain.train.inner`'s: ``m/<param>`` (the first-moment estimate m / c1) and ``v/<param>`` (the
second-moment estimate v / c2), each of the parameter's shape. Encodings (:class:`MomentCodec`):

* ``none``: float32;
* ``bf16``: bfloat16 (half the bytes);
* ``factored``: m as ``int8``; v of a matrix (a tensor of 2 or more dimensions, its trailing ones flattened) as its
  row and column means r and c (float32, ``NAME@row`` and ``NAME@col``), decoded v_ij = r_i c_j / mean(r), the
  rank-1 factorisation of Adafactor (Shazeer & Stern 2018, sec. 3); a vector's v as ``int8``. A matrix's v costs
  rows + columns floats, not rows x columns bytes: a push of delta, m and v is about half the block's fp32 size.
* ``int8``: a quarter of the bytes. ``v`` is positive, smooth and spans decades, so it travels as
  log-scale int8 over a window of ``LOG_WINDOW`` nats below the tensor's largest value:
  q = round(254 (ln max(v, e^lo) - lo) / (hi - lo)) - 127 with hi = ln max v, lo = hi - LOG_WINDOW (or ln min v when
  the tensor spans less), carried with the float32 scalars ``NAME@lo`` and ``NAME@hi``; decoded
  v = exp(lo + (q + 127) (hi - lo) / 254), a relative error of at most LOG_WINDOW / 508 = 4.7% (sqrt(v): 2.4%).
  Values below e^lo are raised to it: they are at most e^-24 of the tensor's largest, far under AdamW's eps^2 for
  any v whose largest is below 1. ``m`` is signed: linear int8 with a scale (:mod:`.delta`'s encoding).

Every tensor a stranger sends is checked (:func:`parse_moments`): exact names and shapes, finite, v >= 0.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

import torch

from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason

M_PREFIX = "m/"  # first-moment estimates m / c1, per parameter name (blocktrain.train.inner)
V_PREFIX = "v/"  # second-moment estimates v / c2, per parameter name
LO_SUFFIX, HI_SUFFIX = "@lo", "@hi"  # log-int8 v: the window's ends, float32 scalars
ROW_SUFFIX, COL_SUFFIX = "@row", "@col"  # factored v of a matrix: its row and column means, float32
SCALE_SUFFIX = "@scale"  # int8 (a delta's, a step's and m's): a tensor's float32 scale s, x ~= s q
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the least normal float32


def int8_scale(amax: float) -> float:
    """The int8 scale s of a tensor whose largest magnitude is ``amax``: amax / 127, never below the least normal
    float32 (a tensor of subnormal values had s round to 0 in float32, and a coordinator refuses a scale <= 0), 1 for
    an all-zero tensor. A ValueError for a NaN or infinite ``amax``: int8 would send NaN as 0 at scale 1, and a
    sender's error feedback would keep the NaN."""
    if not math.isfinite(amax):
        raise ValueError(f"a tensor whose largest magnitude is {amax} cannot be int8-encoded: it holds NaN or "
                         "infinite values")
    return max(amax / 127.0, FLOAT32_TINY) if amax > 0 else 1.0


def check_int8_scale(name: str, t: torch.Tensor, reason: str) -> None:
    """A stranger's tensor ``name``: if it is an int8 scale (``NAME@scale``), it must be > 0, as every encoder's is
    (:func:`int8_scale`); else a :class:`ProtocolError` (422, ``reason``)."""
    if name.endswith(SCALE_SUFFIX) and not float(t) > 0:
        raise ProtocolError(422, f"int8 scale {name!r} must be > 0, got {float(t)}", reason)
LOG_WINDOW = 24.0  # nats: the log-int8 window below a tensor's largest second moment (e^24 ~ 2.6e10)


class InnerStart(enum.Enum):
    """What a round's inner AdamW starts from (:mod:`blocktrain.train.inner`)."""

    FRESH = "fresh"  # m = v = 0 (sign-like first steps at small H)
    CARRIED = "carried"  # the worker's own m and v
    SHARED_V = "shared_v"  # v = the published mean, m = 0 with its bias correction restarted
    SHARED_MV = "shared_mv"  # m and v the published means
    LOCAL_M = "local_m"  # v = the published mean, m the worker's own

    @property
    def shares(self) -> tuple[str, ...]:
        """The moment prefixes a worker pushes and the coordinator publishes under this start."""
        return {InnerStart.SHARED_V: (V_PREFIX,), InnerStart.LOCAL_M: (V_PREFIX,),
                InnerStart.SHARED_MV: (M_PREFIX, V_PREFIX)}.get(self, ())

    def shares_at(self, version: int, every: int) -> tuple[str, ...]:
        """The moment prefixes a push against ``version`` carries: :attr:`shares` on the rounds that share them
        (:func:`shares_moments`), else none."""
        return self.shares if shares_moments(version, every) else ()

    @property
    def keeps_own(self) -> bool:
        """Whether a worker's own state from its previous round survives into the next (what is not replaced)."""
        return self in (InnerStart.CARRIED, InnerStart.LOCAL_M)


class MomentCodec(enum.Enum):
    """Encoding of pushed and published moments."""

    NONE = "none"  # float32
    BF16 = "bf16"  # bfloat16
    INT8 = "int8"  # v log-scale int8, m linear int8 (a quarter of the bytes)
    FACTORED = "factored"  # m linear int8, a matrix's v as its row and column means (Adafactor), a vector's as int8


def shares_moments(version: int, every: int) -> bool:
    """Whether the round trained from ``version`` pushes its inner moments, so that its close publishes their mean
    with ``version + 1``: every ``every``-th round (DES-LOC's periodic moment sync, arXiv 2505.22549; 1: every round).
    Between two syncs a worker goes on from its own moments."""
    if every < 1:
        raise ValueError(f"moments are shared every >= 1 rounds, got {every}")
    return (version + 1) % every == 0


def split_moments(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An update payload's tensors as (the delta's, the inner moments' carried beside it: ``m/``, ``v/``)."""
    moments = {n: t for n, t in tensors.items() if n.startswith((M_PREFIX, V_PREFIX))}
    return {n: t for n, t in tensors.items() if n not in moments}, moments


def _is_v(name: str) -> bool:
    return name.startswith(V_PREFIX)


def _factored(name: str, shape: tuple[int, ...], codec: MomentCodec) -> bool:
    return codec is MomentCodec.FACTORED and _is_v(name) and len(shape) >= 2


def encode_moments(moments: Mapping[str, torch.Tensor], codec: MomentCodec) -> dict[str, torch.Tensor]:
    """Wire tensors for ``moments`` (``m/NAME`` and ``v/NAME``, float32)."""
    if codec is MomentCodec.FACTORED:
        factors: dict[str, torch.Tensor] = {}
        rest = {}
        for n, t in moments.items():
            if _factored(n, tuple(t.shape), codec):
                v = t.float().reshape(t.shape[0], -1)  # (*shape) -> (rows, cols)
                factors[n + ROW_SUFFIX], factors[n + COL_SUFFIX] = v.mean(dim=1).contiguous(), v.mean(dim=0).contiguous()
            else:
                rest[n] = t
        return {**factors, **encode_moments(rest, MomentCodec.INT8)}
    if codec is not MomentCodec.INT8:
        dtype = torch.bfloat16 if codec is MomentCodec.BF16 else torch.float32
        return {n: t.to(dtype).contiguous() for n, t in moments.items()}
    out: dict[str, torch.Tensor] = {}
    for n, t in moments.items():
        if not _is_v(n):
            amax = float(t.abs().max()) if t.numel() else 0.0
            s = int8_scale(amax)
            out[n] = torch.clamp(torch.round(t.float() / s), -127, 127).to(torch.int8)
            out[n + SCALE_SUFFIX] = torch.tensor(s, dtype=torch.float32, device=t.device)
            continue
        ln = t.float().clamp_min(torch.finfo(torch.float32).tiny).log()
        hi = float(ln.max()) if ln.numel() else 0.0
        lo = max(float(ln.min()) if ln.numel() else 0.0, hi - LOG_WINDOW)
        span = hi - lo if hi > lo else 1.0
        q = torch.round((ln.clamp_min(lo) - lo) * (254.0 / span)) - 127.0
        out[n] = q.clamp(-127, 127).to(torch.int8)
        out[n + LO_SUFFIX] = torch.tensor(lo, dtype=torch.float32, device=t.device)
        out[n + HI_SUFFIX] = torch.tensor(lo + span, dtype=torch.float32, device=t.device)
    return out


def decode_moments(wire: Mapping[str, torch.Tensor], codec: MomentCodec,
                   shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Wire tensors -> float32 moments per name (the inverse of :func:`encode_moments`, up to its rounding; ``shapes``
    gives a factored v its shape)."""
    if codec is MomentCodec.FACTORED:
        full = decode_moments({n: t for n, t in wire.items() if not n.endswith((ROW_SUFFIX, COL_SUFFIX))},
                              MomentCodec.INT8)
        for n, r in wire.items():
            if n.endswith(ROW_SUFFIX):
                base = n.removesuffix(ROW_SUFFIX)
                c = wire[base + COL_SUFFIX].float()
                v = r.float()[:, None] * c[None, :] / r.float().mean().clamp_min(torch.finfo(torch.float32).tiny)
                if shapes is None:
                    raise ValueError("decoding a factored second moment needs the block's shapes")
                full[base] = v.reshape(shapes[base.removeprefix(V_PREFIX)])  # (rows, cols) -> (*shape)
        return full
    if codec is not MomentCodec.INT8:
        return {n: t.float() for n, t in wire.items()}
    out: dict[str, torch.Tensor] = {}
    for n, t in wire.items():
        if n.endswith((SCALE_SUFFIX, LO_SUFFIX, HI_SUFFIX)):
            continue
        if _is_v(n):
            lo, hi = wire[n + LO_SUFFIX].float(), wire[n + HI_SUFFIX].float()
            out[n] = torch.exp(lo + (t.float() + 127.0) * ((hi - lo) / 254.0))
        else:
            out[n] = t.float() * wire[n + SCALE_SUFFIX].float()
    return out


def moment_schema(shapes: Mapping[str, tuple[int, ...]], prefixes: tuple[str, ...],
                  codec: MomentCodec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The exact (shape, dtype) of every wire tensor of the moments ``prefixes`` of a block with ``shapes``."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    dtype = {MomentCodec.NONE: torch.float32, MomentCodec.BF16: torch.bfloat16, MomentCodec.INT8: torch.int8,
             MomentCodec.FACTORED: torch.int8}[codec]
    for prefix in prefixes:
        for n, s in shapes.items():
            if _factored(prefix + n, tuple(s), codec):
                rows, cols = s[0], int(torch.Size(s[1:]).numel())
                out[prefix + n + ROW_SUFFIX], out[prefix + n + COL_SUFFIX] = ((rows,), torch.float32), ((cols,), torch.float32)
                continue
            out[prefix + n] = (tuple(s), dtype)
            if codec in (MomentCodec.INT8, MomentCodec.FACTORED):
                extra = (LO_SUFFIX, HI_SUFFIX) if prefix == V_PREFIX else (SCALE_SUFFIX,)
                out.update({prefix + n + x: ((), torch.float32) for x in extra})
    return out


def parse_moments(wire: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], prefixes: tuple[str, ...],
                  codec: MomentCodec) -> dict[str, torch.Tensor]:
    """Check a stranger's moment tensors (exact names, shapes and dtypes; finite; a window with lo <= hi) and decode
    them; every failure is a :class:`ProtocolError` (422, reason ``moments``) that names the tensor."""
    want = moment_schema(shapes, prefixes, codec)
    if set(wire) != set(want):
        missing, extra = sorted(set(want) - set(wire))[:3], sorted(set(wire) - set(want))[:3]
        raise ProtocolError(422, f"the pushed moments must be exactly {len(want)} tensors ({'/'.join(prefixes)} of every "
                            f"parameter); missing {missing}, unexpected {extra}", Reason.MOMENTS)
    for n, (shape, dtype) in want.items():
        t = wire[n]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ProtocolError(422, f"moment tensor {n!r} must be {dtype} of shape {shape}, got {t.dtype} "
                                f"{tuple(t.shape)}", Reason.MOMENTS)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ProtocolError(422, f"moment tensor {n!r} holds a non-finite value", Reason.MOMENTS)
    for n, t in wire.items():
        if n.endswith((ROW_SUFFIX, COL_SUFFIX)) and not bool((t >= 0).all()):
            raise ProtocolError(422, f"factored second moment {n!r} must be >= 0", Reason.MOMENTS)
        check_int8_scale(n, t, Reason.MOMENTS)
    out = decode_moments(wire, codec, shapes)
    for n, t in out.items():
        if not bool(torch.isfinite(t).all()):  # finite parts may decode to inf (an int8 step times a scale of 3e38)
            raise ProtocolError(422, f"moment {n!r} decodes to a non-finite value", Reason.MOMENTS)
        if _is_v(n) and not bool((t >= 0).all()):
            raise ProtocolError(422, f"second moment {n!r} must be >= 0", Reason.MOMENTS)
        if n + LO_SUFFIX in wire and float(wire[n + LO_SUFFIX]) > float(wire[n + HI_SUFFIX]):
            raise ProtocolError(422, f"second moment {n!r}: its window's lo is above its hi", Reason.MOMENTS)
    return out


def moment_bytes_ratio(codec: MomentCodec) -> float:
    """Bytes per value of a moment on the wire over float32's (tensor payloads only)."""
    return {MomentCodec.NONE: 1.0, MomentCodec.BF16: 0.5, MomentCodec.INT8: 0.25, MomentCodec.FACTORED: 0.25}[codec]


def max_error(codec: MomentCodec) -> float:
    """The largest relative error the encoding puts on a second moment within its window."""
    return {MomentCodec.NONE: 0.0, MomentCodec.BF16: 2.0**-8, MomentCodec.INT8: math.expm1(LOG_WINDOW / 508),
            MomentCodec.FACTORED: math.expm1(LOG_WINDOW / 508)}[codec]  # factored: of a vector's v
