"""The coordinator decides what an update is worth: every defence of the intake, attacked over HTTP.

Each test sends what an admitted hostile worker could send through the coordinator's routes and fails without its
defence: a claim above the assigned budget, a delta that names another base, a replayed or relabelled delta, a lazy
(zero) delta, a delta that points away from the round's others, refusals that go on (quarantine, then 429), and a
message of another protocol version.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.checkpoint.safetensors_io import RESERVED, unpack
from blocktrain.coordinator.app import create_app
from blocktrain.coordinator.intake import MAD_TO_SIGMA, Checked, Intake, Published, replay_cosine
from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ProtocolError
from blocktrain.protocol.delta import Compression, pack_delta
from blocktrain.protocol.messages import PROTOCOL_VERSION, WorkAnswer, parse_meta
from tests.distributed_utils import FakeClock, corpus, make_coordinator, one_row  # noqa: F401


class Peer:
    """One admitted worker speaking the protocol over a TestClient."""

    def __init__(self, c: Coordinator, client: TestClient, name: str) -> None:
        self.c, self.client, self.name = c, client, name
        self.headers = {"Authorization": f"Bearer {c.add_token(name)}"}

    def register(self, block: int = 0) -> None:
        r = self.client.post("/v1/register", json={"block": block}, headers=self.headers)
        assert r.status_code == 200, r.text

    def work(self) -> WorkAnswer:
        r = self.client.get("/v1/work", headers=self.headers)
        assert r.status_code == 200, r.text
        return WorkAnswer.model_validate(r.json())

    def push(self, delta: dict[str, torch.Tensor], samples: int | None = None, *, version: int | None = None,
             sha: str | None = None) -> tuple[int, str]:
        w = self.work()
        body = pack_delta(delta, Compression.INT8, block=0, base_version=w.version if version is None else version,
                          base_sha=sha or w.weights_sha, samples=w.sequences if samples is None else samples)
        r = self.client.post("/v1/blocks/0/updates", content=body, headers=self.headers)
        return r.status_code, str(r.json().get("error", ""))


def registered(c: Coordinator, client: TestClient, n: int) -> list[Peer]:
    """Peers p0..p{n-1}, each registered on block 0."""
    peers = [Peer(c, client, f"p{i}") for i in range(n)]
    for p in peers:
        p.register()
    return peers


def direction(c: Coordinator, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in c.shapes.items()}


def near(base: dict[str, torch.Tensor], seed: int, noise: float = 0.3) -> dict[str, torch.Tensor]:
    """An honest-looking delta: the round's common direction plus its own noise."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + noise * t.abs().mean() * torch.randn(t.shape, generator=g) for n, t in base.items()}


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=30, lease_seconds=60)
    yield c
    c.close()


def peers(c: Coordinator, client: TestClient, n: int) -> list[Peer]:
    out = [Peer(c, client, f"w{i}") for i in range(n)]
    for p in out:
        p.register()
    return out


def test_the_work_answer_assigns_a_budget_and_a_claim_above_it_is_refused(coord: Coordinator) -> None:
    with TestClient(create_app(coord, background=False)) as client:
        a, _ = peers(coord, client, 2)
        w = a.work()
        assert (w.steps, w.batch, w.protocol) == (coord.settings.local_steps, coord.cfg.train.batch_size, PROTOCOL_VERSION)
        assert a.push(direction(coord, 0), samples=w.sequences + 1) == (422, "claim")
        assert a.push(direction(coord, 0), samples=1 << 30) == (422, "claim")
        assert a.push(direction(coord, 0), samples=w.sequences) == (202, "")  # its whole budget: accepted
        assert one_row(coord.store, "SELECT samples FROM updates WHERE worker='w0'")["samples"] == w.sequences


def test_a_delta_that_names_another_base_is_refused(coord: Coordinator) -> None:
    with TestClient(create_app(coord, background=False)) as client:
        (a,) = peers(coord, client, 1)
        assert a.push(direction(coord, 0), sha="0" * 64) == (409, "base")
        assert a.push(direction(coord, 0), version=3) == (409, "stale")


def test_a_replayed_or_relabelled_delta_is_refused(coord: Coordinator) -> None:
    with TestClient(create_app(coord, background=False)) as client:
        a, b = peers(coord, client, 2)
        base = direction(coord, 0)
        d = near(base, 1)
        assert a.push(d) == (202, "")
        assert b.push(d) == (422, "replay")  # another worker's accepted delta, same round
        assert b.push({n: 1.01 * t for n, t in d.items()}) == (422, "replay")  # scaled: the same direction
        assert b.push(near(base, 2)) == (202, "")  # honest: the common direction with its own noise
        assert coord.version[0] == 1
        assert a.push(d) == (422, "replay")  # its own accepted delta again, relabelled as version 1


def test_a_lazy_delta_is_refused_once_norms_are_known(coord: Coordinator) -> None:
    with TestClient(create_app(coord, background=False)) as client:
        a, b, lazy = peers(coord, client, 3)
        base = direction(coord, 0)
        assert a.push(near(base, 1)) == (202, "")
        assert b.push(near(base, 2)) == (202, "")
        assert lazy.push({n: torch.zeros_like(t) for n, t in base.items()}) == (422, "lazy")
        assert lazy.push({n: 1e-3 * t for n, t in base.items()}) == (422, "lazy")  # tiny
        # a worker that trained a tenth of its budget (a deadline push) may move a tenth as far
        assert lazy.push({n: 0.1 * t for n, t in near(base, 3).items()}, samples=lazy.work().sequences // 10) == (202, "")


def test_an_update_that_points_away_from_the_round_is_dropped_at_its_close(coord: Coordinator) -> None:
    with TestClient(create_app(coord, background=False)) as client:
        ws = peers(coord, client, 4)
        base = direction(coord, 0)
        w0 = {n: t.clone() for n, t in coord.weights[0].items()}
        for i, p in enumerate(ws[:3]):
            assert p.push(near(base, i)) == (202, "")
        assert ws[3].push({n: -t for n, t in near(base, 9).items()}) == (202, "")  # a sign flip passes the intake
        assert coord.version[0] == 1
        states = {r["worker"]: r["state"] for r in coord.store.q("SELECT worker, state FROM updates")}
        assert states == {"w0": "applied", "w1": "applied", "w2": "applied", "w3": "screened"}
        assert coord.store.conduct.counted_refusals("w3", ("screened",)) == 1
        moved = sum(float(((coord.weights[0][n] - w0[n]) * base[n]).sum()) for n in base)
        assert moved > 0  # the published step went the honest way


def test_repeated_refusals_quarantine_the_worker_and_drop_its_pending_update(tmp_path: Path) -> None:
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=30, quarantine_after=3)
    with TestClient(create_app(c, background=False)) as client:
        honest, bad = peers(c, client, 2)
        base = direction(c, 0)
        assert bad.push(near(base, 5)) == (202, "")  # accepted, waiting for its round
        rnd = c.store.rounds.round(0, 0)
        assert rnd is not None and rnd.n_updates == 1
        for _ in range(3):
            assert bad.push(near(base, 6), samples=1 << 30) in {(422, "claim"), (409, "duplicate")}
        # three claims: quarantined, its token revoked, its pending update dropped from the round
        assert c.store.conduct.quarantined("w1")
        rnd = c.store.rounds.round(0, 0)
        assert rnd is not None and rnd.n_updates == 0
        r = client.get("/v1/work", headers=bad.headers)
        assert r.status_code == 403 and r.json()["error"] == "quarantined"
        assert honest.push(near(base, 7)) == (202, "")
        assert c.version[0] == 1  # closed by the honest worker alone: the quarantined one left the round
        assert {r["worker"] for r in c.store.q("SELECT worker FROM updates WHERE state='applied'")} == {"w0"}
    c.close()


def test_refused_requests_are_rate_limited_per_token(tmp_path: Path) -> None:
    c = make_coordinator(tmp_path / "run", None, quarantine_after=0, refusal_burst=3, refusal_window_s=60)
    with TestClient(create_app(c, background=False)) as client:
        (bad,) = peers(c, client, 1)
        for _ in range(3):
            assert bad.push(direction(c, 0), samples=1 << 30) == (422, "claim")
        assert bad.push(direction(c, 0)) == (429, "rate_limited")  # even a good one, until the window passes
        assert client.get("/v1/status").json()["rate_limited"] == 1
    c.close()


def test_a_rate_limited_push_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    """A worker over its refusal rate announces a body under the cap and sends none of it: it is answered 429 at once, not
    after its body's upload_timeout_s (the body was read and inflated before the rate limit was checked). The body
    it then sends is dropped without counting as the next request's head (the head guard cut it at 64 KiB)."""
    import socket
    import time

    from tests.distributed_utils import ThreadServer

    c = make_coordinator(tmp_path / "run", None, quarantine_after=0, refusal_burst=3, refusal_window_s=60,
                         upload_timeout_s=20.0)
    with TestClient(create_app(c, background=False)) as client:
        (bad,) = peers(c, client, 1)
        for _ in range(3):
            assert bad.push(direction(c, 0), samples=1 << 30) == (422, "claim")
    with ThreadServer(c, background=False) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall((f"POST /v1/blocks/0/updates HTTP/1.1\r\nHost: x\r\nAuthorization: {bad.headers['Authorization']}\r\n"
                   f"Content-Type: application/octet-stream\r\nContent-Length: {c.max_body_bytes // 2}\r\n\r\n").encode())
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 429") and time.monotonic() - t0 < 10, answer
        # the body it announced still comes (more than a head may take): it is dropped, and is no head
        s.sendall(b"\0" * (c.max_body_bytes // 2) + b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")  # the next request on the same connection is served
    c.close()


def test_messages_are_typed_bounded_and_versioned(coord: Coordinator) -> None:
    with TestClient(create_app(coord, background=False)) as client:
        p = Peer(coord, client, "a")
        r = client.post("/v1/register", json={"block": 0, "protocol": PROTOCOL_VERSION - 1}, headers=p.headers)
        assert r.status_code == 426 and r.json()["error"] == "protocol"
        r = client.post("/v1/register", json={"block": 0, "extra": 1}, headers=p.headers)
        assert r.status_code == 422
    sha = coord.weights_sha[0]
    body = pack_delta(direction(coord, 0), Compression.INT8, block=0, base_version=2, base_sha=sha, samples=4)
    _, full = unpack(body)
    meta = {k: v for k, v in full.items() if k not in RESERVED}  # the update's own fields, under the file's header
    assert meta == {
        "protocol": str(PROTOCOL_VERSION), "kind": "delta", "block_index": "0", "base_version": "2", "base_sha": sha,
        "samples": "4", "compression": "int8", "precision": "fp32"}
    from blocktrain.errors import ProtocolError

    for bad, field in (({"samples": "0"}, "samples"), ({"base_sha": "x"}, "base_sha"), ({"extra": "1"}, "extra")):
        with pytest.raises(ProtocolError) as exc:
            parse_meta({**meta, **bad})
        assert exc.value.status == 422 and field in str(exc.value)


def test_the_gate_tolerance_is_calibrated_from_accepted_rises() -> None:
    s = CoordinatorSettings(gate_floor=0.01, gate_z=6.0, gate_min_history=4)
    intake = Intake(s, {0: {"w": (2,)}}, None)
    assert intake.tolerance(0) == s.gate_start == 0.1  # too few rises known: the loose start
    rises = [-0.2, -0.1, 0.05, -0.15, -0.12, 0.3]
    for r in rises:  # accepted updates' loss rises, as the gate measured them
        intake.remember(0, Checked(1.0, torch.zeros(s.sketch_dim), (1.0, 1.0 + r)))
    med = statistics.median(rises)
    want = med + 6.0 * MAD_TO_SIGMA * statistics.median(abs(r - med) for r in rises)
    assert intake.tolerance(0) == pytest.approx(max(0.01, want))
    assert Intake(CoordinatorSettings(gate_tolerance=0.5), {0: {"w": (2,)}}, None).tolerance(0) == 0.5


def test_a_push_held_for_its_audit_counts_its_norm_and_rise_only_once_the_audit_passed() -> None:
    """A push drawn for audit is remembered as held: its sketch counts at once (a copy is a replay whatever the audit
    decides), its norm and loss rise only once its audit passed; a failed one leaves neither behind."""
    s = CoordinatorSettings()
    intake = Intake(s, {0: {"w": (8,)}}, None)
    base = Published(0, 0, "0" * 64, {"w": torch.zeros(8)})
    g = torch.Generator().manual_seed(0)
    deltas = [{"w": torch.randn(8, generator=g)} for _ in range(3)]
    intake.remember(0, Checked(1.0, intake.sketch(0, deltas[0]), (1.0, 1.05)))  # not audited: counts at once
    intake.remember(0, Checked(9.0, intake.sketch(0, deltas[1]), (1.0, 1.5)), held=("bad", 0, 0))
    intake.remember(0, Checked(2.0, intake.sketch(0, deltas[2]), (1.0, 1.1)), held=("good", 0, 0))
    view = intake.view(base)
    assert view.norms == (1.0,) and list(intake._rises[0]) == pytest.approx([0.05])
    assert view.sketches is not None and view.sketches.shape[0] == 3
    with pytest.raises(ProtocolError) as info:  # the held push's copy is a replay already
        intake.check_replay(0, intake.sketch(0, deltas[1]))
    assert info.value.reason == "replay"
    intake.release(("bad", 0, 0), passed=False)
    intake.release(("good", 0, 0), passed=True)
    intake.release(("never", 0, 0), passed=True)  # a key it never held: no-op
    assert intake.view(base).norms == (1.0, 2.0) and list(intake._rises[0]) == pytest.approx([0.05, 0.1])
    intake.hold(("restored", 0, 0), 0, 3.0)  # an audit restored after a restart: its norm held again, no rise stored
    intake.release(("restored", 0, 0), passed=True)
    assert intake.view(base).norms == (1.0, 2.0, 3.0) and len(intake._rises[0]) == 2


def test_a_near_duplicate_checked_on_a_snapshot_taken_before_its_original_was_accepted_is_refused() -> None:
    """The checks of an update run unlocked on a snapshot of its block's history (:class:`IntakeView`). A copy of an
    update, checked on a snapshot taken before that update was accepted, passes the snapshot's replay check; the
    check under the lock that accepts it, against every sketch accepted by then, refuses it. Later appends never
    change a snapshot taken before them."""
    intake = Intake(CoordinatorSettings(), {0: {"w": (64,)}}, None)
    g = torch.Generator().manual_seed(0)
    sketches = [intake.sketch(0, {"w": torch.randn(64, generator=g)}) for _ in range(20)]
    for sk in sketches[:15]:
        intake.remember_sketch(0, sk)
    base = Published(0, 0, "0" * 64, {"w": torch.zeros(64)})
    view = intake.view(base)  # taken under the lock, before the original is accepted
    assert view.sketches is not None and view.sketches.shape[0] == 15
    original = sketches[15]
    intake.remember_sketch(0, original)  # another thread accepts the original
    for sk in sketches[16:]:
        intake.remember_sketch(0, sk)  # the buffer grows past its capacity: the snapshot must not change
    assert view.sketches.shape[0] == 15 and torch.equal(view.sketches, torch.stack(sketches[:15]))
    cosine = replay_cosine(0, original.clone(), view.sketches, intake.settings)
    assert cosine is not None and cosine < 0.9  # the stale snapshot lets it pass
    with pytest.raises(ProtocolError) as info:  # the near-duplicate's check under the lock that would accept it
        intake.check_replay(0, original.clone())  # a copy (a scaled copy has the same unit sketch)
    assert info.value.status == 422 and info.value.reason == "replay"

def test_a_near_duplicate_sent_while_its_original_is_being_accepted_is_refused(tmp_path: Path) -> None:
    """Two tokens, two threads, one coordinator: b sends a scaled copy of a's update; b's checks run (unlocked, on
    their snapshot) while a's update is accepted. The check under the lock that would accept b's copy refuses it,
    and the round holds one update."""
    import threading

    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=30, lease_seconds=60,
                         min_updates=3, gate=False, audit_fraction=0.0)
    try:
        for name in ("a", "b", "c"):
            c.add_token(name)
            c.register(name, 0)
        original = direction(c, 1)
        copy = {n: 1.0001 * t for n, t in original.items()}
        sha = c.weights_sha[0]
        bodies = {n: pack_delta(d, Compression.INT8, block=0, base_version=0, base_sha=sha, samples=4)
                  for n, d in (("a", original), ("b", copy))}
        checking, accepted = threading.Event(), threading.Event()
        check = c.intake.check

        def check_then_wait(*args: Any, **kwargs: Any) -> Checked:
            out = check(*args, **kwargs)
            if threading.current_thread().name == "b":  # b's checks passed on a snapshot without a's update
                checking.set()
                assert accepted.wait(30)
            return out

        c.intake.check = check_then_wait  # type: ignore[method-assign]
        outcome: dict[str, object] = {}

        def push_b() -> None:
            try:
                outcome["b"] = c.submit("b", 0, bodies["b"])
            except ProtocolError as exc:
                outcome["b"] = exc

        t = threading.Thread(target=push_b, name="b")
        t.start()
        assert checking.wait(30)
        assert c.submit("a", 0, bodies["a"]).accepted  # a's update is accepted while b's copy waits after its checks
        accepted.set()
        t.join(30)
        assert isinstance(outcome["b"], ProtocolError) and outcome["b"].reason == "replay", outcome
        assert [r["worker"] for r in c.store.q("SELECT worker FROM updates")] == ["a"]
    finally:
        c.close()


def test_a_delta_whose_held_out_loss_is_nan_is_refused_by_the_gate() -> None:
    """A finite delta can overflow the forward (a huge LayerNorm weight): its held-out loss is NaN, which compares
    False with any bound, so ``after > before + tol`` let it through."""

    class Evaluator:
        valid = True  # a held-out split is there

        def gate_loss(self, k: int, weights: dict[str, torch.Tensor], frozen: object) -> float:
            return float("nan") if float(weights["w"].abs().max()) > 1e30 else 2.0

    intake = Intake(CoordinatorSettings(), {0: {"w": (8,)}}, Evaluator())  # type: ignore[arg-type]
    base = Published(0, 0, "0" * 64, {"w": torch.zeros(8)})
    view = intake.view(base)
    assert view.before == 2.0
    assert intake._gate(base, {"w": torch.full((8,), 1e-3)}, view) == (2.0, 2.0)
    with pytest.raises(ProtocolError) as info:
        intake._gate(base, {"w": torch.full((8,), 3e38)}, view)
    assert info.value.reason == "gate" and "nan" in str(info.value)
    broken = Published(0, 1, "1" * 64, {"w": torch.full((8,), 3e38)})  # published weights whose own loss is NaN
    assert intake.view(broken).before is None  # the gate is off for them, rather than refusing every push


def test_pushes_claiming_a_sample_or_two_do_not_drag_the_norm_median_down(tmp_path: Path) -> None:
    """Colluders push tiny deltas claiming one sample each: the lazy check lets them through (its floor scales with
    the claim), and if their norms joined the block's history its median would fall until honest pushes were refused
    as NORM (three refusals quarantine). Only pushes claiming at least half their budget join the history."""
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=3600, min_updates=8, gate=False,
                         audit_fraction=0.0)
    try:
        with TestClient(create_app(c, background=False)) as client:
            peers = registered(c, client, 5)
            for i, p in enumerate(peers[:3]):
                assert p.push(direction(c, 10 + i, scale=1e-9), samples=1) == (202, "")
            for i, p in enumerate(peers[3:]):  # honest pushes, full claims: judged against no tiny median
                assert p.push(direction(c, 20 + i)) == (202, ""), "an honest push was refused"
        assert len(c.intake._norms[0]) == 2
    finally:
        c.close()
    again = make_coordinator(tmp_path / "run", None, clock=FakeClock(), round_seconds=3600, min_updates=8, gate=False,
                             audit_fraction=0.0)
    try:  # a restart restores the honest norms alone
        assert len(again.intake._norms[0]) == 2
    finally:
        again.close()


def test_a_restart_keeps_the_gate_s_calibration_and_every_fingerprint(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """A restarted coordinator's gate went back to its loose start (0.1 nats) until 8 new rises were known, and it
    forgot the sketches of updates dropped with their quarantined worker, so a copy of a cheat's delta was no longer
    a replay. The rises are stored with their updates, and every update ever accepted is fingerprinted again."""
    settings: dict[str, Any] = dict(round_seconds=3600, min_updates=8, audit_fraction=0.0, gate_min_history=2)
    c = make_coordinator(tmp_path / "run", corpus, clock=FakeClock(), **settings)
    cheat = direction(c, 99)
    try:
        with TestClient(create_app(c, background=False)) as client:
            peers = registered(c, client, 4)
            for i, p in enumerate(peers[:3]):
                assert p.push(direction(c, 30 + i)) == (202, "")
            assert peers[3].push(cheat) == (202, "")
            with c.lock:
                c.conduct.quarantine("p3", "caught later", c.clock())  # its update dropped before its round closed
            rises = list(c.intake._rises[0])  # the cheat's too: a running coordinator keeps what it counted
            assert len(rises) == 4 and c.intake.tolerance(0) != c.settings.gate_start
    finally:
        c.close()
    again = make_coordinator(tmp_path / "run", corpus, clock=FakeClock(), **settings)
    try:
        assert list(again.intake._rises[0]) == pytest.approx(rises[:3])  # the honest ones: a dropped update's is not
        assert again.intake.tolerance(0) != again.settings.gate_start  # calibrated, not the loose start
        with TestClient(create_app(again, background=False)) as client:
            colluder = Peer(again, client, "colluder")
            colluder.register()
            assert colluder.push({n: 1.0001 * t for n, t in cheat.items()}) == (422, "replay")
    finally:
        again.close()


def test_a_restart_reads_the_stored_sketches_not_the_deltas(tmp_path: Path, corpus: DataDir,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart decoded every delta the run ever accepted, all held in memory at once, to sketch them again: a long
    run's restart grew with it and could run out of memory. Each accepted update's sketch is now stored with it and
    read back (32 KiB each); a row from before (no sketch) or of another --sketch-dim has its delta sketched again,
    one at a time. Either way the replay check knows every delta again."""
    from blocktrain.coordinator import rounds

    settings: dict[str, Any] = dict(round_seconds=3600, min_updates=8, audit_fraction=0.0, gate=False)
    c = make_coordinator(tmp_path / "run", corpus, clock=FakeClock(), **settings)
    deltas = [direction(c, 40 + i) for i in range(3)]
    try:
        with TestClient(create_app(c, background=False)) as client:
            for p, d in zip(registered(c, client, 3), deltas, strict=True):
                assert p.push(d) == (202, "")
        live = c.intake._sketches[0].rows()
        assert live is not None and live.shape[0] == 3
        stored = [str(r["sketch"]) for r in c.store.q("SELECT sketch FROM updates ORDER BY id")]
    finally:
        c.close()

    def restart(**knobs: Any) -> torch.Tensor:
        again = make_coordinator(tmp_path / "run", corpus, clock=FakeClock(), **{**settings, **knobs})
        try:
            got = again.intake._sketches[0].rows()
            assert got is not None
            return got.clone()
        finally:
            again.close()

    with monkeypatch.context() as m:
        m.setattr(rounds, "decode_delta", lambda *a: pytest.fail("a restart decoded a delta it had the sketch of"))
        assert torch.equal(restart(), live)
    c2 = make_coordinator(tmp_path / "run", corpus, clock=FakeClock(), **settings)
    with c2.lock, c2.store.tx():
        c2.store.db.execute("UPDATE updates SET sketch=NULL WHERE sketch=?", (stored[1],))  # a row from before
    c2.close()
    torch.testing.assert_close(restart(), live, atol=1e-6, rtol=0)  # the old row's delta is sketched again
    assert restart(sketch_dim=1024).shape == (3, 1024)  # another dimension: every delta sketched again
