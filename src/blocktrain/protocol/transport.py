"""Transport compression of the large bodies: HTTP ``Content-Encoding: deflate`` (RFC 9110 section 8.4.1).

What travels is still a safetensors file; deflate (zlib, level 1) only shrinks it
on the wire. An int8 delta or step entropy-codes to about 0.88 of its bytes, which
is what brings a worker's round under half the block's fp32 size. Inflating is
bounded: a body that would expand past the receiver's cap is refused (413)
without being expanded further, so a small "zip bomb" costs the coordinator
nothing.
"""

from __future__ import annotations

import zlib

from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason

DEFLATE = "deflate"  # the Content-Encoding name; zlib format, as HTTP defines it
LEVEL = 1  # zlib level: int8 data compresses about as well at 1 as at 6, several times faster


def deflate(payload: bytes) -> bytes:
    return zlib.compress(payload, LEVEL)


def inflate(body: bytes, cap: int) -> bytes:
    """The decoded body, at most ``cap`` bytes; ProtocolError 413 past the cap, 400 if it is not whole zlib data."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(body, cap + 1)
    except zlib.error as exc:
        raise ProtocolError(400, f"the deflate-encoded body does not decode ({exc}); resend it", Reason.CORRUPT) from None
    if len(out) > cap or d.unconsumed_tail:
        raise ProtocolError(413, f"the deflate-encoded body expands past the cap of {cap} bytes", Reason.TOO_LARGE)
    if not d.eof or d.unused_data:
        raise ProtocolError(400, "the deflate-encoded body is truncated or has trailing bytes; resend it", Reason.CORRUPT)
    return out


def decode_body(body: bytes, encoding: str | None, cap: int) -> bytes:
    """A request body under its Content-Encoding (none, identity or deflate); 415 for any other."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc == DEFLATE:
        return inflate(body, cap)
    raise ProtocolError(415, f"Content-Encoding {encoding!r} is not supported; send identity or deflate", Reason.ENCODING)


def accepts_deflate(accept_encoding: str | None) -> bool:
    """Whether an Accept-Encoding header allows deflate: named, else ``*``, without a weight of 0 among its parameters
    (``deflate;level=1;q=0`` refuses it, and ``*, deflate;q=0`` too: the named entry wins over ``*``); a weight that
    is no number counts as 0 (it was a ValueError, a 500)."""
    weights: dict[str, bool] = {}
    for part in (accept_encoding or "").lower().split(","):
        name, *params = part.split(";")
        name = name.strip()
        if name in (DEFLATE, "*") and name not in weights:
            weights[name] = _weight(params) > 0
    return weights.get(DEFLATE, weights.get("*", False))


def _weight(params: list[str]) -> float:
    """The q of an Accept-Encoding entry's parameters (1 without one, 0 for one that is no number)."""
    for param in params:
        key, _, value = param.partition("=")
        if key.strip() == "q":
            try:
                return float(value.strip())
            except ValueError:
                return 0.0
    return 1.0
