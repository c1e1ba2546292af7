"""Validation of an untrusted update body, before it may count.

Order of checks (each failure is a :class:`ProtocolError` with its status):

1. the body is a safetensors file at all (else 415);
2. it parses and its sha256 matches (else 400: truncated or corrupt);
3. its metadata is a valid :class:`blocktrain.protocol.messages.UpdateMeta` for this block (422 naming the field);
4. exact tensor names, shapes and dtypes for that encoding (422);
5. every value is finite (422).

Checks that need the coordinator's state (version, norm against the round's
median, the budget, replays, the loss gate) live in :mod:`blocktrain.coordinator.intake`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from blocktrain.checkpoint.safetensors_io import MAX_HEADER_BYTES, RESERVED, unpack
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.delta import Compression, decode_delta, delta_norm, wire_schema
from blocktrain.protocol.group import GroupMember, decode_group
from blocktrain.protocol.messages import parse_meta
from blocktrain.protocol.moments import MomentCodec, check_int8_scale, parse_moments, shares_moments, split_moments


@dataclass(frozen=True)
class ParsedUpdate:
    block: int  # block index the update is for
    base_version: int  # version v the delta is against
    base_sha: str  # sha256 of W_v's tensors, as the sender names it
    samples: int  # training sequences behind the delta (aggregation weight)
    compression: Compression  # wire encoding
    delta: dict[str, torch.Tensor]  # decoded float32 delta per parameter
    norm: float  # ||Delta||_2
    group: tuple[GroupMember, ...] = ()  # members whose sample-weighted mean this is (empty: one worker's delta)
    state_sha: str | None = None  # digest of the sender's inner state at the round's start (for an audit)
    precision: str = "fp32"  # the arithmetic the sender trained in (an audit replays in the same)
    moments: dict[str, torch.Tensor] | None = None  # its inner moment estimates (m/NAME, v/NAME), decoded, if carried
    moment_codec: str | None = None  # their wire encoding (a MomentCodec value), if carried


def _looks_like_safetensors(body: bytes) -> bool:
    if len(body) < 10:
        return False
    n = int.from_bytes(body[:8], "little")
    if n <= 0 or n > MAX_HEADER_BYTES:
        return False
    head = body[8 : 8 + min(n, 1)]
    return head == b"{"


def parse_update(body: bytes, block: int, shapes: dict[str, tuple[int, ...]],
                 moments: tuple[str, ...] = (), moments_every: int = 1) -> ParsedUpdate:
    """Parse and validate ``body`` as a delta for ``block`` with trainable ``shapes``; ``moments``: the inner moment
    prefixes (``m/``, ``v/``) a push carries beside the delta on the rounds that share them, every ``moments_every``-th
    (:func:`~blocktrain.protocol.moments.shares_moments` of its base version); on the others, and with ``moments``
    empty, it must carry none."""
    if not _looks_like_safetensors(body):
        raise ProtocolError(
            415,
            "the body is not a safetensors file; updates must be safetensors (pickle and other formats are refused)",
            Reason.NOT_SAFETENSORS,
        )
    try:
        tensors, meta = unpack(body, source="update")
    except CheckpointError as exc:
        raise ProtocolError(400, f"the update could not be read: {exc}; resend the whole body", Reason.CORRUPT) from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:  # pragma: no cover - unpack wraps these
        raise ProtocolError(400, f"the update could not be read: {exc}", Reason.CORRUPT) from None
    m = parse_meta({n: t for n, t in meta.items() if n not in RESERVED})  # typed and bounded (422 names the field)
    compression = Compression(m.compression)
    k = m.block_index
    if k != block:
        raise ProtocolError(422, f"the update is for block {k} but was sent to block {block}'s endpoint", Reason.METADATA)
    samples = m.samples
    group: tuple[GroupMember, ...] = ()
    if m.group is not None:
        try:
            group = decode_group(m.group)
        except ValueError as exc:
            raise ProtocolError(422, f"malformed group upload: {exc}", Reason.GROUP) from None
        if sum(x.samples for x in group) != samples:
            raise ProtocolError(422, f"samples={samples} is not the sum of the group members' samples", Reason.GROUP)
    tensors, carried = split_moments(tensors)
    if not shares_moments(m.base_version, moments_every):
        moments = ()
    if bool(moments) != (m.moments is not None):
        want = f"its inner moments ({', '.join(moments)}) encoded as 'moments'" if moments else "no inner moments"
        raise ProtocolError(422, f"a push against version {m.base_version} must carry {want}; the worker must follow "
                            "the coordinator's inner_start and moment_every", Reason.MOMENTS)
    if m.moments is None and carried:  # else they went unchecked (any name, dtype, NaN) into the stored body
        raise ProtocolError(422, f"the push declares no inner moments but carries {sorted(carried)[:5]}; the worker "
                            "must follow the coordinator's inner_start and moment_every", Reason.MOMENTS)
    decoded = parse_moments(carried, shapes, moments, MomentCodec(m.moments)) if m.moments is not None else None
    schema = wire_schema(shapes, compression)
    missing = sorted(set(schema) - set(tensors))
    extra = sorted(set(tensors) - set(schema))
    if missing or extra:
        raise ProtocolError(
            422,
            f"tensor names do not match block {block}: missing {missing[:5]}, unexpected {extra[:5]}; "
            "the worker must use the coordinator's preset",
            Reason.SCHEMA,
        )
    for name, spec in schema.items():
        t = tensors[name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ProtocolError(
                422,
                f"tensor {name!r} is {t.dtype} {list(t.shape)}, expected {spec.dtype} {list(spec.shape)}",
                Reason.SCHEMA,
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ProtocolError(
                422, f"tensor {name!r} holds NaN or infinite values; the update is discarded", Reason.NON_FINITE
            )
        check_int8_scale(name, t, Reason.SCHEMA)
    delta = decode_delta(tensors, compression)
    norm = delta_norm(delta)
    if not norm < float("inf"):
        raise ProtocolError(422, "the update's norm overflows float32; the update is discarded", Reason.NON_FINITE)
    return ParsedUpdate(
        block=k, base_version=m.base_version, base_sha=m.base_sha, samples=samples, compression=compression, delta=delta, norm=norm,
        group=group, state_sha=m.state_sha, precision=m.precision, moments=decoded, moment_codec=m.moments,
    )
