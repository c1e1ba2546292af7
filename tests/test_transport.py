"""Deflate on the wire (issue 19): exact bytes, bounded inflation, and the coordinator's routes."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.coordinator.app import create_app
from blocktrain.coordinator.service import Coordinator
from blocktrain.errors import ProtocolError
from blocktrain.protocol.delta import Compression, pack_delta
from blocktrain.protocol.transport import accepts_deflate, decode_body, deflate, inflate
from tests.distributed_utils import make_coordinator


def test_deflate_round_trips_exact_bytes() -> None:
    payload = bytes(range(256)) * 100
    body = deflate(payload)
    assert body == zlib.compress(payload, 1)  # RFC 1950 zlib data, as HTTP's "deflate" means
    assert inflate(body, len(payload)) == payload
    assert decode_body(body, "Deflate", len(payload)) == payload and decode_body(payload, None, 0) == payload


def test_inflation_is_bounded_and_refuses_bad_data() -> None:
    bomb = deflate(b"\0" * 50_000_000)  # about 50 KB that would expand to 50 MB
    with pytest.raises(ProtocolError) as exc:
        inflate(bomb, cap=1_000_000)
    assert exc.value.status == 413
    with pytest.raises(ProtocolError) as exc:
        inflate(deflate(b"x" * 1000)[:-5], cap=10_000)
    assert exc.value.status == 400
    with pytest.raises(ProtocolError) as exc:
        inflate(b"not zlib at all", cap=10_000)
    assert exc.value.status == 400
    with pytest.raises(ProtocolError) as exc:
        decode_body(b"x", "br", 10)
    assert exc.value.status == 415


def test_accept_encoding() -> None:
    assert accepts_deflate("gzip, deflate") and accepts_deflate("*") and accepts_deflate("deflate;q=0.5")
    assert not accepts_deflate(None) and not accepts_deflate("gzip") and not accepts_deflate("deflate;q=0")
    assert not accepts_deflate("deflate;level=1;q=0") and accepts_deflate("deflate;level=1")  # q among other params
    assert not accepts_deflate("deflate;q=x")  # a weight that is no number (it was a ValueError: a 500)
    assert not accepts_deflate("*, deflate;q=0") and accepts_deflate("gzip;q=0, *") and not accepts_deflate("*;q=0")


def test_a_refusal_whose_json_is_not_an_object_is_read_as_text() -> None:
    """A proxy answering 404 with a JSON string (or list) was an AttributeError that escaped the worker's client."""
    import httpx

    from blocktrain.worker.client import _protocol_error

    for body in (b'"Not Found"', b"[1, 2]", b"<html>gone</html>"):
        resp = httpx.Response(404, content=body, request=httpx.Request("GET", "http://x/v1/work"))
        err = _protocol_error(resp)
        assert err.status == 404 and err.reason == "http" and body.decode()[:5] in str(err)
    resp = httpx.Response(409, json={"detail": "stale", "error": "stale"}, request=httpx.Request("POST", "http://x/"))
    assert _protocol_error(resp).reason == "stale"


def test_an_int8_scale_that_is_not_positive_is_refused(coordinator: Coordinator) -> None:
    """An encoder's int8 scale is amax / 127, or 1 for an all-zero tensor: a scale of 0 or below is no encoding's,
    and was accepted (0: a zero delta of norm 0; negative: the delta negated twice)."""
    from blocktrain.coordinator.validate import parse_update

    shapes = coordinator.block_shapes[0]
    delta = {n: 1e-3 * torch.ones(s) for n, s in shapes.items()}
    body = pack_delta(delta, Compression.INT8, block=0, base_version=0, base_sha=coordinator.weights_sha[0], samples=4)
    assert parse_update(body, 0, shapes).norm > 0
    tensors, meta = unpack(body)
    name = next(n for n in tensors if n.endswith("@scale"))
    for bad in (0.0, -0.01):
        from blocktrain.checkpoint.safetensors_io import RESERVED, pack

        forged = pack({**tensors, name: torch.tensor(bad)}, {k: v for k, v in meta.items() if k not in RESERVED})
        with pytest.raises(ProtocolError, match="must be > 0") as info:
            parse_update(forged, 0, shapes)
        assert info.value.status == 422


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    c = make_coordinator(tmp_path / "run", None, round_seconds=30, lease_seconds=10)
    yield c
    c.close()


def test_deflated_push_and_pull_through_the_coordinator(coordinator: Coordinator) -> None:
    c = coordinator
    token = c.add_token("a")
    h = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(c, background=False)) as client:
        assert client.post("/v1/register", json={"block": 0}, headers=h).status_code == 200
        g = torch.Generator().manual_seed(0)
        delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in c.shapes.items()}
        payload = pack_delta(delta, Compression.INT8, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4)
        wire = deflate(payload)
        r = client.post("/v1/blocks/0/updates", content=wire, headers={**h, "Content-Encoding": "deflate"})
        assert r.status_code == 202, r.text
        assert c.version[0] == 1
        # the coordinator stored the decoded safetensors body, byte for byte
        row = c.store.q("SELECT blob FROM updates WHERE block=0 AND version=0")
        assert c.store.blobs.get_blob(str(row[0]["blob"])) == payload
        # the step comes deflated to a client that accepts it, and decodes to the published safetensors
        plain = client.get("/v1/blocks/0/steps/0", headers={**h, "Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers
        packed = client.get("/v1/blocks/0/steps/0", headers={**h, "Accept-Encoding": "gzip, deflate"})
        assert packed.headers["content-encoding"] == "deflate"
        assert packed.content == plain.content  # httpx decodes it
        assert packed.num_bytes_downloaded < 0.95 * len(plain.content)
        step, meta = unpack(packed.content)
        assert meta["compression"] == "int8" and all(t.dtype in (torch.int8, torch.float32) for t in step.values())
        # an encoding the coordinator does not speak is refused and counted
        r = client.post("/v1/blocks/0/updates", content=wire, headers={**h, "Content-Encoding": "br"})
        assert r.status_code == 415


def test_a_leaving_worker_gives_up_on_a_gone_coordinator_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM sets the worker's ``leaving``: a coordinator that is gone then ends its retries within
    LEAVING_GIVE_UP_S (not the 600 s of --give-up-s), and a retry's back-off wait notices within a second."""
    import socket
    import threading
    import time

    from blocktrain.worker import client as client_module

    monkeypatch.setattr(client_module, "LEAVING_GIVE_UP_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    leaving = threading.Event()
    c = client_module.CoordinatorClient(f"http://127.0.0.1:{port}", "t", give_up_s=600, max_delay=30, base_delay=30,
                                        leaving=leaving)
    threading.Timer(0.5, leaving.set).start()
    t0 = time.monotonic()
    with pytest.raises(ProtocolError) as info:
        c.work()
    assert info.value.reason == "unreachable" and time.monotonic() - t0 < 5
    c.close()


def test_the_worker_reads_an_answer_up_to_its_cap_decoded() -> None:
    """A deflate bomb (8 MiB of zeros in about 8 kB) or a runaway body ends the request with 502 too_large at the
    worker's cap, counted after decoding; an answer within the cap reads as before, its wire bytes counted."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from blocktrain.worker.client import CoordinatorClient

    bomb = zlib.compress(b"\0" * (8 * 2**20))
    small = zlib.compress(json.dumps({"ok": True}).encode())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bomb if self.path.endswith("/weights") else small
            self.send_response(200)
            self.send_header("Content-Encoding", "deflate")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = CoordinatorClient(f"http://127.0.0.1:{server.server_address[1]}", "t", give_up_s=5)
    try:
        client.max_response_bytes = 2**20
        with pytest.raises(ProtocolError, match="exceeds 1048576 bytes") as info:
            client.weights(0)
        assert (info.value.status, info.value.reason) == (502, "too_large")
        assert client.request("GET", "/v1/anything").json() == {"ok": True}
        client.max_response_bytes = 16 * 2**20
        assert len(client.weights(0)) == 8 * 2**20
        assert client.bytes_received >= len(small) + len(bomb)  # wire bytes, not decoded ones
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def test_a_delta_of_subnormal_values_encodes_with_a_positive_scale(coordinator: Coordinator) -> None:
    """amax / 127 of a tensor of subnormal values rounded to a float32 scale of 0, which the coordinator refuses (an
    honest push counted toward quarantine); the scale is at least the least normal float32."""
    from blocktrain.coordinator.validate import parse_update
    from blocktrain.protocol.delta import encode_delta
    from blocktrain.protocol.moments import MomentCodec, encode_moments

    shapes = coordinator.block_shapes[0]
    delta = {n: torch.full(s, 1e-44) for n, s in shapes.items()}  # subnormal float32
    wire = encode_delta(delta, Compression.INT8)
    assert all(float(t) > 0 for n, t in wire.items() if n.endswith("@scale"))
    body = pack_delta(delta, Compression.INT8, block=0, base_version=0, base_sha=coordinator.weights_sha[0], samples=4)
    assert parse_update(body, 0, shapes).norm >= 0
    m = encode_moments({"m/w": torch.full((3, 2), 1e-44)}, MomentCodec.INT8)
    assert float(m["m/w@scale"]) > 0
