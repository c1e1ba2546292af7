"""Validation of an untrusted update body, before it may count.

Order of checks (each failure is a :class:`ProtocolError` with its status):

1. the body is a safetensors file at all (else 415);
2. it parses and its sha256 matches (else 400: truncated or corrupt);
3. its metadata names a known encoding, this block and a positive sample count (422);
4. exact tensor names, shapes and dtypes for that encoding (422);
5. every value is finite (422).

Checks that need the coordinator's state (version, norm against the round's
median, the loss gate) live in :mod:`blocktrain.coordinator.service`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.protocol.delta import Compression, decode_delta, delta_norm, wire_schema
from blocktrain.protocol.group import GroupMember, decode_group

MAX_SAMPLES = 1 << 30  # an update claiming more samples than this is rejected


@dataclass(frozen=True)
class ParsedUpdate:
    block: int  # block index the update is for
    base_version: int  # version v the delta is against
    samples: int  # training sequences behind the delta (aggregation weight)
    compression: Compression  # wire encoding
    delta: dict[str, torch.Tensor]  # decoded float32 delta per parameter
    norm: float  # ||Delta||_2
    group: tuple[GroupMember, ...] = ()  # members whose sample-weighted mean this is (empty: one worker's delta)


def _looks_like_safetensors(body: bytes) -> bool:
    if len(body) < 10:
        return False
    n = int.from_bytes(body[:8], "little")
    if n <= 0 or n > 100 * 2**20:
        return False
    head = body[8 : 8 + min(n, 1)]
    return head == b"{"


def _int_field(meta: dict[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        raise ProtocolError(
            422, f"update metadata field {key!r} is missing or not an integer; send it with pack_delta()", "metadata"
        ) from None


def parse_update(body: bytes, block: int, shapes: dict[str, tuple[int, ...]]) -> ParsedUpdate:
    """Parse and validate ``body`` as a delta for ``block`` with trainable ``shapes``."""
    if not _looks_like_safetensors(body):
        raise ProtocolError(
            415,
            "the body is not a safetensors file; updates must be safetensors (pickle and other formats are refused)",
            "not_safetensors",
        )
    try:
        tensors, meta = unpack(body, source="update")
    except CheckpointError as exc:
        raise ProtocolError(400, f"the update could not be read: {exc}; resend the whole body", "corrupt") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:  # pragma: no cover - unpack wraps these
        raise ProtocolError(400, f"the update could not be read: {exc}", "corrupt") from None
    if meta.get("kind") != "delta":
        raise ProtocolError(422, f"metadata kind is {meta.get('kind')!r}, expected 'delta'", "metadata")
    try:
        compression = Compression(meta.get("compression", ""))
    except ValueError:
        choices = ", ".join(c.value for c in Compression)
        raise ProtocolError(
            422, f"unknown compression {meta.get('compression')!r}; use one of {choices}", "metadata"
        ) from None
    k = _int_field(meta, "block_index")
    if k != block:
        raise ProtocolError(422, f"the update is for block {k} but was sent to block {block}'s endpoint", "metadata")
    base_version = _int_field(meta, "base_version")
    samples = _int_field(meta, "samples")
    if not 0 < samples <= MAX_SAMPLES:
        raise ProtocolError(422, f"samples={samples} must be in 1..{MAX_SAMPLES}", "metadata")
    group: tuple[GroupMember, ...] = ()
    if "group" in meta:
        try:
            group = decode_group(meta["group"])
        except ValueError as exc:
            raise ProtocolError(422, f"malformed group upload: {exc}", "group") from None
        if sum(m.samples for m in group) != samples:
            raise ProtocolError(422, f"samples={samples} is not the sum of the group members' samples", "group")
    schema = wire_schema(shapes, compression)
    missing = sorted(set(schema) - set(tensors))
    extra = sorted(set(tensors) - set(schema))
    if missing or extra:
        raise ProtocolError(
            422,
            f"tensor names do not match block {block}: missing {missing[:5]}, unexpected {extra[:5]}; "
            "the worker must use the coordinator's preset",
            "schema",
        )
    for name, spec in schema.items():
        t = tensors[name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ProtocolError(
                422,
                f"tensor {name!r} is {t.dtype} {list(t.shape)}, expected {spec.dtype} {list(spec.shape)}",
                "schema",
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ProtocolError(
                422, f"tensor {name!r} holds NaN or infinite values; the update is discarded", "non_finite"
            )
    delta = decode_delta(tensors, compression)
    norm = delta_norm(delta)
    if not norm < float("inf"):
        raise ProtocolError(422, "the update's norm overflows float32; the update is discarded", "non_finite")
    return ParsedUpdate(
        block=k, base_version=base_version, samples=samples, compression=compression, delta=delta, norm=norm,
        group=group,
    )
