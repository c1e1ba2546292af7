"""In-process API tests of the coordinator (FastAPI TestClient, no sockets)."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar, cast

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.coordinator.app import create_app
from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import Aggregation, OuterOptimizer
from blocktrain.data.dataset import DataDir
from blocktrain.protocol.delta import Compression, decode_delta, pack_delta, wire_schema
from blocktrain.protocol.weights import apply_step
from tests.distributed_utils import NO_SCREEN, FakeClock, block_weights, corpus, full, make_coordinator, one_row  # noqa: F401

T = TypeVar("T")


def small_delta(c: Coordinator, scale: float = 1e-3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in c.shapes.items()}


class Api:
    """A TestClient bound to one coordinator, with one token per worker name."""

    def __init__(self, c: Coordinator, client: TestClient) -> None:
        self.c = c
        self.client = client
        self.tokens: dict[str, str] = {}

    def h(self, name: str) -> dict[str, str]:
        if name not in self.tokens:
            self.tokens[name] = self.c.add_token(name)
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def register(self, name: str, block: int | None = None) -> int:
        r = self.client.post("/v1/register", json={"block": block}, headers=self.h(name))
        assert r.status_code == 200, r.text
        return int(r.json()["block"])

    def push(self, name: str, k: int, body: bytes) -> tuple[int, dict[str, object]]:
        r = self.client.post(f"/v1/blocks/{k}/updates", content=body, headers=self.h(name))
        return r.status_code, r.json()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def api(tmp_path: Path, clock: FakeClock) -> Iterator[Api]:
    c = make_coordinator(tmp_path / "run", None, clock=clock, round_seconds=30, lease_seconds=10, aggregation=Aggregation.MEAN,
                         **NO_SCREEN)  # the arithmetic of the sample-weighted mean, checked by hand below
    with TestClient(create_app(c, background=False)) as client:
        yield Api(c, client)
    c.close()


def test_assignment_fewest_live_replicas_and_override(api: Api) -> None:
    got = [api.register(f"w{i}") for i in range(6)]
    assert got == [0, 1, 2, 3, 0, 1]
    assert api.register("pinned", block=3) == 3
    assert api.register("w7") == 2  # blocks 2 and 3 now: 1 and 2 live replicas -> 2
    r = api.client.post("/v1/register", json={"block": 9}, headers=api.h("bad"))
    assert r.status_code == 422 and "does not exist" in r.json()["detail"]


def test_a_body_its_model_refuses_is_answered_after_the_token_as_every_refusal(api: Api) -> None:
    """FastAPI parses a route's JSON body before the handler runs, so a stranger with a bad body got its 422 (and the
    schema's field names) in FastAPI's own format, never a 401; the token is now checked first, and the refusal is an
    ErrorBody like every other."""
    for body in (b"{not json", b'{"block": -1}', b'{"block": "two"}'):
        r = api.client.post("/v1/register", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"] == "auth", r.text
        r = api.client.post("/v1/register", content=body, headers={**api.h("w0"), "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "metadata" and "/docs" in r.json()["detail"], r.text
    assert "block" in r.json()["detail"]


def test_auth_required_and_tokens_stored_hashed(api: Api) -> None:
    assert api.client.post("/v1/register", json={}).status_code == 401
    r = api.client.get("/v1/work", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "token add" in r.json()["detail"]
    row = api.c.store.q1("SELECT hash FROM tokens WHERE name='x'")
    assert row is None
    api.h("x")
    stored = one_row(api.c.store, "SELECT hash FROM tokens WHERE name='x'")["hash"]
    assert api.tokens["x"] not in stored and len(stored) == 64  # stored hashed


def test_a_token_replaced_or_revoked_by_another_process_stops_working_at_the_next_refresh(
        api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    """``blocktrain token add`` (a rotation) and ``token revoke`` run beside the coordinator: once its tick re-reads the
    table (every TOKEN_REFRESH_SECONDS; forced here), the old token is refused; before, a cached token stayed valid
    until a restart."""
    from blocktrain.cli.main import main

    run = str(api.c.run.root)
    old = api.h("x")
    assert api.client.get("/v1/work", headers=old).status_code in (200, 409)
    assert main(["token", "add", "x", "--run-dir", run]) == 0  # rotated
    new = {"Authorization": f"Bearer {capsys.readouterr().out.strip()}"}
    api.c.tokens._last_reload = float("-inf")  # the refresh is due
    api.c.tick()
    assert api.client.get("/v1/work", headers=old).status_code == 401
    assert api.client.post("/v1/register", json={}, headers=new).status_code == 200
    assert main(["token", "revoke", "x", "--run-dir", run]) == 0
    assert main(["token", "revoke", "x", "--run-dir", run]) == 1  # nothing left to revoke
    api.c.tokens._last_reload = float("-inf")
    api.c.tick()
    assert api.client.get("/v1/work", headers=new).status_code == 401


def test_a_worker_name_the_answers_cannot_carry_is_refused_when_its_token_is_made(api: Api) -> None:
    """A token added under a 129-character name was stored, and its worker's first registration wrote its row, then
    failed to build its answer (a 500): a live replica its rounds waited for until its lease lapsed."""
    from blocktrain.cli.main import main
    from blocktrain.errors import ConfigError

    for bad in ("x" * 129, "", "two\nlines"):
        with pytest.raises(ConfigError, match="printable"):
            api.c.add_token(bad)
    assert main(["token", "add", "y" * 129, "--run-dir", str(api.c.run.root)]) == 2  # the operator's command too
    assert api.register("x" * 128, block=0) == 0  # the longest name that fits


def test_token_lookup_compares_every_hash_in_constant_time(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stored hash goes through hmac.compare_digest, the match included: no early exit, no ``==``."""
    import hmac

    from blocktrain.coordinator import auth
    from blocktrain.coordinator.store import hash_token

    for name in ("a", "b", "c"):
        api.h(name)
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(x: str, y: str) -> bool:
        compared.append((x, y))
        return real(x, y)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    known = {h for _, h in api.c.store.tokens.token_hashes()}
    assert api.c.worker_for_token(api.tokens["a"]) == "a"
    assert {y for _, y in compared} == known and {x for x, _ in compared} == {hash_token(api.tokens["a"])}
    compared.clear()
    assert api.c.worker_for_token("not-a-token") is None
    assert len(compared) == len(known)


def test_round_closes_at_quorum_with_sample_weighted_mean(api: Api) -> None:
    for name in ("a", "b", "c"):
        assert api.register(name, block=1) == 1
    w0 = block_weights(api.c, 1)
    deltas = [small_delta(api.c, seed=i) for i in range(3)]
    samples = [10, 20, 70]
    for i, name in enumerate(("a", "b", "c")):
        status, doc = api.push(name, 1, pack_delta(deltas[i], Compression.NONE, block=1, base_version=0, base_sha=api.c.weights_sha[1],
                                                    samples=samples[i]))
        assert status == 202, doc
        assert doc["round_closed"] is (i == 2)
    assert api.c.version[1] == 1
    w1 = api.c.weights[1]
    for n in w0:
        # tiny is diffusion: average
        want = cast(torch.Tensor, sum(s * d[n] for s, d in zip(samples, deltas, strict=True))) / sum(samples)
        # the published step is int8 with one scale s = max|step| / 127 per tensor: error <= s / 2
        err = (w1[n] - w0[n] - want).abs().max().item()
        ulp = 2**-23 * float(w0[n].abs().max())  # W + step is rounded to float32 once
        assert err <= 0.5 / 127 * want.abs().max().item() * (1 + 1e-5) + ulp, n
    # a delta against the old version is refused with 409 and says what to do
    status, doc = api.push("a", 1, pack_delta(deltas[0], Compression.NONE, block=1, base_version=0,
                                              base_sha=api.c.weights_sha[1], samples=1))
    assert status == 409 and "pull the new version" in str(doc["detail"])


def test_deadline_closes_round_without_lapsed_worker(api: Api, clock: FakeClock) -> None:
    api.register("a", block=0)
    api.register("b", block=0)
    status, _ = api.push("a", 0, pack_delta(small_delta(api.c), Compression.BF16, block=0, base_version=0,
                                            base_sha=api.c.weights_sha[0], samples=4))
    assert status == 202 and api.c.version[0] == 0  # b is live: no quorum yet
    clock.advance(11)  # b's lease lapses; a keeps its lease by heartbeat
    api.client.post("/v1/heartbeat", headers=api.h("a"))
    api.c.tick()
    assert api.c.version[0] == 1  # b left the round: quorum of the live replicas
    row = one_row(api.c.store, "SELECT close_reason FROM rounds WHERE block=0 AND version=0")
    assert row["close_reason"] == "quorum"
    # a round whose deadline passes with one of two live replicas reporting closes by deadline
    api.register("b", block=0)
    api.client.get("/v1/work", headers=api.h("a"))
    api.push("b", 0, pack_delta(small_delta(api.c, seed=1), Compression.BF16, block=0, base_version=1,
                                base_sha=api.c.weights_sha[0], samples=4))
    clock.advance(31)
    api.client.post("/v1/heartbeat", headers=api.h("a"))
    api.c.tick()
    assert api.c.version[0] == 2
    row = one_row(api.c.store, "SELECT close_reason FROM rounds WHERE block=0 AND version=1")
    assert row["close_reason"] == "deadline"


def _bad_bodies(c: Coordinator) -> dict[str, tuple[bytes, int, str]]:
    good = small_delta(c)
    nan = {n: t.clone() for n, t in good.items()}
    first = next(iter(nan))
    nan[first].view(-1)[0] = float("nan")
    wrong = dict(good)
    wrong[first] = torch.zeros(3, 3)
    ok_body = pack_delta(good, Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4)
    buf = io.BytesIO()
    pickle.dump({n: t.numpy() for n, t in good.items()}, buf)
    return {
        "nan": (pack_delta(nan, Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4), 422, "NaN"),
        "shape": (pack_delta(wrong, Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4), 422, "expected"),
        "scaled": (pack_delta({n: 100 * t for n, t in good.items()}, Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0],
                              samples=4), 422, "median"),
        "pickle": (buf.getvalue(), 415, "safetensors"),
        "truncated": (ok_body[: len(ok_body) - 1000], 400, "truncated"),
        "oversized": (b"\0" * (c.max_body_bytes + 1), 413, "cap"),
    }


def test_bad_updates_are_rejected_and_model_unchanged(api: Api) -> None:
    for name in ("a", "b", "c", "evil"):
        api.register(name, block=0)
    # two good updates establish the norm history (and close nothing: 'evil' and 'c' are live)
    for i, name in enumerate(("a", "b")):
        status, _ = api.push(name, 0, pack_delta(small_delta(api.c, seed=i), Compression.BF16, block=0,
                                                 base_version=0, base_sha=api.c.weights_sha[0], samples=full(api.c)))
        assert status == 202
    before = block_weights(api.c, 0)
    for case, (body, want, text) in _bad_bodies(api.c).items():
        status, doc = api.push("evil", 0, body)
        assert status == want, (case, doc)
        assert text in str(doc["detail"]), (case, doc)
    r = api.client.post("/v1/blocks/0/updates", content=b"x", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    for n, t in before.items():
        assert torch.equal(api.c.weights[0][n], t)
    assert api.c.version[0] == 0
    st = api.client.get("/v1/status").json()
    assert st["updates_accepted"] == 2
    assert st["rejections"] == {"non_finite": 1, "schema": 1, "norm": 1, "not_safetensors": 1, "corrupt": 1,
                                "too_large": 1, "auth": 1}
    metrics = api.client.get("/metrics").text
    assert 'blocktrain_updates_rejected_total{reason="norm"} 1' in metrics
    # the unauthenticated one is counted in memory only: nothing is stored for a request without a valid token
    assert one_row(api.c.store, "SELECT COUNT(*) AS n FROM rejections")["n"] == 6


def test_wrong_block_and_wrong_version_metadata(api: Api) -> None:
    api.register("a", block=0)
    status, doc = api.push("a", 2, pack_delta(small_delta(api.c), Compression.BF16, block=2, base_version=0, base_sha=api.c.weights_sha[2],
                                              samples=1))
    assert status == 403 and "assigned to block 0" in str(doc["detail"])
    status, doc = api.push("a", 0, pack_delta(small_delta(api.c), Compression.BF16, block=1, base_version=0, base_sha=api.c.weights_sha[1],
                                              samples=1))
    assert status == 422 and "block 1" in str(doc["detail"])


def test_a_version_past_sqlite_s_integers_is_refused_and_counted(api: Api) -> None:
    """base_version 2**63 (or 10**30) passed the message's schema and reached SQL, which raised OverflowError: a 500
    with a traceback, stored nowhere, so it escaped the refusal rate limit and quarantine. Versions and block indices
    now stop at MAX_INT, and such a push is a counted schema refusal like any malformed message."""
    import json
    import struct

    from blocktrain.checkpoint.safetensors_io import metadata_sha256

    api.register("a", block=0)
    body = pack_delta(small_delta(api.c), Compression.BF16, block=0, base_version=0, base_sha=api.c.weights_sha[0],
                      samples=full(api.c))  # a sender of this BlockTrain cannot write such a version: rewritten below
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8:8 + n])
    for v in (2**63, 10**30):
        header["__metadata__"]["base_version"] = str(v)
        header["__metadata__"]["meta_sha256"] = metadata_sha256(header["__metadata__"])  # a forger recomputes it
        raw = json.dumps(header).encode()
        status, doc = api.push("a", 0, struct.pack("<Q", len(raw)) + raw + body[8 + n:])
        assert status == 422, doc
    rows = api.c.store.q("SELECT reason FROM rejections WHERE worker='a'")
    assert len(rows) == 2


def test_int8_and_bf16_roundtrip_and_pull_paths(api: Api) -> None:
    api.register("a", block=2)
    w0 = block_weights(api.c, 2)
    d = small_delta(api.c)
    status, _ = api.push("a", 2, pack_delta(d, Compression.INT8, block=2, base_version=0, base_sha=api.c.weights_sha[2], samples=3))
    assert status == 202 and api.c.version[2] == 1

    def first() -> bool:  # the first to ask about this version (a hivemind worker then fetches it)
        return bool(api.client.get("/v1/work", headers=api.h("a")).json()["fetch_first"])

    r = api.client.get("/v1/blocks/2/weights", headers=api.h("a"))  # fetched before anyone asked
    assert not first()
    assert r.status_code == 200 and r.headers["X-Block-Version"] == "1"
    w, meta = unpack(r.content)
    assert meta["version"] == "1" and set(w) == set(api.c.shapes)
    step, step_meta = unpack(api.client.get("/v1/blocks/2/steps/0", headers=api.h("a")).content)
    # the published step is int8 with one scale per tensor, and says so
    assert step_meta["compression"] == "int8"
    assert {n: t.dtype for n, t in step.items()} == {n: s.dtype for n, s in wire_schema(api.c.shapes, Compression.INT8).items()}
    # a worker applying the decoded step lands on the published weights bit for bit
    assert all(torch.equal(v, w[n]) for n, v in apply_step(w0, decode_delta(step, Compression.INT8)).items())
    assert api.client.get("/v1/blocks/2/steps/5", headers=api.h("a")).status_code == 404
    api.push("a", 2, pack_delta(small_delta(api.c, seed=1), Compression.INT8, block=2, base_version=1,
                                base_sha=api.c.weights_sha[2], samples=3))
    assert api.c.version[2] == 2
    api.client.get("/v1/blocks/2/steps/0", headers=api.h("a"))  # an older step is not the current version
    assert first() and not first()  # a new version: the first to ask, then the others
    api.push("a", 2, pack_delta(small_delta(api.c, seed=2), Compression.INT8, block=2, base_version=2,
                                base_sha=api.c.weights_sha[2], samples=3))
    api.client.get("/v1/blocks/2/steps/2", headers=api.h("a"))  # the step to the current version counts
    assert not first()
    assert api.client.get("/v1/blocks/7/weights", headers=api.h("a")).status_code == 404


def test_polling_status_takes_the_coordinator_lock_once_until_something_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger polling /v1/status and /metrics shares one document (one lock and byte flush) until a worker's
    request that may change the state has finished, or a tick has passed (here 60 s: it never does)."""
    c = make_coordinator(tmp_path / "run", None, clock=FakeClock(), tick_seconds=60)
    made: list[str] = []

    def counted(name: str, real: Callable[..., T]) -> Callable[..., T]:
        def call(*args: object, **kwargs: object) -> T:
            made.append(name)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(c, "status", counted("status", c.status))
    monkeypatch.setattr(c, "metrics", counted("metrics", c.metrics))
    with TestClient(create_app(c, background=False)) as client:
        api = Api(c, client)
        for _ in range(20):
            assert client.get("/v1/status").json()["workers"] == []
            assert "blocktrain_" in client.get("/metrics").text
            assert client.get("/").status_code == 200
        assert sorted(made) == ["metrics", "status", "status"]  # the metrics text is made from a status of its own
        for _ in range(5):  # a stranger's requests between its polls change nothing a worker's would
            assert client.get("/v1/nothing").status_code == 404
            assert client.post("/v1/blocks/0/updates", content=b"x", headers={"Authorization": "Bearer no"}).status_code == 401
            assert client.get("/v1/status").status_code == 200
        assert sorted(made) == ["metrics", "status", "status"]
        api.register("a", block=0)  # a state-changing request: the next poll sees it
        assert [w["name"] for w in client.get("/v1/status").json()["workers"]] == ["a"]
        assert 'blocktrain_worker_bytes_received_total{worker="a"}' in client.get("/metrics").text
        assert sorted(made) == ["metrics"] * 2 + ["status"] * 4
    c.close()


def test_status_and_metrics_count_bytes(api: Api) -> None:
    api.register("a", block=0)
    n_pull = len(api.client.get("/v1/blocks/0/weights", headers=api.h("a")).content)
    body = pack_delta(small_delta(api.c), Compression.BF16, block=0, base_version=0, base_sha=api.c.weights_sha[0], samples=1)
    api.push("a", 0, body)
    st = api.client.get("/v1/status").json()
    w = next(x for x in st["workers"] if x["name"] == "a")
    assert w["bytes_out"] >= n_pull and w["bytes_in"] >= len(body)
    assert st["bytes_in"] >= w["bytes_in"] and st["blocks"][0]["version"] == 1
    # the bf16 delta is about half the block's fp32 size (+ a small header)
    assert 0.45 * st["block_fp32_bytes"] < len(body) < 0.55 * st["block_fp32_bytes"]
    assert "blocktrain_worker_bytes_received_total" in api.client.get("/metrics").text


@pytest.mark.parametrize("method", [Aggregation.MEDIAN, Aggregation.TRIMMED_MEAN])
def test_robust_aggregation_ignores_an_outlier(tmp_path: Path, method: Aggregation) -> None:
    c = make_coordinator(tmp_path / "run", None, aggregation=method, norm_k=0, trim_fraction=0.2, replay_cosine=1.0,
                         outer=OuterOptimizer.AVERAGE, **NO_SCREEN)  # W_1 - W_0 is then the aggregate itself
    names = [f"w{i}" for i in range(5)]
    for n in names:
        c.register(n, 0)
    w0 = block_weights(c, 0)
    base = small_delta(c, seed=1)
    for i, n in enumerate(names):
        d = {k: v * (1000.0 if i == 4 else 1.0 + 0.01 * i) for k, v in base.items()}
        c.submit(n, 0, pack_delta(d, Compression.NONE, block=0, base_version=0, base_sha=c.weights_sha[0], samples=1))
    assert c.version[0] == 1
    for k in w0:
        step = c.weights[0][k] - w0[k]
        assert (step - base[k]).abs().max() <= 0.03 * base[k].abs().max() + 1e-9
    c.close()


def test_nesterov_outer_step_and_momentum_persist(tmp_path: Path) -> None:
    c = make_coordinator(tmp_path / "run", None, outer=OuterOptimizer.NESTEROV, outer_lr=0.7, outer_momentum=0.9)
    c.register("a", 3)
    w0 = block_weights(c, 3)
    d = small_delta(c)
    c.submit("a", 3, pack_delta(d, Compression.NONE, block=3, base_version=0, base_sha=c.weights_sha[3], samples=1))
    for k in w0:  # first step: m = g = -d; step = -lr (g + mu m) = lr (1 + mu) d
        want = 0.7 * 1.9 * d[k]
        ulp = 2**-23 * float(w0[k].abs().max())  # W + step is rounded to float32 once
        assert (c.weights[3][k] - w0[k] - want).abs().max() <= 0.5 / 127 * want.abs().max() * (1 + 1e-5) + ulp
    carried = c.outer[3]
    c.close()
    c2 = make_coordinator(tmp_path / "run", None, outer=OuterOptimizer.NESTEROV)
    # the momentum buffer and the step's error-feedback residual survive a restart exactly
    assert c2.version[3] == 1 and c2.outer[3].momentum is not None and carried.momentum is not None
    assert all(torch.equal(c2.outer[3].momentum[n], m) for n, m in carried.momentum.items())
    assert carried.residual and all(torch.equal(c2.outer[3].residual[n], r) for n, r in carried.residual.items())
    c2.close()


def test_gate_rejects_an_update_that_hurts_held_out_loss(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = make_coordinator(tmp_path / "run", corpus, gate_tolerance=0.0, norm_k=0, eval_every=0, audit_fraction=0.0)
    c.register("a", 0)
    from blocktrain.errors import ProtocolError

    harmful = {n: 0.5 * torch.randn(s) for n, s in c.shapes.items()}
    with pytest.raises(ProtocolError) as exc:
        c.submit("a", 0, pack_delta(harmful, Compression.NONE, block=0, base_version=0, base_sha=c.weights_sha[0], samples=1))
    assert exc.value.status == 422 and exc.value.reason == "gate"
    assert c.version[0] == 0
    c.close()


def test_restart_resumes_versions_and_pending_updates(tmp_path: Path) -> None:
    c = make_coordinator(tmp_path / "run", None)
    for n in ("a", "b"):
        c.register(n, 0)
    c.register("c", 1)
    c.submit("c", 1, pack_delta(small_delta(c), Compression.BF16, block=1, base_version=0, base_sha=c.weights_sha[1], samples=1))
    c.submit("a", 0, pack_delta(small_delta(c, seed=3), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=1))
    sha = dict(c.weights_sha)
    c.close()  # (a hard kill is tested with processes in test_distributed_loopback)
    c2 = make_coordinator(tmp_path / "run", None)
    assert c2.version == {0: 0, 1: 1, 2: 0, 3: 0} and c2.weights_sha == sha
    assert one_row(c2.store, "SELECT COUNT(*) AS n FROM updates WHERE state='accepted'")["n"] == 1
    c2.submit("b", 0, pack_delta(small_delta(c2, seed=4), Compression.BF16, block=0, base_version=0, base_sha=c2.weights_sha[0], samples=1))
    assert c2.version[0] == 1
    row = one_row(c2.store, "SELECT n_updates FROM rounds WHERE block=0 AND version=0")
    assert row["n_updates"] == 2  # the update accepted before the restart counted
    c2.close()


def test_seeds_are_recorded_per_worker_and_round(api: Api) -> None:
    api.register("a", block=0)
    api.register("b", block=0)
    wa = api.client.get("/v1/work", headers=api.h("a")).json()
    wb = api.client.get("/v1/work", headers=api.h("b")).json()
    assert wa["stream"] != wb["stream"]
    rows = api.c.store.q("SELECT worker, stream FROM seeds ORDER BY worker")
    assert [(r["worker"], r["stream"]) for r in rows] == [("a", wa["stream"]), ("b", wb["stream"])]


def test_adaptive_deadline_follows_observed_arrivals(tmp_path: Path) -> None:
    clock = FakeClock()
    c = make_coordinator(tmp_path / "run", None, clock=clock, round_seconds=30, adaptive_deadline=True,
                         min_round_seconds=2, deadline_slack=2.0)
    c.register("a", 0)
    clock.advance(3.0)  # the only replica reports 3 s after the round opened
    c.submit("a", 0, pack_delta(small_delta(c), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=1))
    row = one_row(c.store, "SELECT opened, deadline FROM rounds WHERE block=0 AND version=1")
    assert row["deadline"] - row["opened"] == pytest.approx(6.0)  # slack 2 x slowest arrival 3 s
    c.close()


def test_int8_encoding_error_is_bounded() -> None:
    from blocktrain.protocol.delta import decode_delta, encode_delta

    d = {"w": torch.randn(64, 64), "b": torch.zeros(5)}
    back = decode_delta(encode_delta(d, Compression.INT8), Compression.INT8)
    assert torch.equal(back["b"], d["b"])
    assert (back["w"] - d["w"]).abs().max() <= d["w"].abs().max() / 127 / 2 + 1e-6  # half a quantisation step


def test_client_backoff_is_bounded_and_reports_unreachable() -> None:
    import time

    from blocktrain.errors import ProtocolError
    from blocktrain.worker.client import CoordinatorClient
    from tests.distributed_utils import free_port

    client = CoordinatorClient(f"http://127.0.0.1:{free_port()}", "t", base_delay=0.05, max_delay=0.2, give_up_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError) as exc:
        client.work()
    assert exc.value.status == 503 and "unreachable" in str(exc.value)
    assert time.monotonic() - t0 >= 1.0  # it retried for its give_up_s before giving up
    client.close()


def test_small_routes_cap_their_bodies_before_auth(api: Api) -> None:
    big = b'{"block": 0, "pad": "' + b"x" * (80 * 1024) + b'"}'
    r = api.client.post("/v1/register", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    r = api.client.post("/v1/heartbeat", content=big, headers={**api.h("w0"), "content-type": "application/json"})
    assert r.status_code == 413


def test_the_openapi_schema_lists_every_response_model(tmp_path: Path) -> None:
    """Every JSON route declares its model: its success response refers to a schema component, and every refusal
    (4XX) to the error body's."""
    c = make_coordinator(tmp_path / "run", None)
    try:
        schema = create_app(c, background=False).openapi()
    finally:
        c.close()
    components = set(schema["components"]["schemas"])
    assert {"Registration", "WorkAnswer", "Heartbeat", "Left", "PushAnswer", "AuditAnswer", "Status", "ErrorBody",
            "BlockStatus", "WorkerStatus", "RoundStatus", "EvalStatus"} <= components
    binary = {"/v1/blocks/{k}/weights", "/v1/blocks/{k}/steps/{v}", "/v1/blocks/{k}/frozen", "/v1/blocks/{k}/moments/{v}"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if path in ("/", "/metrics"):  # the dashboard's HTML and Prometheus text: open, never refused
                continue
            codes = op["responses"]
            assert codes["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody"), (path, method)
            if path in binary:
                continue
            ok = next(v for code, v in codes.items() if code.startswith("2"))
            ref = ok["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[-1] in components, (path, method, ref)


def test_only_the_newest_outer_state_is_kept_and_a_restart_resumes_it(tmp_path: Path) -> None:
    """Every round stored the block's whole outer state (Nesterov momentum, the step's residual: 8 of the ~13 bytes per
    parameter a round stores) and kept every one, though only a restart reads it, from the newest version."""
    c = make_coordinator(tmp_path / "run", None, outer=OuterOptimizer.NESTEROV)
    c.register("a", 0)
    for v in range(3):
        c.submit("a", 0, pack_delta(small_delta(c, seed=v), Compression.BF16, block=0, base_version=v,
                                    base_sha=c.weights_sha[0], samples=1))
    assert c.version[0] == 3
    rows = c.store.q("SELECT version, momentum_blob FROM versions WHERE block=0 ORDER BY version")
    assert [r["version"] for r in rows if r["momentum_blob"]] == [3]
    outer_files = [p for p in c.store.blobs.blob_dir.glob("*.safetensors") if b'"outer_state"' in p.read_bytes()[:4096]]
    assert [p.stem for p in outer_files] == [rows[-1]["momentum_blob"]]
    before = c.checkpoints.current(0).outer.tensors()
    c.close()
    c2 = make_coordinator(tmp_path / "run", None, outer=OuterOptimizer.NESTEROV)
    after = c2.checkpoints.current(0).outer.tensors()
    assert before and before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    c2.close()


def test_a_round_whose_deadline_passed_while_the_coordinator_was_down_takes_its_workers_retries(tmp_path: Path) -> None:
    """Round 0 held 1 of its 2 workers' updates when the coordinator went down; it came back past the deadline, and its
    first tick closed the round with that one: the other worker's retried push, trained for it, was stale (409)."""
    clock = FakeClock()
    c = make_coordinator(tmp_path / "run", None, clock=clock, round_seconds=30, lease_seconds=20)
    for n in ("a", "b"):
        c.register(n, 0)
    c.submit("a", 0, pack_delta(small_delta(c), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0], samples=1))
    sha = c.weights_sha[0]
    c.close()
    clock.advance(90.0)  # down for a minute and a half: the deadline (30 s) passed meanwhile
    c2 = make_coordinator(tmp_path / "run", None, clock=clock, round_seconds=30, lease_seconds=20)
    try:
        c2.tick()
        assert c2.version[0] == 0  # still open: a lease longer
        c2.register("b", 0)
        c2.submit("b", 0, pack_delta(small_delta(c2, seed=5), Compression.BF16, block=0, base_version=0, base_sha=sha,
                                     samples=1))
        clock.advance(21.0)
        c2.tick()
        assert c2.version[0] == 1
        assert one_row(c2.store, "SELECT n_updates FROM rounds WHERE block=0 AND version=0")["n_updates"] == 2
    finally:
        c2.close()
