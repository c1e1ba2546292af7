"""The attack-row study's table (benchmarks/distributed/hostile_peers.py): its two references and the undetected rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.distributed.hostile_peers import main, table


def row(kind: str, ce: float, attack_from: int = 3, **extra: Any) -> dict[str, Any]:
    base = {"kind": kind, "attack_from": attack_from, "seed": 0, "ce_nats_per_byte": ce, "honest_updates": 690,
            "honest_refused": 0, "honest_screened": 0, "hostile_updates": 3, "hostile_by_outcome": {"claim": 3},
            "hostile_accepted": 0, "quarantined_at": {}, "p_undetected": 0.0}
    return {**base, **extra}


def test_each_row_is_read_against_the_clean_run_and_against_its_probation() -> None:
    rows = [row("clean", 1.5, hostile_updates=0, hostile_by_outcome={}, p_undetected=None),
            row("inflated_claim", 1.7, quarantined_at={"6": 5}),
            row("strong", 1.7, hostile_by_outcome={"audit": 1}),
            row("sign_flip", 1.65, hostile_by_outcome={"gate": 3})]
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in table(rows).splitlines()[2:]}
    assert "| +0.2000 | +0.0000 |" in lines["strong"]  # all it changed is its probation's honest pushes
    assert "| +0.1500 | -0.0500 |" in lines["sign_flip"]
    assert "| — | — |" in lines["clean"]


def test_a_worker_its_refusals_or_its_probation_caught_counts_as_detected(tmp_path: Path) -> None:
    out = tmp_path / "hostile-peers.json"
    out.write_text(json.dumps({"rows": [row("clean", 1.5, p_undetected=None, hostile_by_outcome={}),
                                        row("data_poisoner", 1.6, p_undetected=1.0, quarantined_at={"6": 19},
                                            hostile_by_outcome={"accepted": 14, "gate": 3}, hostile_accepted=14),
                                        row("strong", 1.5, attack_from=0, p_undetected=0.95**115, quarantined_at={"6": 0},
                                            hostile_by_outcome={"audit": 1})]}))
    assert main(["--out", str(out), "--table-only"]) == 0
    rows = {r["kind"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["data_poisoner"]["p_undetected"] == 0.0 and rows["data_poisoner"]["hostile_accepted"] == 14
    assert rows["strong"]["p_undetected"] == 0.0  # it attacked on probation: its first push was audited for sure


def test_without_the_inflated_claims_row_a_row_refused_throughout_is_the_probation_reference() -> None:
    """A study of a few rows (the fixed code's, 2026-12-07) ran ``strong`` but not ``inflated_claim``: every row's
    ``vs probation`` was blank, though ``strong`` had every attacking push refused and so changed the run by its
    probation's honest pushes alone. Such a row stands in; the named one wins where both were run."""
    rows = [row("clean", 1.5, hostile_updates=0, hostile_by_outcome={}, p_undetected=None),
            row("strong", 1.7, hostile_by_outcome={"norm": 3}),
            row("stale", 1.72, hostile_by_outcome={"accepted": 15, "audit": 1}, hostile_accepted=15),
            row("colluding", 1.9, hostile_by_outcome={"gate": 6})]
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in table(rows).splitlines()[2:]}
    assert "| +0.2200 | +0.0200 |" in lines["stale"]
    with_claim = {ln.split(" | ")[0].strip("| "): ln for ln in table([*rows, row("inflated_claim", 1.71)]).splitlines()[2:]}
    assert "| +0.2200 | +0.0100 |" in with_claim["stale"]
