"""scripts/exp_six_workers.sh refuses, before it starts or removes anything, what it would misreport."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.mark.parametrize(("env", "says"), [
    ({"H": "7", "STEPS": "400"}, "H=7 does not divide STEPS=400"),
    ({"SKIP_SINGLE": "1"}, "SKIP_SINGLE=1 needs SINGLE_EVAL"),
    ({"SKIP_SINGLE": "1", "SINGLE_EVAL": __file__}, "SKIP_SINGLE=1 needs SINGLE_WALL_S"),
])
def test_the_six_worker_script_refuses_what_it_would_misreport_before_it_runs(env: dict[str, str], says: str,
                                                                              tmp_path: Path) -> None:
    """An H that does not divide STEPS trained ROUNDS x H < STEPS steps while the result said STEPS; SKIP_SINGLE=1
    without SINGLE_EVAL failed only after the hour the six workers took, and without SINGLE_WALL_S recorded 0 s
    (helper-69). Both are refused at once now, before anything is started or removed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept").write_text("x")
    script = Path(__file__).resolve().parents[1] / "scripts" / "exp_six_workers.sh"
    data = tmp_path / "data"  # any folder: the script is refused before it reads one (no ../shared needed)
    data.mkdir()
    r = subprocess.run(["bash", str(script)], env={**os.environ, **env, "OUT": str(out), "DATA": str(data)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and says in r.stderr
    assert (out / "kept").exists()  # nothing removed
