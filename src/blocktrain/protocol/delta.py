"""A worker's delta on the wire: encodings, exact tensor schema and the pushed payload.

A delta is ``Delta = W_local - W_v`` against the published version v, encoded as

* ``none``: float32 tensors, one per parameter;
* ``bf16``: bfloat16 tensors (half the bytes; the default);
* ``int8``: int8 tensors q with a float32 scalar ``NAME@scale`` s each,
  Delta ~= s * q with s = max|Delta| / 127.

Only trainable parameters travel (:func:`blocktrain.protocol.weights.block_schema`).
Everything is a safetensors payload made by :func:`blocktrain.checkpoint.pack`
(never pickle); the metadata names the block, base version, sample count and
encoding.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from blocktrain.checkpoint.safetensors_io import pack

SCALE_SUFFIX = "@scale"  # int8 encoding: per-tensor scale tensor name suffix


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
        s = amax / 127.0 if amax > 0 else 1.0
        out[n] = torch.clamp(torch.round(d.float() / s), -127, 127).to(torch.int8)
        out[n + SCALE_SUFFIX] = torch.tensor(s, dtype=torch.float32)
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


def delta_norm(delta: dict[str, torch.Tensor]) -> float:
    """Global L2 norm ||Delta||_2 over all tensors."""
    return math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))


def pack_delta(
    delta: dict[str, torch.Tensor],
    compression: Compression,
    *,
    block: int,
    base_version: int,
    samples: int,
) -> bytes:
    """A worker's update as safetensors bytes."""
    meta = {
        "kind": "delta",
        "block_index": str(block),
        "base_version": str(base_version),
        "samples": str(samples),
        "compression": compression.value,
    }
    return pack(encode_delta(delta, compression), meta)
