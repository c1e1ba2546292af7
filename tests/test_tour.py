"""The tour (scripts/tour.sh) end to end on the tiny preset: coordinator, three workers, two stages, gateway, chat."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed_utils import corpus  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(280)
def test_the_tour_trains_serves_and_answers_a_chat(tmp_path: Path, corpus) -> None:  # noqa: F811
    env = {**os.environ, "TOUR_PRESET": "tiny", "ROUNDS": "2", "H": "5", "TOUR_OUT": str(tmp_path / "tour"),
           "BLOCKTRAIN_DATA": str(corpus.root), "VENV": str(Path(sys.executable).parent.parent)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "tour.sh")], env=env, capture_output=True, text=True,
                          timeout=260)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for step in range(1, 7):
        assert f"] {step}. " in out, f"step {step} missing:\n{out}"
    assert re.search(r"block 3 finished v2", out), out
    assert re.search(r"CE +\d+\.\d+ nats/byte", out), out  # blocktrain eval's line
    assert "mode spec" in out and "assistant  '" in out, out
    assert (tmp_path / "tour" / "coord").is_dir() and "tour done in" in out
    log = (tmp_path / "tour" / "logs" / "coordinator.log").read_text()
    assert "rejected update" not in log and "quarantined" not in log, log[-3000:]  # honest workers, no refusal
