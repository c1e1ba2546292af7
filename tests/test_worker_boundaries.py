"""What a worker reads from its coordinator and its command line is checked where it arrives: answers that are not
JSON, work answers out of range, weights that are not the version the work answer named, corrupt moments, devices
this machine lacks. Each is a specific error saying what to do, not a crash deep in a round or a loop without end."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from blocktrain.checkpoint.safetensors_io import pack, tensors_sha256
from blocktrain.device import resolve_device
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.codes import BlockState, RoundState
from blocktrain.protocol.messages import WorkAnswer, parse
from blocktrain.worker.client import CoordinatorClient
from blocktrain.worker.engines import DirectEngine
from blocktrain.worker.versions import fetch_version

SHAPES = {"w": (4, 3)}
WORK: dict[str, Any] = {"block": 0, "version": 5, "weights_sha": "0" * 64, "block_state": BlockState.OPEN.value,
                        "round_state": RoundState.OPEN.value, "deadline_in": 10.0, "seed": 0, "stream": 1,
                        "steps": 4, "batch": 2, "submitted": False, "finished": False}


def test_a_work_answer_out_of_range_is_refused_where_it_arrives() -> None:
    """A seed past 64 bits failed in the middle of a round (struct.error in mix_seed); a NaN or infinite deadline
    took the round's deadline away."""
    assert parse(WorkAnswer, WORK, "the work answer", 502).seed == 0
    for field, bad in (("seed", 1 << 63), ("deadline_in", float("nan")), ("deadline_in", float("inf"))):
        with pytest.raises(ProtocolError, match=field) as exc:
            parse(WorkAnswer, {**WORK, field: bad}, "the work answer", 502)
        assert exc.value.status == 502
    assert parse(WorkAnswer, {**WORK, "deadline_in": -3.0}, "the work answer", 502).deadline_in == -3.0  # held open


def test_an_answer_that_is_not_json_is_a_protocol_error() -> None:
    """A proxy's or captive portal's page answered 200: JSONDecodeError escaped the worker."""
    client = CoordinatorClient("http://coordinator", "t", base_delay=0.01, max_delay=0.02)
    client.http = httpx.Client(base_url="http://coordinator", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text="<html>sign in to the wifi</html>",
                                       headers={"content-type": "text/html"})))
    with pytest.raises(ProtocolError, match=r"not JSON .*--url") as exc:
        client.work()
    assert exc.value.status == 502
    client.close()


class Serves:
    """A coordinator client that serves ``payload`` as the block's whole weights."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def weights(self, k: int) -> bytes:
        return self.payload


def test_weights_that_are_not_the_named_version_are_refused() -> None:
    """Weights of an older version (a caching proxy) or other bytes under the named version: the worker fetched them
    again and again without end (its loop compared their sha with the next work answer's). Version v with the named
    sha is taken; a newer version is taken and checked against the next work answer."""
    w = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    work = WorkAnswer.model_validate({**WORK, "weights_sha": tensors_sha256(w)})

    def served(version: int, tensors: dict[str, torch.Tensor]) -> bytes:
        return pack(tensors, {"kind": "weights", "block_index": "0", "version": str(version)})

    def fetch(payload: bytes) -> tuple[dict[str, torch.Tensor], int]:
        return fetch_version(Serves(payload), DirectEngine(), 0, SHAPES, work, None, -1)  # type: ignore[arg-type]

    got, v = fetch(served(5, w))
    assert v == 5 and torch.equal(got["w"], w["w"])
    assert fetch(served(6, {"w": w["w"] + 1}))[1] == 6
    for payload in (served(4, w), served(5, {"w": w["w"] + 1}), b"\x00" * 16):
        with pytest.raises(ProtocolError) as exc:
            fetch(payload)
        assert exc.value.status == 502


def test_a_device_this_machine_lacks_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda:7`` on a one-GPU machine passed and failed later at the first .to(); a misspelt device raised a bare
    RuntimeError."""
    with pytest.raises(ConfigError, match="not a device torch knows"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="1 CUDA device"):
        resolve_device("cuda:7")


def test_weights_of_another_version_are_asked_for_again_a_few_times() -> None:
    """The block may move on, or version 0 be replaced by a warm start, between a work answer and the download of its
    weights: the worker asks for work again (SYNC_TRIES times in a row at most) instead of leaving at once."""
    from blocktrain.data.dataset import DataDir
    from blocktrain.protocol.codes import Reason
    from blocktrain.worker.loop import SYNC_TRIES, Worker
    from blocktrain.worker.options import WorkerOptions

    w = Worker(WorkerOptions(url="http://coordinator", token="t", block=0, progress=False, poll_s=0.01),
               DataDir.__new__(DataDir))
    w.k = 0
    misses = iter([True, True, False, True, True, True])

    def sync(work: WorkAnswer) -> None:
        if next(misses):
            raise ProtocolError(502, "the weights served are version 1, not 0", Reason.BASE)

    w._sync = sync  # type: ignore[method-assign]
    work = WorkAnswer.model_validate(WORK)
    for _ in range(3):  # two misses, then the weights named
        w._synced(work)
    assert w._sync_misses == 0
    for _ in range(SYNC_TRIES - 1):
        w._synced(work)
    with pytest.raises(ProtocolError, match="version 1"):
        w._synced(work)


def test_an_answer_that_trickles_is_cut_like_a_read_timeout() -> None:
    """httpx's read timeout bounds each read, not the answer: a peer that sent a byte every 0.2 s (inside the 0.5 s
    timeout) held a request for as long as it liked, and the worker's lease with it. The answer must now average
    MIN_ANSWER_BYTES_PER_S after timeout_s: it is cut within about a second and retried until give_up_s (a real
    server on loopback; the trickle ends after 30 s whatever happens, so the test cannot hang)."""
    import http.server
    import threading
    import time

    done = threading.Event()

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the http.server hook
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(150):  # 30 s at most
                if done.is_set():
                    return
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = CoordinatorClient(f"http://127.0.0.1:{server.server_address[1]}", "t", timeout_s=0.5, base_delay=0.01,
                               max_delay=0.02, give_up_s=1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(ProtocolError) as err:
            client.request("GET", "/v1/status")
        assert err.value.reason == "unreachable" and "bytes/s" in str(err.value)
        assert time.monotonic() - t0 < 5.0
    finally:
        done.set()
        client.close()
        server.shutdown()
        server.server_close()
