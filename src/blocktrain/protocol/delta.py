"""A worker's delta on the wire: encodings, exact tensor schema and the pushed payload.

A delta is ``Delta = W_local - W_v`` against the published version v, encoded as

* ``none``: float32 tensors, one per parameter;
* ``bf16``: bfloat16 tensors (half the bytes);
* ``int8``: int8 tensors q with a float32 scalar ``NAME@scale`` s each,
  Delta ~= s * q with s = max|Delta| / 127 (the default: a quarter of the bytes).

A lossy encoding carries *error feedback* (:class:`ErrorFeedback`; Seide et al.
2014, Karimireddy et al. 2019, "EF-SGD" eq. 4): the sender keeps the residual
e_t = (Delta_t + e_{t-1}) - decode(encode(Delta_t + e_{t-1})) and adds it to its
next update, so nothing the quantiser drops is lost, only delayed. The same codec
and feedback encode the coordinator's published outer step.

Only trainable parameters travel (:func:`blocktrain.protocol.weights.block_schema`).
Everything is a safetensors payload made by :func:`blocktrain.checkpoint.pack`
(never pickle); the metadata names the block, base version, sample count and
encoding.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from blocktrain.checkpoint.safetensors_io import pack
from blocktrain.protocol.group import GroupMember, encode_group
from blocktrain.protocol.messages import UpdateMeta
from blocktrain.protocol.moments import FLOAT32_TINY, SCALE_SUFFIX, MomentCodec, encode_moments, int8_scale  # SCALE_SUFFIX: int8 scales


class Compression(enum.Enum):
    """Encoding of a delta on the wire."""

    NONE = "none"  # float32
    BF16 = "bf16"  # bfloat16, half the bytes
    INT8 = "int8"  # int8 + one float32 scale per tensor, a quarter of the bytes


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # exact shape
    dtype: torch.dtype  # exact dtype on the wire


def wire_schema(shapes: dict[str, tuple[int, ...]], compression: Compression) -> dict[str, TensorSpec]:
    """The exact tensors a delta with ``compression`` must contain."""
    if compression is Compression.NONE:
        return {n: TensorSpec(s, torch.float32) for n, s in shapes.items()}
    if compression is Compression.BF16:
        return {n: TensorSpec(s, torch.bfloat16) for n, s in shapes.items()}
    out: dict[str, TensorSpec] = {}
    for n, s in shapes.items():
        out[n] = TensorSpec(s, torch.int8)
        out[n + SCALE_SUFFIX] = TensorSpec((), torch.float32)
    return out


def encode_delta(delta: dict[str, torch.Tensor], compression: Compression) -> dict[str, torch.Tensor]:
    if compression is Compression.NONE:
        return {n: d.float().contiguous() for n, d in delta.items()}
    if compression is Compression.BF16:
        return {n: d.to(torch.bfloat16).contiguous() for n, d in delta.items()}
    out: dict[str, torch.Tensor] = {}
    for n, d in delta.items():
        amax = float(d.abs().max()) if d.numel() else 0.0
        s = int8_scale(amax)
        out[n] = torch.clamp(torch.round(d.float() / s), -127, 127).to(torch.int8)
        out[n + SCALE_SUFFIX] = torch.tensor(s, dtype=torch.float32, device=d.device)
    return out


def decode_delta(tensors: dict[str, torch.Tensor], compression: Compression) -> dict[str, torch.Tensor]:
    """Wire tensors -> float32 delta per parameter."""
    if compression is not Compression.INT8:
        return {n: t.float() for n, t in tensors.items()}
    return {
        n: t.float() * tensors[n + SCALE_SUFFIX].float()
        for n, t in tensors.items()
        if not n.endswith(SCALE_SUFFIX)
    }


class ErrorFeedback:
    """The sender's quantisation residual e, carried from one encoded update to the next.

    ``encode(Delta)`` sends q = encode(Delta + e) and keeps e <- (Delta + e) - decode(q)
    exactly (float32). ``reset()`` drops e, e.g. when the sender moves to another block.
    Durable senders persist :attr:`residual` with their other state.
    """

    def __init__(self, compression: Compression, residual: dict[str, torch.Tensor] | None = None) -> None:
        self.compression = compression
        self.residual: dict[str, torch.Tensor] = dict(residual or {})

    def encode(self, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Wire tensors for ``delta`` plus the carried residual; updates the residual."""
        corrected = {n: d.float() + self.residual[n] if n in self.residual else d.float() for n, d in delta.items()}
        wire = encode_delta(corrected, self.compression)
        sent = decode_delta(wire, self.compression)
        self.residual = {n: (corrected[n] - sent[n]).contiguous() for n in corrected}
        return wire

    def reset(self) -> None:
        self.residual = {}


BF16_HALF_ULP = 2.0**-8  # bfloat16 rounds to 8 significant bits: |x - bf16(x)| <= 2^-8 |x| (normal numbers)
BF16_SUBNORMAL_ULP = 2.0**-133  # below 2^-126 bfloat16's steps are this wide, whatever |x|
BOUND_SLACK = 1.001  # float32 rounding of the encoder's own arithmetic (x / s rounded, then subtracted)


Sent = tuple[dict[str, torch.Tensor], Compression]  # a push as decoded, and the encoding it was sent in


def residual_within(residual: dict[str, torch.Tensor], pushes: Sequence[Sent]) -> str | None:
    """None if ``residual`` is what :class:`ErrorFeedback` may hold after one of ``pushes`` (the sender's last ones,
    newest first: an answer lost on the way back leaves the sender one push behind what the receiver recorded),
    else the first tensor that exceeds them all (:func:`residual_excess`)."""
    first = residual_excess(residual, None, None)
    if first is None:
        return None
    for previous, compression in pushes:
        if residual_excess(residual, previous, compression) is None:
            return None
    return first


def residual_excess(residual: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None,
                    compression: Compression | None) -> str | None:
    """The first tensor of ``residual`` that :class:`ErrorFeedback` cannot hold after the sender's previous push
    (``previous``, that push decoded, with its ``compression``; None: it pushed nothing before, so e = 0), or None.

    e = c - decode(encode(c)) for the corrected update c of that push, elementwise:

    * ``int8``:  |e_i| <= s / 2, s = max(max|previous| / 127, tiny) (its scale: the largest element decodes to
      +-127 s, unless s was floored at the least normal float32, :func:`~.moments.int8_scale`);
    * ``bf16``:  |e_i| <= 2^-8 |c_i| <= 2^-8 |previous_i| / (1 - 2^-8) (half a unit in the last place);
    * ``none``:  e = 0 (float32 is what it sends).

    A residual is a claim of the worker's: an audit replays decode(encode(Delta + e)), so an unbounded e would let
    any push replay (e = push - Delta)."""
    for n, e in residual.items():
        if not bool(e.any()):
            continue
        prev = None if previous is None else previous.get(n)
        if prev is None or prev.shape != e.shape or compression is None or compression is Compression.NONE:
            return n
        if compression is Compression.INT8:
            # s never below the least normal float32 (int8_scale): a tensor of values all under 127 x tiny had
            # s = tiny > max|previous| / 127, and an honest residual failed its audit
            bound = torch.clamp(prev.abs().max() / 127.0, min=FLOAT32_TINY) / 2.0 * BOUND_SLACK  # () broadcast
        else:
            bound = prev.abs() * (BF16_HALF_ULP / (1.0 - BF16_HALF_ULP) * BOUND_SLACK) + BF16_SUBNORMAL_ULP  # prev's shape
        if bool((e.abs() > bound).any()):
            return n
    return None


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite: one read of the device for them all (a delta that trained to NaN
    or inf is pushed nowhere; int8 cannot encode it: :func:`~blocktrain.protocol.moments.int8_scale`)."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return not flags or bool(torch.stack(flags).all())


def delta_norm(delta: dict[str, torch.Tensor]) -> float:
    """Global L2 norm ||Delta||_2 over all tensors."""
    return math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))


def pack_delta(
    delta: dict[str, torch.Tensor],
    compression: Compression,
    *,
    block: int,
    base_version: int,
    base_sha: str,
    samples: int,
    feedback: ErrorFeedback | None = None,
    group: list[GroupMember] | None = None,
    state_sha: str | None = None,
    precision: str = "fp32",
    moments: dict[str, torch.Tensor] | None = None,
    moment_codec: MomentCodec | None = None,
) -> bytes:
    """A worker's update as safetensors bytes (with ``feedback``: plus its carried residual, which it updates).

    ``base_version`` and ``base_sha``: the published version and the sha256 of its weights the delta was trained
    from (the work answer's). ``group``: the delta is the sample-weighted mean of these members' deltas
    (:mod:`.group`), ``samples`` their sum. ``state_sha``: the digest of the sender's inner state at the round's
    start (:mod:`.inner_state`), which it uploads if the coordinator audits the push; ``precision`` the arithmetic it
    trained in ("fp32" or "bf16"), which the audit replays. ``moments``: the inner moment estimates shared with the
    delta (:mod:`.moments`, names ``m/NAME`` and ``v/NAME``), encoded with ``moment_codec``, in the same payload.
    """
    if group and sum(m.samples for m in group) != samples:
        raise ValueError("a group upload's samples must be the sum of its members'")
    meta = UpdateMeta(block_index=block, base_version=base_version, base_sha=base_sha, samples=samples,
                      compression=compression.value, group=encode_group(group) if group else None,
                      state_sha=state_sha, precision=precision,
                      moments=moment_codec.value if moments is not None and moment_codec is not None else None)
    if moments is not None and moment_codec is None:
        raise ValueError("pushed moments need their moment_codec")
    if feedback is not None and feedback.compression is not compression:
        raise ValueError(f"error feedback for {feedback.compression.value} cannot encode {compression.value}")
    wire = feedback.encode(delta) if feedback is not None else encode_delta(delta, compression)
    if moments is not None and moment_codec is not None:
        wire.update(encode_moments(moments, moment_codec))
    return pack(wire, meta.to_meta())
