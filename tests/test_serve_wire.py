"""Wire format of the serving frames: exact bytes, round trips, caps and rejections."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from blocktrain.checkpoint.safetensors_io import pack
from blocktrain.errors import FramingError, WireError
from blocktrain.serve.wire.frames import MAGIC, ErrorCode, Frame, FrameKind, Mode, decode, encode
from tests.serve_sockets import with_header


def _frame() -> Frame:
    x = torch.tensor([[104, 105]], dtype=torch.uint8)
    return Frame(FrameKind.SUBMIT, "req-1", Mode.SCORE, 0, {"seed": 7}, {"x": x})


def test_exact_bytes() -> None:
    f = _frame()
    header = (
        b'{"id":"req-1","kind":"submit","mode":"score","params":{"seed":7},'
        b'"shapes":{"x":[1,2]},"sigma_index":0,"v":1}'
    )
    data = encode(f)
    # safetensors orders its metadata map arbitrarily, so only its length is fixed, not its bytes
    p_len = len(pack({"x": f.tensors["x"]}))
    assert data[: 12 + len(header)] == b"BTW1" + struct.pack(">II", len(header), p_len) + header
    payload = data[12 + len(header) :]
    assert len(payload) == p_len and payload.endswith(b"hi")  # raw tensor bytes come last
    # The payload is plain safetensors: an 8-byte little-endian header length, then JSON.
    st_len = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8 : 8 + st_len])
    assert meta["x"]["dtype"] == "U8" and meta["x"]["shape"] == [1, 2]
    assert meta["__metadata__"]["format"] == "blocktrain" and len(meta["__metadata__"]["sha256"]) == 64


def test_frame_without_tensors_has_empty_payload() -> None:
    data = encode(Frame(FrameKind.PING, "p1"))
    assert data[:4] == MAGIC and struct.unpack(">I", data[8:12])[0] == 0
    g = decode(data)
    assert g.kind is FrameKind.PING and g.request_id == "p1" and g.tensors == {}


def test_round_trip() -> None:
    f = _frame()
    f.tensors["z"] = torch.randn(1, 2, 4)
    g = decode(encode(f))
    assert (g.kind, g.request_id, g.mode, g.sigma_index, g.params) == (f.kind, f.request_id, f.mode, 0, {"seed": 7})
    assert torch.equal(g.tensors["x"], f.tensors["x"]) and torch.equal(g.tensors["z"], f.tensors["z"])
    err = decode(encode(f.reply_error(ErrorCode.UNKNOWN_REQUEST, "no such id")))
    assert err.kind is FrameKind.ERROR and err.code is ErrorCode.UNKNOWN_REQUEST and err.error == "no such id"


def test_size_cap() -> None:
    f = _frame()
    f.tensors["z"] = torch.zeros(1, 2, 1024)
    data = encode(f)
    with pytest.raises(WireError, match="exceeds the cap"):
        encode(f, max_frame_bytes=1024)
    with pytest.raises(FramingError, match="exceeds the cap"):
        decode(data, max_frame_bytes=1024)
    huge = MAGIC + struct.pack(">II", 10, 2**31)
    with pytest.raises(FramingError, match="exceeds the cap"):
        decode(huge + b"x" * 10)


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda d: b"XXXX" + d[4:], FramingError, "magic"),
        (lambda d: d[:12] + b"}" + d[13:], WireError, "not JSON"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), WireError, "sha256|corrupt"),
        (lambda d: d.replace(b'"kind":"submit"', b'"kind":"submyt"'), WireError, "unknown value"),
        (lambda d: d.replace(b'"x":[1,2]', b'"x":[2,1]'), WireError, "disagree"),
        (lambda d: d.replace(b'"id":"req-1"', b'"id":"req/1"'), WireError, "request id"),
        (lambda d: with_header(d, id="r" * 64 + "\n"), WireError, "request id"),  # "$" matched before a last newline
        (lambda d: with_header(d, v=True), WireError, "wire version"),  # true == 1 in Python
        (lambda d: with_header(d, sigma_index=-1), WireError, "sigma_index"),
        (lambda d: with_header(d, sigma_index=True), WireError, "sigma_index"),
        (lambda d: d[:-3], FramingError, "declares"),
    ],
)
def test_rejections(mutate, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        decode(mutate(encode(_frame())))


def test_span_rejects_oversized_batches_and_bad_sweep_params() -> None:
    import torch

    from blocktrain.errors import WireError
    from blocktrain.model.block import BlockDenoiser
    from blocktrain.presets import tiny
    from blocktrain.serve.runtime import MAX_ROWS_PER_FRAME
    from blocktrain.serve.runtime.diffusion import BlockSpan
    from blocktrain.serve.wire.frames import Frame, FrameKind, Mode

    cfg = tiny()
    span = BlockSpan({0: BlockDenoiser(cfg.model, 0.5)}, cfg)
    big = Frame(kind=FrameKind.SUBMIT, request_id="r1", mode=Mode.SCORE,
                tensors={"x": torch.zeros(MAX_ROWS_PER_FRAME + 1, 4, dtype=torch.uint8)})
    with pytest.raises(WireError, match="at most"):
        span.validate(big)
    bad = Frame(kind=FrameKind.SUBMIT, request_id="r2", mode=Mode.SWEEP, tensors={"x": torch.zeros(1, 4, dtype=torch.uint8)},
                params={"n_new": 2, "prompt_len": 4, "estimate": "psychic"})
    with pytest.raises(WireError, match="estimate"):
        span.validate(bad)


@pytest.mark.parametrize(
    ("lo", "tensors", "match"),
    [
        (0, {"x": torch.zeros(65, 4, dtype=torch.uint8)}, "at most 64 sequences"),  # MAX_ROWS_PER_FRAME + 1
        (0, {"x": torch.zeros(1, 4, dtype=torch.int64)}, "uint8 bytes"),
        (0, {"x": torch.zeros(4, dtype=torch.uint8)}, "uint8 bytes"),
        (2, {"h": torch.zeros(1, 4, 3)}, "h of shape"),  # tiny's d_model is not 3
        (2, {"x": torch.zeros(1, 4, dtype=torch.uint8)}, "need tensor 'h'"),
    ],
)
@pytest.mark.parametrize("mode", [Mode.SCORE, Mode.BASELINE])
def test_e2e_span_bounds_what_a_frame_carries(lo: int, tensors: dict[str, torch.Tensor], match: str, mode: Mode) -> None:
    """An E2E stage checks rows, dtype and width before compute, as a BlockTrain stage does: one frame cannot make
    it allocate 64 MiB of windows, and a malformed one is a bad request, not an INTERNAL error."""
    from blocktrain.presets import tiny
    from blocktrain.serve.runtime.loading import random_e2e_span

    cfg = tiny()
    span = random_e2e_span(cfg, lo, lo)
    with pytest.raises(WireError, match=match):
        span.validate(Frame(FrameKind.SUBMIT, "r1", mode, params={"pos": 0}, tensors=tensors))


def test_e2e_span_takes_the_stage_cache_limits() -> None:
    from blocktrain.presets import tiny
    from blocktrain.serve.runtime.kvcache import CacheOptions
    from blocktrain.serve.runtime.loading import random_e2e_span

    limits = CacheOptions(max_requests=3, ttl_s=5.0, max_bytes=1024)
    assert random_e2e_span(tiny(), 0, 0, cache=limits).cache.opts == limits
    assert random_e2e_span(tiny(), 0, 0).cache.opts == CacheOptions()  # the --cache-* defaults, with a byte cap


def test_tokens_and_addresses_a_stranger_or_a_typo_can_give() -> None:
    """A HELLO token with a lone surrogate raised UnicodeEncodeError out of the connection handler (a traceback per
    stranger, no UNAUTHORIZED); a port past 65535 parsed, then raised OverflowError where connecting catches OSError."""
    from blocktrain.serve.wire.frames import hello, token_matches
    from blocktrain.serve.wire.links import parse_address

    token = "0123456789abcdef0123456789abcdef"
    assert token_matches(hello(token), token) and not token_matches(hello("\ud800"), token)
    assert parse_address("h:65535") == ("h", 65535) and parse_address("h:0") == ("h", 0)  # 0: listen on any port
    for bad in ("h:65536", "h:70000", "h:\u0661\u0662", "h:", ":80", "h"):  # "\u0661\u0662": Arabic-Indic 12
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)
