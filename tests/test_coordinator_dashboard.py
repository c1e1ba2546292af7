"""The dashboard at ``/`` rendered by headless Chromium against a live coordinator.

Chromium runs the page's JavaScript, which fetches ``/v1/status`` and fills the
blocks and workers tables and the CE curve; the test reads the resulting DOM.
Needs the ``chromium`` binary (Debian/Ubuntu package ``chromium``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from blocktrain.data.dataset import DataDir
from blocktrain.protocol.delta import Compression, pack_delta
from tests.distributed_utils import ThreadServer, corpus, make_coordinator  # noqa: F401

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def dump_dom(url: str, profile: Path) -> str:
    assert CHROMIUM is not None
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--dump-dom", url],
        capture_output=True, timeout=120, check=True,
    )
    return out.stdout.decode()


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)")
def test_dashboard_shows_blocks_workers_and_ce_curve(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = make_coordinator(tmp_path / "run", corpus, eval_bytes=256, eval_every=1, audit_fraction=0.0)
    for name, k in (("alice", 0), ("bob", 1), ("carol", 2), ("dave", 3)):
        c.add_token(name)
        c.register(name, k)
    c.maybe_evaluate()  # epoch 0
    for name, k in (("alice", 0), ("bob", 1), ("carol", 2), ("dave", 3)):  # one round of every block
        delta = {n: 1e-3 * torch.randn(s) for n, s in c.shapes.items()}
        c.submit(name, k, pack_delta(delta, Compression.BF16, block=k, base_version=0, base_sha=c.weights_sha[k], samples=4))
    c.maybe_evaluate()  # epoch 1: a second point on the curve
    with ThreadServer(c, background=False) as srv:
        dom = dump_dom(srv.url + "/", tmp_path / "profile")
    c.close()
    assert "BlockTrain coordinator" in dom
    for name in ("alice", "bob", "carol", "dave"):
        assert f"<td>{name}</td>" in dom, f"worker {name} missing from the rendered dashboard"
    rows = re.findall(r"<tr><td>(\d)</td><td>(\d+)</td><td>open</td>", dom)
    assert sorted(rows) == [("0", "1"), ("1", "1"), ("2", "1"), ("3", "1")]  # blocks at version 1, round open
    assert re.search(r'<polyline[^>]*id="ce-line"', dom) and 'data-points="2"' in dom
    assert "4 rounds closed" in dom and "latest CE" in dom


def test_the_status_page_s_queries_use_indexes(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """/v1/status reads each of its last 50 rounds' refusals by (block, time), under the coordinator's lock, and is
    built again after every worker request: a scan of the refusals table, which grows with each refusal, took 1.5 s
    per page at 300k rows. The counted refusals of a worker and its group refusals are read by worker likewise."""
    c = make_coordinator(tmp_path / "run", None)
    try:
        db = c.store.db
        queries = {
            "SELECT reason, COUNT(*) AS n FROM rejections WHERE block=? AND at>=? AND at<=? GROUP BY reason": (0, 0, 1),
            "SELECT COUNT(*) AS n FROM rejections WHERE worker=? AND reason IN (?,?)": ("w", "gate", "norm"),
            "SELECT COUNT(DISTINCT uploader) AS n FROM group_refusals WHERE worker=?": ("w",),
            "SELECT * FROM rounds WHERE state=? ORDER BY closed DESC LIMIT ?": ("closed", 50),
        }
        for sql, args in queries.items():
            plan = " / ".join(str(r[3]) for r in db.q("EXPLAIN QUERY PLAN " + sql, *args))
            assert "USING" in plan and not re.search(r"\bSCAN\b", plan), (sql, plan)  # a search of the few rows it needs
    finally:
        c.close()


def test_the_status_cost_benchmark_times_both_stores() -> None:
    """benchmarks/data/status_cost.py at a small size: a row with the indexes and one without, every build timed."""
    from benchmarks.data.status_cost import measure

    r = measure(refusals=2000, rounds=50, reps=2)
    assert set(r["rows"]) == {"indexed", "no_indexes"}
    assert all(len(row["ms"]) == 2 and row["median_ms"] > 0 for row in r["rows"].values())
    assert r["command"].startswith("python benchmarks/data/status_cost.py")
