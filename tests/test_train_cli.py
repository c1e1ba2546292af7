from __future__ import annotations

import json
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from blocktrain.checkpoint.run import RunDir
from blocktrain.cli.main import main
from blocktrain.config import RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.objectives import get_objective
from blocktrain.presets import tiny
from blocktrain.train import child


def test_train_runs_each_block_in_its_own_process(tmp_path: Path, data_dir: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "3", "--out", str(run), "--data", str(data_dir),
                 "--parallel", "2", "--no-progress"]) == 0
    rd = RunDir(run)
    assert rd.has_blocks(4)
    for k in range(4):
        summary = [json.loads(x) for x in rd.metrics_path(f"block_{k}").read_text().splitlines()][-1]
        assert summary["event"] == "summary" and summary["steps"] == 3
        # the baseline is this process's own: a fresh process per block, so train_mem_bytes is this block's
        # training alone: at least its fp32 weights, gradients and AdamW moments (16 bytes per parameter),
        # and at most that plus tiny's activations and the runtime's first-use buffers (usually 20-120 MiB:
        # lazily loaded libraries count too; once 411 MiB with two bf16 trainings side by side, cause not yet
        # found), so the upper bound only catches gross leaks
        params = sum(p.numel() for p in get_objective(tiny()).build_block(k).parameters())
        assert summary["params"] == params and summary["optimizer_bytes"] == 8 * params
        assert summary["train_mem_bytes"] == summary["peak_rss"] - summary["baseline_rss"]
        analytic = 4 * params + 4 * params + summary["optimizer_bytes"]
        assert analytic <= summary["train_mem_bytes"] <= analytic + 2**30, summary


def test_train_into_a_run_of_another_config_fails_once_with_exit_2(
    tmp_path: Path, data_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    RunDir(run).init(tiny())
    before = (run / "run.json").read_bytes()
    rc = main(["train", "--preset", "tiny", "--blocks", "2", "--out", str(run), "--data", str(data_dir), "--no-progress"])
    err = capfd.readouterr().err  # the file descriptor: a child process would write here too
    assert rc == 2
    lines = [x for x in err.splitlines() if "error" in x.lower()]
    assert len(lines) == 1 and "another model/diffusion config" in lines[0], err
    assert "choose a new --out directory" in lines[0] and "rerun the same command" not in err
    assert not (run / "blocks").exists() and (run / "run.json").read_bytes() == before


@pytest.mark.parametrize("isolate", ["yes", "no"])
def test_train_reports_a_failed_block_truthfully(tmp_path: Path, data_dir: Path, capfd: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch, isolate: str) -> None:
    """In a fresh process the block's own error is printed above; in this one (``--isolate no``, tiny's default) the
    message carries it: either way it names the block and says what to do."""
    monkeypatch.setattr(child, "START_METHOD", "fork")  # the block processes: forked, not re-imported
    run = tmp_path / "run"
    cfg = tiny()
    cfg = replace(cfg, model=replace(cfg.model, n_blocks=2))
    rd = RunDir(run)
    rd.init(cfg)
    rd.block_path(1).parent.mkdir(parents=True)
    rd.block_path(1).write_bytes(b"not a checkpoint")  # block 1 cannot resume from this
    rc = main(["train", "--preset", "tiny", "--blocks", "2", "--steps", "2", "--out", str(run), "--data", str(data_dir),
               "--no-progress", "--isolate", isolate])
    err = capfd.readouterr().err
    assert rc == 2
    assert "fix its cause" in err.lower(), err
    if isolate == "yes":
        assert "training failed for blocks [1]" in err, err
    else:
        assert "training failed for block 1: " in err and "not a safetensors file" in err, err
    assert "rerun the same command to resume them" not in err
    assert rd.block_path(0).is_file()


def test_tiny_trains_its_blocks_in_this_process_and_the_others_in_fresh_ones(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--isolate auto`` (the default): tiny's arms train in well under the second a fresh interpreter takes to import
    torch, so they train here; ``--isolate yes`` or ``--parallel`` start a process per block, and ``--isolate no`` with
    ``--parallel`` is refused with what to do."""
    started: list[int] = []
    real = child._start

    def start(cfg: RunConfig, data: DataDir, out: Path, k: int, progress: bool) -> BaseProcess:
        started.append(k)
        return real(cfg, data, out, k, progress)

    monkeypatch.setattr(child, "START_METHOD", "fork")
    monkeypatch.setattr(child, "_start", start)
    base = ["train", "--preset", "tiny", "--blocks", "2", "--steps", "1", "--data", str(data_dir), "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0 and started == []
    assert RunDir(tmp_path / "a").has_blocks(2)
    assert main([*base, "--out", str(tmp_path / "b"), "--isolate", "yes"]) == 0 and started == [0, 1]
    assert main([*base, "--out", str(tmp_path / "c"), "--isolate", "no", "--parallel", "2"]) == 2
    assert "drop --isolate no" in capsys.readouterr().err and not (tmp_path / "c" / "blocks").exists()


def test_train_block_refuses_a_block_outside_the_run(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--block -1`` trained the E2E reference (its arm index) under the name of a block; -1 and B are refused."""
    for k in ("-1", "4"):
        assert main(["train-block", "--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "run"), "--data",
                     str(data_dir), "--block", k, "--no-progress"]) == 2
        assert "out of range" in capsys.readouterr().err
    assert not (tmp_path / "run" / "e2e.safetensors").exists() and not any((tmp_path / "run").glob("**/*.safetensors"))


@pytest.mark.parametrize("isolate", ["yes", "no"])
def test_sigterm_stops_a_training_as_ctrl_c_does(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                 isolate: str) -> None:
    """``kill PID`` (or a service manager's stop) sends SIGTERM, whose default action killed ``train`` and its block
    process at once, losing every step since the last checkpoint (up to --checkpoint-every). It now stops the run as
    Ctrl-C does: the block process is told to stop too, saves its checkpoint, and the command exits 130."""
    import os
    import signal
    import subprocess
    import time

    from blocktrain.checkpoint.safetensors_io import load_file
    from tests.forked_cli import spawn

    monkeypatch.setattr(child, "START_METHOD", "fork")  # the block processes: forked, not re-imported
    run = tmp_path / "run"
    proc = spawn(["train", "--preset", "tiny", "--steps", "1000000", "--checkpoint-every", "1000000", "--log-every", "1",
                  "--out", str(run), "--data", str(data_dir), "--no-progress", "--isolate", isolate],
                 stderr=subprocess.PIPE)
    metrics = RunDir(run).metrics_path("block_0")
    deadline = time.monotonic() + 60
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the training did not start"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # this process alone, as ``kill PID`` sends it
    assert proc.wait(timeout=60) == 130
    assert proc.stderr is not None and b"interrupted" in proc.stderr.read()
    assert int(load_file(RunDir(run).block_path(0))[1]["step"]) >= 3  # saved on the way out


def test_an_arm_takes_only_the_first_stop_signal_so_its_save_is_not_cut_short() -> None:
    """Ctrl-C reaches the whole process group, so a block process got SIGINT, began saving its checkpoint, and then
    the parent's SIGTERM (it stops its arms when interrupted) raised a second KeyboardInterrupt inside the save. The
    arm's handler now ignores every later SIGINT and SIGTERM. (Run here on this process's handlers, put back after.)"""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt):
            child._interrupt_once(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
