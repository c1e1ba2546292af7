"""Bad input: a one-line error naming the problem, non-zero exit, no traceback, nothing overwritten."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from blocktrain.cli.main import main


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run_dir(tmp_path: Path, data_dir: Path) -> Path:
    run = tmp_path / "run"
    for k in range(4):
        assert main(["train-block", "--preset", "tiny", "--steps", "3", "--out", str(run), "--data", str(data_dir),
                     "--block", str(k), "--no-progress"]) == 0
    return run


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--preset", "gigantic"], "unknown preset 'gigantic'"),
        (["--blocks", "3"], "does not divide"),
        (["--sigma-min", "60"], "sigma_min"),
        (["--block", "9"], "block index 9 is out of range"),
        (["--preset", "cpu-mini"], "another model/diffusion config"),
    ],
)
def test_bad_train_input(
    run_dir: Path, data_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    before = _snapshot(run_dir)
    args = ["train-block", "--preset", "tiny", "--out", str(run_dir), "--data", str(data_dir), "--block", "0",
            "--no-progress"]
    # later flags win in argparse
    rc = main(args + extra)
    err = capsys.readouterr().err
    assert rc != 0
    line = [x for x in err.splitlines() if x.startswith("blocktrain: error:")]
    assert len(line) == 1 and needle in line[0], err
    assert "Traceback" not in err
    assert _snapshot(run_dir) == before


def test_corrupt_checkpoint_on_eval(run_dir: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = run_dir / "blocks" / "block_2.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x55
    path.write_bytes(bytes(raw))
    before = _snapshot(run_dir)
    assert main(["eval", str(run_dir), "--data", str(data_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and "block_2" in err and "Traceback" not in err
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("problem", ["missing", "empty"])
def test_bad_data_split(tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "wiki.valid.tokens").write_text("some text\n")
    (d / "wiki.test.tokens").write_text("some text\n")
    if problem == "empty":
        (d / "wiki.train.tokens").write_bytes(b"")
    rc = main(["train-e2e", "--preset", "tiny", "--out", str(tmp_path / "r"), "--data", str(d), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and ("empty" if problem == "empty" else "missing") in err and "wiki.train" in err
    assert not (tmp_path / "r").exists()


def test_eval_json_and_generate(run_dir: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(run_dir), "--data", str(data_dir), "--split", "valid", "--json", "--chains", "2",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "blocktrain" and out["split"] == "valid" and out["chains"] == 2
    assert out["bytes_scored"] == (data_dir / "wiki.valid.tokens").stat().st_size - 1
    assert main(["generate", str(run_dir), "--prompt", "The ", "--bytes", "5", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("The ")


def test_plot_writes_png(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "c.png"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n".decode("unicode_escape").encode("latin-1")


def test_console_entry_point_exit_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "blocktrain", "train-e2e", "--preset", "nope", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("blocktrain: error: unknown preset 'nope'")
