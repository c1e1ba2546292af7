"""The coordinator ingest benchmark of the harness (benchmarks/data/ingest.py), tiny and on loopback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from benchmarks.data import ingest

from blocktrain.model.block import BlockDenoiser
from blocktrain.presets import tiny
from tests.forked_cli import fork_popen


def test_ingest_bench_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", fork_popen)  # the coordinators it starts: forked, not re-imported
    out = tmp_path / "ingest.json"
    assert ingest.main(["--preset", "tiny", "--updates", "4", "--compress", "none",
                        "--work-dir", str(tmp_path / "work"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    cfg = tiny()
    params = sum(p.numel() for p in BlockDenoiser(cfg.model, cfg.diffusion.sigma_data).parameters())
    assert (r["preset"], r["updates"], r["compression"]) == ("tiny", 4, "none")
    assert r["block_fp32_bytes"] == 4 * params
    assert r["block_fp32_bytes"] < r["update_bytes"] < r["block_fp32_bytes"] + 64 * 1024  # tensors + header
    kinds = {"sequential_fsync", "concurrent_fsync", "sequential_no_fsync", "concurrent_no_fsync"}
    assert set(r["ingest_MBps"]) == set(r["ingest_over_copy"]) == kinds
    assert 0 < r["plain_loopback_copy_MBps"] < 1e6
    for k in kinds:
        assert 0 < r["ingest_MBps"][k] < 1e5, k
        assert r["ingest_over_copy"][k] == pytest.approx(r["ingest_MBps"][k] / r["plain_loopback_copy_MBps"], rel=1e-9)
    assert r["concurrent_clients"] == 4  # one update per client
