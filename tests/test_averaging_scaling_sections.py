"""The averaging study's winner section reads the live HTTP run as the issue names its fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.distributed.averaging_scaling import http_section


def test_the_http_section_scores_the_live_run_against_the_in_process_reference(tmp_path: Path) -> None:
    run = tmp_path / "six.json"
    run.write_text(json.dumps({"six_worker_ce_nats_per_byte": 1.55, "single_machine_ce_nats_per_byte": 1.78,
                               "command": "OBJECTIVE=stack scripts/exp_six_workers.sh"}))
    got = http_section(run, batch96_ce=1.42)
    assert (got["six_worker_ce"], got["single_ce"], got["batch96_ce"]) == (1.55, 1.78, 1.42)
    assert got["recovered"] == pytest.approx((1.78 - 1.55) / (1.78 - 1.42), abs=1e-12)
    assert got["command"] == "OBJECTIVE=stack scripts/exp_six_workers.sh"
    assert http_section(run, batch96_ce=None)["recovered"] is None  # no reference: no fraction, not a made-up one
