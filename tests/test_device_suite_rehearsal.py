"""The device suite's full branch, rehearsed on a CPU (slow; not in CI): ``SUITE=rehearsal`` runs every job the
full suite runs, with its flags, compile modes and side-by-side launch, at tiny budgets. A GPU session is short:
this is where a broken command line, a variable a job forgot to receive, or a wait that never ends shows first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed_utils import write_corpus

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"checks", "noise-speed", "optimizer-speed", "speed-tiny", "depth", "paper", "averaging", "live", "serve",
        "speed-paper-compiled", "audit", "summaries"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_rehearsal_runs_every_full_job_to_the_end(tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "data").root
    results = tmp_path / "device-suite"
    env = {**os.environ, "SUITE": "rehearsal", "DEVICE": "cpu", "RESULTS": str(results), "DATA": str(data),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh")], env=env, capture_output=True, text=True,
                          timeout=1700)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished; results in" in done.stderr  # the side-by-side jobs were waited for, and the script ended
    rcs = {p.stem: p.read_text().split()[0] for p in results.glob("*.rc")}
    assert rcs == dict.fromkeys(JOBS, "0"), (rcs, done.stderr[-3000:])
    speed = json.loads((results / "device-speed-tiny.json").read_text())
    assert speed["compile"] == "reduce-overhead" and speed["e2e"]["compiled_s_per_step"] > 0
    assert json.loads((results / "device-speed-paper-compiled.json").read_text())["compile"] == "default"
    avg = [json.loads(line) for line in (results / "averaging.jsonl").read_text().splitlines()]
    assert {r["block"] for r in avg} == {"cold", "stack"}  # tiny trains diffusion: no warm block
