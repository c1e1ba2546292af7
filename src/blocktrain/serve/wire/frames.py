"""Frames on the serving wire: magic, two lengths, a JSON header, a safetensors payload.

Layout (all integers big-endian)::

    offset 0   4 bytes   magic b"BTW1"
    offset 4   u32       header length H (1 .. MAX_HEADER_BYTES)
    offset 8   u32       payload length P (0 = no tensors)
    offset 12  H bytes   UTF-8 JSON header (see :class:`Frame`)
    offset 12+H P bytes  safetensors bytes from :func:`blocktrain.checkpoint.safetensors_io.pack`

The lengths are checked against the caps *before* the body is read, so an
oversized frame costs 12 bytes of reading. A stream whose framing is lost
(bad magic, oversized) raises :class:`~blocktrain.errors.FramingError` and the
connection must close; a frame that is well delimited but wrong inside (bad
JSON, unknown kind, corrupt payload, shapes that disagree with the header)
raises :class:`~blocktrain.errors.WireError` and the connection can go on.
No pickle anywhere: tensors travel only as safetensors with a sha256.

Every frame the entry stage computes from a SUBMIT carries ``params["seq"]``, the number the entry gives each SUBMIT
(each step of a request that reuses its id; a retry of the step keeps it); stages copy params onto the frames they
compute, so a RESULT names the step it answers and the entry delivers it only if that is the step it waits for
(:func:`step_seq`). KV-cached stages refuse a frame of an older step than the last they ran for its request
(:class:`StaleFrameError`). Clients need not set it: the entry overwrites it.

A stage started with a shared token reads nothing from a connection before a
HELLO frame (no payload, at most ``MAX_HELLO_BYTES``) whose ``params["token"]``
matches it (compared in constant time); anything else gets an ERROR
(``unauthorized``) and the connection is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hmac
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from blocktrain.checkpoint.safetensors_io import pack, unpack
from blocktrain.errors import CheckpointError, FramingError, WireError
from blocktrain.serve.wire.limits import (  # re-exported: the wire's size limits
    DEFAULT_MAX_FRAME_BYTES as DEFAULT_MAX_FRAME_BYTES,
)
from blocktrain.serve.wire.limits import (
    MAX_HEADER_BYTES as MAX_HEADER_BYTES,
)
from blocktrain.serve.wire.limits import (
    MAX_HELLO_BYTES as MAX_HELLO_BYTES,
)
from blocktrain.serve.wire.limits import (
    SMALL_FRAME_BYTES as SMALL_FRAME_BYTES,
)

MAGIC = b"BTW1"
PREFIX = struct.Struct(">4sII")  # magic, header length, payload length
WIRE_VERSION = 1
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # whole ids only (fullmatch: "$" let a trailing newline through)



SEQ_PARAM = "seq"  # frame parameter: the entry's number of one step (SUBMIT) of a request (see step_seq)
INT64 = (-(1 << 63), 1 << 63)  # the range of an int frame parameter: a seed is mixed as a signed 64-bit integer


def frame_param(params: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """A frame parameter of type ``kind`` (bool is not an int here; an int within 64 bits), else WireError naming it."""
    value = params.get(name, default)
    if value is None or not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise WireError(f"parameter {name!r} must be a {kind.__name__}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value < INT64[1]:
        raise WireError(f"parameter {name!r} must be a 64-bit integer, got {value!r}")
    return value


def frame_seq(params: dict[str, Any]) -> int | None:
    """A frame's step number ``params["seq"]`` (:func:`step_seq`), checked: None when absent (a frame run on a
    span directly, not through an entry stage), else a 64-bit int >= 0 or WireError."""
    if SEQ_PARAM not in params:
        return None
    seq: int = frame_param(params, SEQ_PARAM, int)
    if seq < 0:
        raise WireError(f"parameter {SEQ_PARAM!r} (the entry's step number) must be >= 0, got {seq}")
    return seq


def frame_number(params: dict[str, Any], name: str, default: float) -> float:
    """A finite int or float frame parameter, as a float, else WireError naming it."""
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireError(f"parameter {name!r} must be a finite number, got {value!r}")
    return float(value)

class FrameKind(enum.Enum):
    """What a frame is for."""

    SUBMIT = "submit"  # client -> entry stage: a new request (or one baseline step)
    WORK = "work"  # stage -> next stage: a request in flight, at sigma_index / layer index
    RESULT = "result"  # last stage -> entry stage -> client: the answer
    ACK = "ack"  # next stage -> previous stage: it has passed the WORK frame on (custody released)
    ERROR = "error"  # anyone -> the sender / the request's origin: what failed and what to do
    RELEASE = "release"  # client -> all stages: drop a baseline request's KV caches
    PING = "ping"  # liveness and counters
    PONG = "pong"  # answer to PING, header carries the stage's counters
    HELLO = "hello"  # first frame of a connection to a stage with a shared token: params {"token": ...}


class Mode(enum.Enum):
    """Serving modes."""

    SCORE = "score"  # teacher-forced: one traversal, logits at every position
    SWEEP = "sweep"  # one traversal (x k sweeps) emits a whole N-byte continuation
    AR = "ar"  # one traversal (B block steps) per generated byte; logits of the last position
    BASELINE = "baseline"  # E2E split into stages, KV cache per stage, one traversal per token
    SPEC = "spec"  # the entry drafts n bytes, one traversal scores them all (speculative decoding)


class ErrorCode(enum.Enum):
    """Machine-readable reason of an ERROR frame."""

    MALFORMED = "malformed"  # the frame could not be parsed
    TOO_LARGE = "too_large"  # the frame exceeds the cap
    UNKNOWN_REQUEST = "unknown_request"  # no such request id here
    DUPLICATE_REQUEST = "duplicate_request"  # the id is already in flight
    MISROUTED = "misrouted"  # the frame's sigma index is not held by this stage
    BAD_REQUEST = "bad_request"  # shapes or parameters are invalid for this model
    STAGE_UNAVAILABLE = "stage_unavailable"  # a downstream stage could not be reached or died
    TIMEOUT = "timeout"  # no result within the request's deadline (or a frame not finished in time)
    INTERNAL = "internal"  # the stage failed while computing
    UNAUTHORIZED = "unauthorized"  # the connection did not open with a HELLO frame carrying the stage's token
    OVERLOADED = "overloaded"  # the stage has too many connections or no room to buffer the frame


@dataclass
class Frame:
    """One message. ``header`` holds everything but the tensors."""

    kind: FrameKind
    request_id: str = ""
    mode: Mode | None = None
    sigma_index: int = 0  # next block (BlockTrain) or next layer (baseline) to run
    params: dict[str, Any] = field(default_factory=dict)  # mode parameters (seed, n_new, pos, ...)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str = ""  # ERROR frames: human-readable message
    code: ErrorCode | None = None  # ERROR frames: reason

    def to(self, device: torch.device) -> Frame:
        """This frame with its tensors on ``device`` (itself when they are there already): a span moves the frames it
        receives to its device once, and the frames it answers back to the host, where the wire encodes them."""
        if all(t.device == device for t in self.tensors.values()):
            return self
        return dataclasses.replace(self, tensors={k: t.to(device) for k, t in self.tensors.items()})

    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = {
            "v": WIRE_VERSION,
            "kind": self.kind.value,
            "id": self.request_id,
            "sigma_index": self.sigma_index,
            "shapes": {k: list(t.shape) for k, t in sorted(self.tensors.items())},
            "params": self.params,
        }
        if self.mode is not None:
            h["mode"] = self.mode.value
        if self.kind is FrameKind.ERROR:
            h["error"] = self.error
            h["code"] = (self.code or ErrorCode.INTERNAL).value
        return h

    def reply_error(self, code: ErrorCode, message: str, keep_tag: bool = False) -> Frame:
        """An ERROR answering this frame; ``keep_tag``: carrying its custody tag, so its sender releases it."""
        err = Frame(FrameKind.ERROR, request_id=self.request_id, mode=self.mode, code=code, error=message)
        tag = custody_tag(self)
        if keep_tag and tag is not None:
            err.params = {"tag": tag}
        return err


def step_seq(frame: Frame | None) -> int | None:
    """The step ``frame`` belongs to: ``params["seq"]``, which the entry stage sets on every SUBMIT it is given (a
    retry of the step keeps it) and every stage copies onto the frames it computes from it, so a RESULT says which
    step it answers. None where there is none, or it is not an int (never an answer)."""
    seq = None if frame is None else frame.params.get(SEQ_PARAM)
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def custody_tag(frame: Frame) -> int | None:
    """The custody tag a neighbour stage's link gave ``frame`` (an int, echoed back in its ACK or ERROR); None for
    anything else, which is never echoed (a long string would come back larger than it went, past the frame cap)."""
    tag = frame.params.get("tag")
    return tag if isinstance(tag, int) and not isinstance(tag, bool) else None


class UnknownRequestError(WireError):
    """A frame names a request id that this stage does not hold (never submitted, finished or evicted)."""


class StaleFrameError(UnknownRequestError):
    """A frame is of an older step of a request than one this stage already ran for it (a retried step's late
    copy, or a link's resend after a reconnect): running it would rewind the request's KV cache."""


class MisroutedError(WireError):
    """A frame was sent to a stage that does not run its next block (or layer) first: the stages' spans overlap or
    leave a gap."""


def encode(frame: Frame, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Frame -> bytes. Raises WireError if the result would exceed the cap."""
    if frame.request_id and not _ID_RE.fullmatch(frame.request_id):
        raise WireError(f"request id {frame.request_id!r} must be 1-64 characters of [A-Za-z0-9_.:-]")
    header = json.dumps(frame.header(), sort_keys=True, separators=(",", ":")).encode()
    payload = pack(frame.tensors) if frame.tensors else b""
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}; send fewer params")
    if len(header) + len(payload) > max_frame_bytes:
        raise WireError(
            f"frame of {len(header) + len(payload)} bytes exceeds the cap of {max_frame_bytes}; "
            "send a shorter sequence or raise --max-frame-mib on every stage"
        )
    return PREFIX.pack(MAGIC, len(header), len(payload)) + header + payload


def hello(token: str) -> Frame:
    """The first frame a client or stage sends to a stage that requires a shared token."""
    return Frame(FrameKind.HELLO, params={"token": token})


def token_matches(frame: Frame, token: str) -> bool:
    """Whether ``frame`` is a HELLO carrying ``token`` (constant-time comparison)."""
    given = frame.params.get("token")
    if frame.kind is not FrameKind.HELLO or not isinstance(given, str):
        return False
    try:
        return hmac.compare_digest(given.encode(), token.encode())
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" parses from JSON): no token of ours
        return False


def parse_prefix(prefix: bytes, max_frame_bytes: int) -> tuple[int, int]:
    """The 12-byte prefix -> (header length, payload length); FramingError if unusable."""
    magic, h_len, p_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FramingError(
            f"bad frame magic {magic!r} (expected {MAGIC!r}); the peer does not speak BlockTrain serving"
        )
    if not 0 < h_len <= MAX_HEADER_BYTES:
        raise FramingError(f"frame header length {h_len} is outside 1..{MAX_HEADER_BYTES}")
    if h_len + p_len > max_frame_bytes:
        raise FramingError(
            f"frame of {h_len + p_len} bytes exceeds the cap of {max_frame_bytes} bytes; "
            "send a shorter sequence or raise --max-frame-mib"
        )
    return h_len, p_len


def decode_body(header_bytes: bytes, payload: bytes) -> Frame:
    """Header JSON + payload -> Frame; WireError on anything inconsistent."""
    try:
        h = json.loads(header_bytes)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # ValueError: a number of 4,300+ digits too
        raise WireError(f"frame header is not JSON: {exc}") from exc
    if not isinstance(h, dict):
        raise WireError("frame header must be a JSON object")
    if type(h.get("v")) is not int or h.get("v") != WIRE_VERSION:  # JSON's true equals 1 in Python
        raise WireError(f"wire version {h.get('v')!r} is not supported (this side speaks {WIRE_VERSION})")
    try:
        kind = FrameKind(h.get("kind"))
        mode = Mode(h["mode"]) if h.get("mode") is not None else None
        code = ErrorCode(h["code"]) if h.get("code") is not None else None
    except ValueError as exc:
        raise WireError(f"frame header has an unknown value: {exc}") from exc
    rid = h.get("id", "")
    if not isinstance(rid, str) or (rid and not _ID_RE.fullmatch(rid)):
        raise WireError(f"request id {rid!r} must be 1-64 characters of [A-Za-z0-9_.:-]")
    try:
        return _decode_rest(h, rid, kind, mode, code, payload)
    except WireError as exc:
        exc.request_id = rid  # its receiver can fail that request now, not at its timeout
        raise


def _decode_rest(h: dict[str, Any], rid: str, kind: FrameKind, mode: Mode | None, code: ErrorCode | None,
                 payload: bytes) -> Frame:
    """The rest of :func:`decode_body`, once the header names a valid request id."""
    sigma_index = h.get("sigma_index", 0)
    params = h.get("params", {})
    shapes = h.get("shapes", {})
    if type(sigma_index) is not int or sigma_index < 0 or not isinstance(params, dict) or not isinstance(shapes, dict):
        raise WireError("frame header fields sigma_index/params/shapes have the wrong types (sigma_index: an int >= 0)")
    tensors: dict[str, torch.Tensor] = {}
    if payload:
        try:
            tensors, _ = unpack(payload, source="frame payload")
        except CheckpointError as exc:
            raise WireError(str(exc)) from exc
    got = {k: list(t.shape) for k, t in tensors.items()}
    if got != shapes:
        raise WireError(f"payload shapes {got} disagree with the header's shapes {shapes}")
    return Frame(
        kind=kind, request_id=rid, mode=mode, sigma_index=sigma_index, params=params, tensors=tensors,
        error=str(h.get("error", "")), code=code,
    )


def decode(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Exactly one frame in ``data`` -> Frame."""
    if len(data) < PREFIX.size:
        raise FramingError(f"{len(data)} bytes is shorter than the {PREFIX.size}-byte frame prefix")
    h_len, p_len = parse_prefix(data[: PREFIX.size], max_frame_bytes)
    if len(data) != PREFIX.size + h_len + p_len:
        raise FramingError(f"frame declares {PREFIX.size + h_len + p_len} bytes but {len(data)} were given")
    body = data[PREFIX.size :]
    return decode_body(body[:h_len], body[h_len:])


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> tuple[Frame, int]:
    """Read one frame; returns (frame, bytes read). Raises IncompleteReadError at EOF.

    FramingError leaves the stream unusable; WireError leaves it at the next frame.
    """
    prefix = await reader.readexactly(PREFIX.size)
    h_len, p_len = parse_prefix(prefix, max_frame_bytes)
    body = await reader.readexactly(h_len + p_len)
    return decode_body(body[:h_len], body[h_len:]), PREFIX.size + h_len + p_len
