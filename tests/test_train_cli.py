from __future__ import annotations

import json
from pathlib import Path

from blocktrain.checkpoint.run import RunDir
from blocktrain.cli.main import main


def test_train_runs_each_block_in_its_own_process(tmp_path: Path, data_dir: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "3", "--out", str(run), "--data", str(data_dir),
                 "--parallel", "2", "--no-progress"]) == 0
    rd = RunDir(run)
    assert rd.has_blocks(4)
    for k in range(4):
        summary = [json.loads(x) for x in rd.metrics_path(f"block_{k}").read_text().splitlines()][-1]
        assert summary["event"] == "summary" and summary["steps"] == 3
        # the baseline is this process's own: a fresh process per block
        assert summary["baseline_rss"] < summary["peak_rss"]
