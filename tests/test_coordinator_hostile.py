"""The coordinator probed as a hostile (or unlucky) client would: refused bodies, bad tokens, aborted uploads."""

from __future__ import annotations

import logging
import math
import signal
import socket
import sqlite3
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ConfigError
from blocktrain.protocol.delta import Compression, pack_delta
from tests.distributed_utils import (  # noqa: F401
    ThreadServer,
    cli,
    corpus,
    free_port,
    full,
    get_status,
    make_coordinator,
    procs,
    wait_for,
)
from tests.test_coordinator_api import Api, api, clock, small_delta  # noqa: F401


def _blob_files(a: Api) -> list[str]:
    return sorted(p.name for p in a.c.store.blobs.blob_dir.iterdir())  # temp files (".x.tmp") included


def test_refused_updates_leave_no_blob_behind(api: Api) -> None:  # noqa: F811
    for name in ("a", "b", "evil"):
        api.register(name, block=0)
    sent = {}
    for i, name in enumerate(("a", "b")):  # two accepted updates: the norm check is armed, 'evil' keeps it open
        sent[name] = pack_delta(small_delta(api.c, seed=i), Compression.BF16, block=0, base_version=0,
                                base_sha=api.c.weights_sha[0], samples=full(api.c))
        status, _ = api.push(name, 0, sent[name])
        assert status == 202
    before = _blob_files(api)
    for i in range(20):  # a second, different delta for the same round
        body = pack_delta(small_delta(api.c, seed=100 + i), Compression.BF16, block=0, base_version=0,
                          base_sha=api.c.weights_sha[0], samples=4)
        status, doc = api.push("a", 0, body)
        assert (status, doc["error"]) == (409, "duplicate")
    for i in range(20):  # parsed and valid, but far above the recent norms
        body = pack_delta(small_delta(api.c, scale=1.0, seed=200 + i), Compression.BF16, block=0, base_version=0,
                          base_sha=api.c.weights_sha[0],
                          samples=4)
        status, doc = api.push("evil", 0, body)
        assert (status, doc["error"]) == (422, "norm")
    assert _blob_files(api) == before
    # an exact retry of an accepted body is still acknowledged as a duplicate, and names the stored blob
    status, doc = api.push("a", 0, sent["a"])
    assert status == 202 and doc["duplicate"] is True
    assert _blob_files(api) == before
    # an accepted update still stores its blob before its row
    status, _ = api.push("evil", 0, pack_delta(small_delta(api.c, seed=7), Compression.BF16, block=0,
                                               base_version=0, base_sha=api.c.weights_sha[0], samples=4))
    assert status == 202
    for r in api.c.store.q("SELECT blob FROM updates"):
        assert api.c.store.blobs.blob_path(r["blob"]).is_file()


def _row_counts(db_path: Path) -> dict[str, int]:
    con = sqlite3.connect(db_path)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}
    finally:
        con.close()


def test_unauthenticated_uploads_write_nothing_and_are_counted(api: Api, caplog) -> None:  # noqa: F811
    api.register("a", block=0)
    api.c.flush_bytes()
    before = _row_counts(api.c.store.db_path)
    assert "rejections" in before
    body = b"\0" * 4096
    caplog.set_level(logging.WARNING, logger="blocktrain")
    t0 = time.monotonic()
    for i in range(1000):
        headers = {"Authorization": f"Bearer bt_forged{i}"} if i % 2 else {}
        r = api.client.post("/v1/blocks/0/updates", content=body, headers=headers)
        assert r.status_code == 401, r.text
    elapsed = time.monotonic() - t0
    api.c.flush_bytes()  # what the periodic tick would write
    assert _row_counts(api.c.store.db_path) == before
    assert api.client.get("/v1/status").json()["rejections"] == {"auth": 1000}
    assert 'blocktrain_updates_rejected_total{reason="auth"} 1000' in api.client.get("/metrics").text
    lines = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert 1 <= len(lines) <= 1 + elapsed / 10.0  # rate-limited: one line per 10 s at most


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_upload_aborted_mid_body_is_counted_without_traceback(tmp_path: Path) -> None:
    c = make_coordinator(tmp_path / "run", None, norm_k=0)
    token = c.add_token("a")
    body = pack_delta(small_delta(c), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4)
    srv = ThreadServer(c, background=False)
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "blocktrain", "")]
    for lg in loggers:  # after uvicorn configured its logging (in ThreadServer's constructor)
        lg.addHandler(records)
    try:
        with srv:
            h = {"Authorization": f"Bearer {token}"}
            assert httpx.post(f"{srv.url}/v1/register", json={"block": 0}, headers=h, timeout=30).status_code == 200
            head = (f"POST /v1/blocks/0/updates HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                s.sendall(head + body[: len(body) // 2])
                time.sleep(0.3)  # let the server read the first half
            wait_for(lambda: get_status(srv.url)["rejections"].get("aborted") == 1, 30, "the abort to be counted")
            # the coordinator carries on: the whole body is accepted afterwards
            r = httpx.post(f"{srv.url}/v1/blocks/0/updates", content=body, headers=h, timeout=30)
            assert r.status_code == 202, r.text
            assert get_status(srv.url)["rejections"] == {"aborted": 1}
    finally:
        for lg in loggers:
            lg.removeHandler(records)
        c.close()
    assert not [r for r in records.records if r.exc_info or "Exception in ASGI" in r.getMessage()]
    assert any("closed the connection" in r.getMessage() for r in records.records)
    row = c.store  # closed; read the stored rejection directly
    con = sqlite3.connect(row.db_path)
    assert con.execute("SELECT worker, reason FROM rejections").fetchall() == [("a", "aborted")]
    con.close()


def test_coordinator_ctrl_c_message_is_its_own(tmp_path: Path, procs) -> None:  # noqa: F811
    run, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    p = cli("coordinator", "--run-dir", str(run), "--preset", "tiny", "--port", str(port), "--no-eval",
            "--threads", "1", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs.append(p)
    wait_for(lambda: get_status(url), 120, "the coordinator")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    text = err.decode()
    assert p.returncode == 130, text
    assert "checkpoint" not in text
    assert "coordinator stopped" in text and str(run) in text


def test_worker_round_prints_no_autograd_warning(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    from blocktrain.worker.loop import Worker
    from blocktrain.worker.options import WorkerOptions

    c = make_coordinator(tmp_path / "run", None, rounds=1, norm_k=0)
    token = c.add_token("w")
    try:
        with ThreadServer(c) as srv, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opts = WorkerOptions(url=srv.url, token=token, block=0, local_steps=2, progress=False, give_up_s=30,
                                 work_dir=tmp_path / "worker")
            summary = Worker(opts, corpus).run()
    finally:
        c.close()
    assert summary.rounds_pushed == 1
    assert not [w for w in caught if "requires_grad" in str(w.message)]


def test_a_refused_or_quarantined_worker_does_not_hold_the_round(tmp_path: Path) -> None:
    """--min-updates equal to the worker count: a worker refused in a round, then quarantined, stops counting at
    once, and the honest workers' pushes close each round at quorum, well before its deadline."""
    from fastapi.testclient import TestClient

    from blocktrain.coordinator.app import create_app
    from tests.distributed_utils import FakeClock

    fake = FakeClock()
    c = make_coordinator(tmp_path / "run", None, clock=fake, round_seconds=120, lease_seconds=600, min_updates=3,
                         agree_min=None, refusal_burst=0, audit_fraction=0.0)
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)
        for name in ("a", "b", "evil"):
            api.register(name, block=0)

        def push(name: str, v: int, seed: int, scale: float = 1e-3) -> tuple[int, dict[str, object]]:
            return api.push(name, 0, pack_delta(small_delta(c, scale=scale, seed=seed), Compression.BF16, block=0,
                                                base_version=v, base_sha=c.weights_sha[0], samples=full(c)))

        for v in range(3):
            for i, name in enumerate(("a", "b")):
                assert push(name, v, 10 * v + i)[0] == 202
            status, doc = push("evil", v, 100 + v, scale=1.0)  # far above the honest norms
            assert status in (403, 422), doc
            c.tick()  # the service's periodic pass; the clock has not moved: no deadline has passed
            assert c.version[0] == v + 1, f"round {v} held open by a refused or quarantined worker"
        assert c.store.conduct.quarantined("evil")  # three refusals quarantine it (quarantine_after 3)
        for i, name in enumerate(("a", "b")):  # round 3: evil was quarantined before it opened, like a worker that
            assert push(name, 3, 30 + i)[0] == 202  # left: the floor stays 3, so two honest deltas wait ...
        c.tick()
        assert c.version[0] == 3
        fake.advance(121)  # ... for the deadline
        c.tick()
        assert c.version[0] == 4
    c.close()


def test_a_restarted_coordinator_does_not_wait_for_a_worker_its_round_refused(tmp_path: Path) -> None:
    """--min-updates 3 over a, b and evil: in round 1, a's delta is accepted and evil's refused (its lease still
    held); the coordinator restarts; b's delta then closes the round at once. The refusal is stored with its
    round, so the restarted coordinator does not wait for evil until the deadline."""
    from fastapi.testclient import TestClient

    from blocktrain.coordinator.app import create_app
    from tests.distributed_utils import FakeClock

    fake = FakeClock()
    settings = dict(clock=fake, round_seconds=120, lease_seconds=600, min_updates=3, agree_min=None, refusal_burst=0,
                    audit_fraction=0.0)
    tokens: dict[str, str] = {}

    def push(api: Api, name: str, v: int, seed: int, scale: float = 1e-3) -> int:
        c = api.c
        return api.push(name, 0, pack_delta(small_delta(c, scale=scale, seed=seed), Compression.BF16, block=0,
                                            base_version=v, base_sha=c.weights_sha[0], samples=full(c)))[0]

    c = make_coordinator(tmp_path / "run", None, **settings)
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)
        for name in ("a", "b", "evil"):
            api.register(name, block=0)
        assert [push(api, "a", 0, 0), push(api, "b", 0, 1), push(api, "evil", 0, 100, scale=1.0)] == [202, 202, 422]
        c.tick()
        assert c.version[0] == 1  # round 0 closed at quorum: evil's refusal lowered the floor to 2
        assert push(api, "a", 1, 10) == 202
        assert push(api, "evil", 1, 101, scale=1.0) == 422
        c.tick()
        assert c.version[0] == 1  # a alone: the floor is 2 (3 less evil), b has not reported
        tokens = dict(api.tokens)
    c.close()
    c = make_coordinator(tmp_path / "run", None, **settings)
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)
        api.tokens = tokens
        assert not c.store.conduct.quarantined("evil") and c.version[0] == 1
        assert push(api, "b", 1, 11) == 202
        c.tick()  # the clock has not moved: no deadline has passed
        assert c.version[0] == 2, "the restarted coordinator waits for the worker its round refused"
    c.close()


def test_a_refused_group_and_its_round_refusal_are_stored_in_one_transaction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused group mean is recorded against its members and its round stops waiting for them in one transaction:
    when the second write fails the first is rolled back, so a restart never finds one without the other."""
    from types import SimpleNamespace

    from blocktrain.errors import ProtocolError
    from blocktrain.protocol.codes import Reason

    c = make_coordinator(tmp_path / "run", None, audit_fraction=0.0)
    try:
        upd: Any = SimpleNamespace(block=0, base_version=0)
        exc = ProtocolError(422, "the group's mean raised the held-out loss", Reason.GATE)

        def disk_full(*args: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(type(c.store.rounds), "mark_refused", disk_full)  # a frozen table: patch its class
        with pytest.raises(sqlite3.OperationalError):
            c.uploads.refused("w1", upd, ["w1", "w2"], exc, 0.0)
        assert c.store.conduct.refused_groups("w2") == 0, "the group refusal outlived its round's refusal"
        monkeypatch.undo()
        c.uploads.refused("w1", upd, ["w1", "w2"], exc, 0.0)
        assert c.store.conduct.refused_groups("w2") == 1 and c.store.rounds.refused(0, 0) == {"w1", "w2"}
    finally:
        c.close()


def test_a_member_of_two_refused_group_means_is_quarantined_in_full(tmp_path: Path) -> None:
    """The second refused group mean w2 is a member of quarantines it as any quarantine does: stored (its token
    revoked) and its update still waiting in an open round dropped, not only refused at its next request."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from blocktrain.coordinator.app import create_app
    from blocktrain.errors import ProtocolError
    from blocktrain.protocol.codes import Reason
    from tests.distributed_utils import FakeClock

    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=120, lease_seconds=600, min_updates=4,
                         agree_min=None, refusal_burst=0, audit_fraction=0.0)
    try:
        with TestClient(create_app(c, background=False)) as client:
            api = Api(c, client)
            for name in ("a", "b", "w2"):
                api.register(name, block=0)
            body = pack_delta(small_delta(c, seed=2), Compression.BF16, block=0, base_version=0,
                              base_sha=c.weights_sha[0], samples=4)
            assert api.push("w2", 0, body)[0] == 202  # accepted; the round waits for more
            upd: Any = SimpleNamespace(block=0, base_version=0)
            exc = ProtocolError(422, "the group's mean raised the held-out loss", Reason.GATE)
            c.uploads.refused("a", upd, ["a", "w2"], exc, 0.0)
            def pending() -> list[dict[str, Any]]:
                return c.store.q("SELECT state FROM updates WHERE worker='w2'")

            assert not c.store.conduct.quarantined("w2") and [u["state"] for u in pending()] == ["accepted"]
            c.uploads.refused("b", upd, ["b", "w2"], exc, 0.0)
            assert c.store.conduct.quarantined("w2") and "w2" in c.conduct.revoked
            assert [u["state"] for u in pending()] == ["dropped"], "the quarantined member's pending update still counts"
            assert c.store.q1("SELECT n_updates FROM rounds WHERE block=0 AND version=0") == {"n_updates": 0}
            assert not c.store.conduct.quarantined("a") and not c.store.conduct.quarantined("b")
            assert api.push("w2", 0, body)[0] == 403
    finally:
        c.close()


def test_quarantining_a_member_drops_the_group_mean_it_is_in(tmp_path: Path) -> None:
    """A group mean of a and m waits in an open round when m is quarantined: the mean is dropped (m's share of it
    cannot be told apart; it was applied), and a's own standing is untouched."""
    c = make_coordinator(tmp_path / "run", None, audit_fraction=0.0)
    try:
        s = c.store
        with s.tx():
            s.updates.record_update(0, 0, "a", samples=8, norm=1.0, compression="bf16", blob="0" * 64, arrived=0.0,
                                    arrival_s=0.0)
            s.updates.record_group(0, 0, "a", ["a", "m"])
            s.updates.record_update(0, 0, "b", samples=4, norm=1.0, compression="bf16", blob="1" * 64, arrived=0.0,
                                    arrival_s=0.0)
        c.conduct.quarantine("m", "a test", 0.0)
        assert s.q("SELECT worker, state FROM updates ORDER BY worker") == [
            {"worker": "a", "state": "dropped"}, {"worker": "b", "state": "accepted"}]
        assert not s.conduct.quarantined("a")
    finally:
        c.close()


def test_min_updates_waits_for_workers_not_yet_registered(tmp_path: Path) -> None:
    """--min-updates 3 with one worker registered: its push does not close the round (the other two have not joined
    yet, as when worker processes start one after another); the third registered worker's push does. The floor
    drops only for workers that can no longer count (refused, quarantined), not for those not there yet."""
    from fastapi.testclient import TestClient

    from blocktrain.coordinator.app import create_app
    from tests.distributed_utils import FakeClock

    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=120, lease_seconds=600, min_updates=3,
                         agree_min=None, refusal_burst=0, audit_fraction=0.0)
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)

        def push(name: str, seed: int) -> int:
            return api.push(name, 0, pack_delta(small_delta(c, scale=1e-3, seed=seed), Compression.BF16, block=0,
                                                base_version=0, base_sha=c.weights_sha[0], samples=4))[0]

        for i, name in enumerate(("a", "b", "c")):
            api.register(name, block=0)  # every registered worker has reported after its push: live <= reported
            assert push(name, i) == 202
            c.tick()
            assert c.version[0] == (1 if i == 2 else 0), f"after {i + 1} of 3 updates"
    c.close()


def test_a_trickling_upload_is_cut_at_the_upload_timeout(tmp_path: Path) -> None:
    """A body that has not arrived within upload_timeout_s is answered 408 ('slow'), so a slow client cannot hold a
    connection and its buffers for ever; the coordinator serves the next upload."""
    c = make_coordinator(tmp_path / "run", None, norm_k=0, upload_timeout_s=1.0)
    token = c.add_token("a")
    body = pack_delta(small_delta(c), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4)
    try:
        with ThreadServer(c, background=False) as srv:
            h = {"Authorization": f"Bearer {token}"}
            assert httpx.post(f"{srv.url}/v1/register", json={"block": 0}, headers=h, timeout=30).status_code == 200
            head = (f"POST /v1/blocks/0/updates HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                t0 = time.monotonic()
                s.sendall(head + body[:10])  # then nothing more: the rest never comes
                answer = s.recv(65536).decode(errors="replace")
                waited = time.monotonic() - t0
            assert answer.startswith("HTTP/1.1 408") and '"slow"' in answer, answer
            assert 0.9 < waited < 20
            r = httpx.post(f"{srv.url}/v1/blocks/0/updates", content=body, headers=h, timeout=30)
            assert r.status_code == 202, r.text
            assert get_status(srv.url)["rejections"] == {"slow": 1}
    finally:
        c.close()


def _cut_after(port: int, first: bytes, then: bytes = b"", every_s: float = 0.0) -> tuple[float, bytes]:
    """Send ``first``, then ``then`` a byte every ``every_s`` seconds; (seconds until the server answered or closed the
    connection, its first bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(first)
        got = b""
        try:
            for byte in then:
                s.settimeout(every_s)
                try:
                    got = s.recv(65536)
                    break
                except TimeoutError:  # nothing from the server yet: trickle on
                    s.sendall(bytes([byte]))
            else:
                s.settimeout(30)
                got = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            pass
        return time.monotonic() - t0, got


def test_a_request_head_that_trickles_or_grows_without_end_is_cut(tmp_path: Path) -> None:
    """uvicorn arms no timer before a connection's first response and cancels its keep-alive timer on every byte, and
    httptools takes headers of any size: a stranger could hold connections for ever (and at max_connections of them
    every worker's request is a 503). A head that stalls, trickles a byte every 0.3 s, or passes 64 KiB is now cut
    (at head_timeout_s, here 1 s), and so is a small JSON body that trickles; the coordinator then serves a worker."""
    c = make_coordinator(tmp_path / "run", None, head_timeout_s=1.0)
    token = c.add_token("a")
    try:
        with ThreadServer(c, background=False) as srv:
            waited, _ = _cut_after(srv.port, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")  # then nothing
            assert 0.9 < waited < 10, waited
            waited, _ = _cut_after(srv.port, b"GET /v1/status HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200, 0.3)
            assert 0.9 < waited < 10, waited
            waited, _ = _cut_after(srv.port, b"GET /v1/status HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70_000)
            assert waited < 10, waited
            body = b'{"block": 0}'
            head = (f"POST /v1/register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            waited, answer = _cut_after(srv.port, head + body[:1], body[1:], 0.3)  # 11 more bytes in 3.3 s
            assert waited < 3 and answer.startswith(b"HTTP/1.1 400"), (waited, answer)
            # a body answered at its head (413: over the cap for this route), then trickled for ever: the rest of it
            # must arrive within 6 x head_timeout_s (nothing bounded it once its answer was sent)
            big = (f"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {10**9}\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                s.sendall(big)
                assert s.recv(65536).startswith(b"HTTP/1.1 413")
                t0, closed = time.monotonic(), False
                while time.monotonic() - t0 < 20 and not closed:
                    try:
                        s.sendall(b"x")
                        s.settimeout(0.5)
                        closed = s.recv(1) == b""
                    except TimeoutError:
                        continue
                    except (ConnectionResetError, BrokenPipeError):
                        closed = True
                assert closed and 5 < time.monotonic() - t0 < 15, time.monotonic() - t0
            h = {"Authorization": f"Bearer {token}"}
            assert httpx.post(f"{srv.url}/v1/register", json={"block": 0}, headers=h, timeout=30).status_code == 200
            assert httpx.get(f"{srv.url}/v1/status", timeout=30).status_code == 200
    finally:
        c.close()


def test_the_upload_limits_reject_bad_values() -> None:
    for bad in ({"upload_timeout_s": 0.0}, {"upload_timeout_s": math.inf}, {"max_connections": 0}):
        with pytest.raises(ConfigError, match="--upload-timeout-s, --max-connections"):
            CoordinatorSettings(**bad)  # type: ignore[arg-type]


def test_a_worker_quarantined_while_its_push_is_checked_is_refused_at_acceptance(tmp_path: Path) -> None:
    """A worker sends a good push and, at the same time, pushes that get it quarantined: the quarantine lands while
    the good push is in its unlocked checks. The good push is refused when it is recorded (403), so it is never
    applied and dodges no audit. Without the check at acceptance it is accepted (202) from a quarantined worker."""
    from fastapi.testclient import TestClient

    from blocktrain.coordinator.app import create_app

    c = make_coordinator(tmp_path / "run", None, round_seconds=120, lease_seconds=600, agree_min=None,
                         refusal_burst=0, audit_fraction=0.0)
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)
        api.register("evil", block=0)
        check = c.intake.check

        def quarantined_meanwhile(*args: Any, **kw: Any) -> Any:
            out = check(*args, **kw)
            with c.lock:  # what its concurrent refused pushes do, under the lock, while this one is unlocked
                c.conduct.quarantine("evil", "three refused updates", c.clock())
            return out

        c.intake.check = quarantined_meanwhile  # type: ignore[method-assign]
        status, doc = api.push("evil", 0, pack_delta(small_delta(c), Compression.BF16, block=0, base_version=0,
                                                     base_sha=c.weights_sha[0], samples=4))
        assert status == 403 and "quarantined while its update was checked" in str(doc["detail"]), doc
        assert c.store.q("SELECT * FROM updates WHERE worker='evil' AND state='accepted'") == []
    c.close()


def test_a_push_refused_at_acceptance_does_not_hold_its_round(tmp_path: Path) -> None:
    """Two workers send one delta at once: both pass the unlocked checks, the first is accepted, and the second is
    refused at acceptance as its replay (422). The round stops waiting for the second worker, as for a refusal in the
    checks; it waited for it until the deadline."""
    from fastapi.testclient import TestClient

    from blocktrain.coordinator.app import create_app

    c = make_coordinator(tmp_path / "run", None, round_seconds=120, lease_seconds=600, agree_min=None,
                         refusal_burst=0, audit_fraction=0.0, min_updates=2)
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)
        for name in ("a", "b", "c"):
            api.register(name, block=0)
        body = pack_delta(small_delta(c), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0],
                          samples=4)
        check = c.intake.check

        def a_copy_lands_meanwhile(*args: Any, **kw: Any) -> Any:
            out = check(*args, **kw)
            c.intake.check = check  # type: ignore[method-assign]
            assert c.submit("a", 0, body).accepted  # while b's copy is in its unlocked checks
            return out

        c.intake.check = a_copy_lands_meanwhile  # type: ignore[method-assign]
        status, doc = api.push("b", 0, body)
        assert status == 422 and doc["error"] == "replay", doc
        assert c.store.rounds.refused(0, 0) == {"b"}
    c.close()


def test_a_second_quarantine_keeps_the_first(api: Api) -> None:  # noqa: F811
    """A worker quarantined twice (a failed audit decided after its refusals had quarantined it) keeps its first
    record: the second rewrote it without the revoked token's hash (its token then got 401, not 403) and counted it
    twice."""
    h = api.h("x")
    with api.c.lock:
        api.c.conduct.quarantine("x", "three refused updates", api.c.clock())
        api.c.conduct.quarantine("x", "failed audit", api.c.clock())
    assert api.c.store.conduct.quarantined_workers() == {"x": "three refused updates"}
    assert api.c.store.q("SELECT value FROM counters WHERE key='workers_quarantined'") == [{"value": 1}]
    api.c.tokens._last_reload = float("-inf")
    api.c.tick()  # the token table re-read: the token is gone from it, its quarantine says why
    r = api.client.get("/v1/work", headers=h)
    assert r.status_code == 403 and "quarantined" in r.text


def test_a_made_up_token_is_refused_without_waiting_for_the_lock(api: Api,  # noqa: F811
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A stranger's made-up tokens are answered 401 from the token cache while the coordinator's lock is held (a round
    closing, an evaluation): each waited for the lock and queried the database, so a flood of them held every
    worker's requests. A quarantined worker's token gets its 403 likewise. A token added by another process while the
    lock is held is found by a re-read of the table on the store's second connection, without the lock."""
    import threading

    from blocktrain.cli.main import main
    from blocktrain.errors import ProtocolError

    h = api.h("q")
    token = h["Authorization"].removeprefix("Bearer ")
    with api.c.lock:
        api.c.conduct.quarantine("q", "three refused updates", api.c.clock())
    capsys.readouterr()
    assert main(["token", "add", "fresh", "--run-dir", str(api.c.run.root)]) == 0  # another process: not cached yet
    fresh = capsys.readouterr().out.strip()
    assert api.c.worker_for_token(fresh) is None
    api.c.tokens._last_reload = time.monotonic()  # just re-read
    held, done = threading.Event(), threading.Event()
    answers: list[int] = []
    names: list[str] = []

    def hold() -> None:
        with api.c.lock:
            held.set()
            done.wait(30)

    def ask() -> None:
        for t in ("made-up", token, ""):
            try:
                api.c.authenticate(t)
            except ProtocolError as exc:
                answers.append(exc.status)
        api.c.tokens._last_reload = float("-inf")  # a re-read is due
        names.append(api.c.authenticate(fresh))

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(5)
    waited = asker.is_alive()  # still waiting for the lock the holder keeps
    done.set()
    holder.join(10)
    asker.join(10)
    assert not waited and answers == [401, 403, 401] and names == ["fresh"], (waited, answers, names)


@pytest.mark.parametrize("window", [0, 5])
def test_a_refusal_stops_counting_toward_quarantine_once_its_worker_has_had_window_updates_applied(
        tmp_path: Path, window: int) -> None:
    """Counted refusals never decayed: an honest worker's rare refused pushes (1 of 1,200 in a depth-proxy row of
    averaging-scaling.json) added up over a long run until it was quarantined. A refusal now stops counting once its
    worker has had quarantine_window updates applied since (0: never)."""
    from blocktrain.coordinator.settings import UpdateState
    from blocktrain.protocol.codes import Reason

    c = make_coordinator(tmp_path / "run", None, quarantine_after=3, quarantine_window=window)
    t = [0.0]

    def refuse() -> bool:
        t[0] += 1
        with c.lock, c.store.tx():
            c.store.conduct.record_rejection("x", 0, 422, Reason.GATE, "refused", t[0])
        with c.lock:
            return c.conduct.refused("x", Reason.GATE, t[0])

    def applied(n: int) -> None:
        with c.lock, c.store.tx():
            for _ in range(n):
                t[0] += 1
                c.store.db.execute(
                    "INSERT INTO updates(block, version, worker, samples, norm, compression, blob, arrived, arrival_s, "
                    "state) VALUES(0, ?, 'x', 1, 1.0, 'none', 'b', ?, 0.0, ?)", (int(t[0]), t[0], UpdateState.APPLIED.value))

    assert not refuse() and not refuse()
    applied(4)
    if window:
        with c.lock:  # one short of the window: both still count
            assert c.store.conduct.counted_refusals("x", (Reason.GATE,), window) == 2
    applied(1)
    assert refuse() == (window == 0)  # 5 applied since: the first two no longer count (with a window)
    if window:
        assert not refuse() and refuse()  # three within the window quarantine it
    assert c.store.conduct.quarantined("x")
    plan = c.store.q("EXPLAIN QUERY PLAN SELECT arrived FROM updates WHERE worker='x' AND state='applied' "
                     "ORDER BY arrived DESC LIMIT 1 OFFSET 4")  # under the lock at every counted refusal: no scan
    assert any("updates_by_worker_state" in str(r["detail"]) for r in plan), plan
    c.close()
