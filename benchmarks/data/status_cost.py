"""What one ``/v1/status`` build costs a coordinator with a long history, with and without the store's indexes.

    python benchmarks/data/status_cost.py --refusals 300000 --rounds 20000 --json benchmarks/results/status-cost.json

The status document is built under the coordinator's lock, again after every worker request, so its cost is time
every push and heartbeat may wait. A coordinator store (tiny preset, no data) is filled with ``--refusals`` refused
pushes spread over 50 workers and 4 blocks and ``--rounds`` closed rounds per block; each build is timed ``--reps``
times, once with the store as it is and once with the indexes of ``coordinator.db`` on the refusals, group refusals
and rounds dropped (the store before they existed). Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from blocktrain.bench.machine import machine_info
from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.presets import get_preset

INDEXES = ("rejections_by_block", "rejections_by_worker", "group_refusals_by_worker", "rounds_by_close")
REASONS = ("stale", "duplicate", "base", "gate")


def fill(c: Coordinator, refusals: int, rounds: int, seed: int = 0) -> None:
    """``refusals`` refused pushes (50 workers, 4 blocks) and ``rounds`` closed rounds per block."""
    rng = random.Random(seed)
    db = c.store.db
    with c.store.tx():
        db.executemany("INSERT INTO rejections(worker, block, status, reason, message, at) VALUES(?,?,?,?,?,?)",
                       [(f"w{i % 50}", i % 4, 409, rng.choice(REASONS), "refused", float(i)) for i in range(refusals)])
        db.executemany("INSERT OR IGNORE INTO rounds(block, version, state, opened, deadline, closed, n_updates) "
                       "VALUES(?,?,?,?,?,?,?)",
                       [(k, v, "closed", 4.0 * v, 4.0 * v + 3, 4.0 * v + 3, 1) for k in range(4) for v in range(1, rounds)])


def time_status(c: Coordinator, reps: int) -> list[float]:
    """Seconds of each of ``reps`` status builds."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.status()
        out.append(time.perf_counter() - t0)
    return out


def measure(refusals: int, rounds: int, reps: int) -> dict[str, Any]:
    rows = {}
    for indexed in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            c = Coordinator(Path(tmp) / "run", get_preset("tiny"), CoordinatorSettings(fsync=False), None)
            try:
                fill(c, refusals, rounds)
                if not indexed:
                    for name in INDEXES:
                        c.store.db.execute(f"DROP INDEX {name}")  # an index renamed in coordinator.db fails here
                seconds = time_status(c, reps)
            finally:
                c.close()
        rows["indexed" if indexed else "no_indexes"] = {"median_ms": 1000 * statistics.median(seconds),
                                                         "ms": [1000 * s for s in seconds]}
    return {"benchmark": "status_cost", "refusals": refusals, "rounds_per_block": rounds, "reps": reps, "rows": rows,
            "machine": machine_info(), "command": f"python benchmarks/data/status_cost.py --refusals {refusals} "
                                                  f"--rounds {rounds} --reps {reps}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refusals", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=20_000, help="closed rounds per block")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    r = measure(a.refusals, a.rounds, a.reps)
    print(f"| store ({a.refusals:,} refusals, {a.rounds:,} rounds per block) | status build, median ms |")
    print("|---|---|")
    for name, row in r["rows"].items():
        print(f"| {name} | {row['median_ms']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
