"""The averaging study's winner section reads the live HTTP run as the issue names its fields; its references run
with any inner optimiser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from benchmarks.distributed.averaging_scaling import http_section, planned_rows, row_key, settings_for

from blocktrain.coordinator.simulate import run_local_rounds
from blocktrain.data.dataset import DataDir
from blocktrain.presets import get_preset
from tests.distributed_utils import corpus  # noqa: F401


def test_the_http_section_scores_the_live_run_against_the_in_process_reference(tmp_path: Path) -> None:
    run = tmp_path / "six.json"
    run.write_text(json.dumps({"six_worker_ce_nats_per_byte": 1.55, "single_machine_ce_nats_per_byte": 1.78,
                               "command": "OBJECTIVE=stack scripts/exp_six_workers.sh"}))
    got = http_section(run, batch96_ce=1.42)
    assert (got["six_worker_ce"], got["single_ce"], got["batch96_ce"]) == (1.55, 1.78, 1.42)
    assert got["recovered"] == pytest.approx((1.78 - 1.55) / (1.78 - 1.42), abs=1e-12)
    assert got["command"] == "OBJECTIVE=stack scripts/exp_six_workers.sh"
    assert http_section(run, batch96_ce=None)["recovered"] is None  # no reference: no fraction, not a made-up one


def test_a_one_machine_reference_with_muon_starts_its_one_round_fresh(corpus: DataDir) -> None:  # noqa: F811
    """The coordinator's default start shares AdamW moments, which Muon has none of: the one-machine reference of a
    Muon row (``--refs-inner --inner muon``) runs its one round from a fresh optimiser instead of refusing."""
    row = {"kind": "x", "steps": 4, "batch": 2, "workers": 2, "inner": "muon"}
    settings, rounds = settings_for(row)
    assert rounds.reset_inner is True and rounds.inner == "muon"
    run = run_local_rounds(get_preset("tiny"), settings, rounds, corpus)
    assert len(run.updates) == 1 and run.updates[0].outcome == "accepted"
    assert settings_for({**row, "inner": "adamw"})[1].reset_inner is None  # AdamW's references are as they were


def test_compiled_rows_are_a_study_of_their_own_and_eager_keys_stay() -> None:
    """--compile names its rows and their references (their speed and arithmetic differ); eager rows keep their keys."""
    flags = dict(stack=False, blocks="cold", seeds="0", workers="1,6", steps=240, h=24, rounds=0, refs_only=False,
                 refs_inner=False, inner="adamw", aggregation="mean", outer="nesterov", outer_eps=1e-8, outer_cap=None,
                 inner_start=None, share_every=1, mean_v=False, moment_codec="int8", early=None, outer_lr=0.7,
                 outer_momentum=0.9, reset_inner=False)
    cfg = get_preset("cpu-small")
    eager = [row_key(r) for r in planned_rows(argparse.Namespace(**flags, compile="off"), cfg)]
    compiled = [row_key(r) for r in planned_rows(argparse.Namespace(**flags, compile="reduce-overhead"), cfg)]
    assert eager[0] == "cpu-small/cold/s0/steps240/x1" and len(eager) == len(compiled) == 4
    assert all(c == e.replace("/steps240", "/steps240/compile=reduce-overhead") for e, c in zip(eager, compiled, strict=True))
