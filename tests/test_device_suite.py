"""The device suite's smoke (issue 42): ``SUITE=smoke DEVICE=cpu bash scripts/device_suite.sh`` runs its jobs at
the tiny preset on CPU (the paper-width job is GPU-only), writes every result file, packs them into one archive,
and a second run resumes (skips the finished jobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.distributed_utils import write_corpus

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(420)]


def _suite(results: Path, data: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "SUITE": "smoke", "DEVICE": "cpu", "RESULTS": str(results), "DATA": str(data),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh")], env=env, capture_output=True, text=True,
                          timeout=400)
    return done, time.perf_counter() - t0


def test_the_smoke_suite_runs_every_job_packs_and_resumes(tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "data").root
    results = tmp_path / "device-suite"
    done, wall = _suite(results, data)
    assert done.returncode == 0, done.stderr[-3000:]
    rcs = {p.stem: p.read_text().split()[0] for p in results.glob("*.rc")}
    jobs = ("checks", "noise-speed", "optimizer-speed", "speed-tiny", "depth", "averaging", "live", "serve")
    assert rcs == dict.fromkeys(jobs, "0"), (rcs, done.stderr[-3000:])
    checks = json.loads((results / "device-checks.json").read_text())
    assert checks["ok"] and checks["noise_hashes_equal"] and checks["device"] == "cpu"
    assert checks["optimizer_max_abs_diff"] == 0.0  # the CPU against itself
    noise = json.loads((results / "device-noise-speed.json").read_text())
    assert [r["preset"] for r in noise["rows"]] == ["cpu-mini", "cpu-small", "paper"]
    opt = json.loads((results / "device-optimizer-speed.json").read_text())
    assert [r["preset"] for r in opt["rows"]] == ["cpu-mini"] and opt["rows"][0]["round_adamw_s"] > 0
    speed = json.loads((results / "device-speed-tiny.json").read_text())
    assert speed["device"] == "cpu"
    for trainer in ("e2e", "block", "stack_block"):  # every bf16 run profiled: its top operators, by own time
        ops = speed[trainer]["bf16_profile"]
        assert ops and all(0 <= o["share"] <= 1 and o["calls"] >= 1 for o in ops)
    depth = json.loads((results / "device-depth.json").read_text())
    (row,) = depth["rows"]
    assert row["key"] == "tiny-lr2e-3-seed0" and row["device"] == "cpu" and row["lr"] == 2e-3
    assert row["preset"] == "tiny" and set(row["ce"]) == {"stack", "stack_prefix0", "e2e_matched_flops"}
    assert "gap_stack_minus_e2e" in depth["summary"]["tiny"]
    assert json.loads((results / "device-averaging.json").read_text())
    avg = [json.loads(line) for line in (results / "averaging.jsonl").read_text().splitlines()]
    workers = [r for r in avg if r["kind"] == "m"]  # the volunteers' rows run the coordinator's default
    assert {r["block"] for r in workers} == {"cold", "stack"} and {r["inner_start"] for r in workers} == {"shared_mv"}
    live = json.loads((results / "device-live.json").read_text())
    assert {r["row"] for r in live["http"]["rows"]} == {"honest6", "sign_flip"}
    with tarfile.open(f"{results}.tar.gz") as tar:  # the archive holds what the folder holds
        names = set(tar.getnames())
    assert f"{results.name}/device-depth.json" in names and f"{results.name}/device-live.json" in names
    again, wall_again = _suite(results, data)
    assert json.loads((results / "device-serve.json").read_text())
    assert again.returncode == 0 and again.stderr.count("done already, skipped") == len(jobs), again.stderr[-2000:]
    assert wall_again < wall / 3


def test_depth_rows_resume_from_the_rows_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``device_depth.py rows`` trains only the (lr, seed) pairs whose key is not in the JSONL yet, keys each as its
    lr is written, and counts a bench that fails as a missing row (no row written)."""
    from benchmarks.quality import device_depth

    jsonl = tmp_path / "depth.jsonl"
    jsonl.write_text(json.dumps({"key": "tiny-lr2e-3-seed0"}) + "\n")
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 3)  # the bench failed: no JSON, no row

    monkeypatch.setattr(device_depth.subprocess, "run", fake_run)
    failed = device_depth.train_rows("tiny", ["2e-3", "3e-3"], [0], "cpu", tmp_path / "data", tmp_path / "runs", jsonl,
                                     4096, timeout=5)
    assert failed == 1 and len(ran) == 1
    (cmd,) = ran
    assert cmd[cmd.index("--lr") + 1] == "3e-3" and cmd[cmd.index("--device") + 1] == "cpu"
    assert cmd[cmd.index("--json") + 1] == str(tmp_path / "runs" / "depth-tiny-lr3e-3-seed0.json")
    assert jsonl.read_text().count("\n") == 1  # the failed row is not written
