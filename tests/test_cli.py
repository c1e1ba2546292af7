"""Bad input: a one-line error naming the problem, non-zero exit, no traceback, nothing overwritten."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blocktrain.cli.main import build_parser, main
from blocktrain.presets import tiny
from tests.conftest import write_data_dir


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
    assert rc == 2
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
    import matplotlib.image

    img = matplotlib.image.imread(str(out))  # (height, width, channels) floats in [0, 1]
    assert img.shape[:2] == (round(4.5 * 110), 12 * 110)  # figsize (12, 4.5) inches at 110 dpi
    rgb = img[..., :3]
    assert float(rgb.std()) > 0.05  # not a blank canvas: axes, curves and labels
    assert float((rgb < 0.5).mean()) > 0.001  # some dark ink (text, axes) on the white background


def test_console_entry_point_exit_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "blocktrain", "train-e2e", "--preset", "nope", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("blocktrain: error: unknown preset 'nope'")


def test_eval_names_the_missing_block_file(run_dir: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "blocks" / "block_3.safetensors").unlink()
    assert main(["eval", str(run_dir), "--data", str(data_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("blocktrain: error:")]
    assert len(line) == 1, err
    assert "block_3.safetensors" in line[0] and "train-block" in line[0] and "--preset tiny" in line[0], err
    assert "E2E checkpoint" not in err and "block_2" not in line[0]


def test_checkpoint_of_another_config_on_eval_says_what_is_true(
    run_dir: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((run_dir / "run.json").read_text())
    doc["config"]["model"]["d_model"] = 64  # the run's config no longer matches its checkpoints
    (run_dir / "run.json").write_text(json.dumps(doc))
    assert main(["eval", str(run_dir), "--data", str(data_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "belongs to another run" in err and "run.json" in err
    assert "--preset" not in err  # eval takes no --preset: the run's own config is used


def test_a_block_trained_on_other_data_copied_into_a_run_is_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The architecture was the only check, so block 0 of a run on other data, copied in, was scored, served and
    resumed as this run's own."""
    other_data = write_data_dir(tmp_path / "other-data", n_repeat=41)
    other = tmp_path / "other"
    assert main(["train-block", "--preset", "tiny", "--steps", "2", "--out", str(other), "--data", str(other_data),
                 "--block", "0", "--no-progress"]) == 0
    for name in ("block_0.safetensors", "block_0.state.safetensors"):
        shutil.copy(other / "blocks" / name, run_dir / "blocks" / name)
    assert main(["eval", str(run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "was trained on dataset" in err and "belongs to another run" in err, err


def test_a_resume_with_another_recipe_is_recorded_and_logged(
    run_dir: Path, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A resume may change the recipe (more steps, say), but run.json kept the first one, so it no longer said what
    the run trained with; it now records the recipe it goes on with and each change, and the log names it."""
    with caplog.at_level("WARNING"):
        assert main(["train-block", "--preset", "tiny", "--steps", "5", "--seed", "7", "--out", str(run_dir), "--data",
                     str(data_dir), "--block", "0", "--no-progress", "--log-every", "1"]) == 0
    doc = json.loads((run_dir / "run.json").read_text())
    assert (doc["config"]["train"]["steps"], doc["config"]["train"]["seed"]) == (5, 7)
    (change,) = doc["recipe_changes"]
    assert change["changed"] == {"train.steps": [3, 5], "train.seed": [0, 7], "train.log_every": [tiny().train.log_every, 1]}
    (line,) = [r.getMessage() for r in caplog.records if "another recipe" in r.getMessage()]
    assert line.endswith("train.steps 3 -> 5; train.seed 0 -> 7"), line  # log_every: not what it trains
    assert main(["train-block", "--preset", "tiny", "--steps", "5", "--seed", "7", "--out", str(run_dir), "--data",
                 str(data_dir), "--block", "1", "--no-progress", "--log-every", "1"]) == 0
    assert len(json.loads((run_dir / "run.json").read_text())["recipe_changes"]) == 1  # the same recipe: no change


def _parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [p]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict(action.choices).values():
                out += _parsers(sub)
    return out


def test_every_parser_refuses_abbreviated_flags(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) > 10 and all(not p.allow_abbrev for p in parsers)
    # '--blocks 2' is not '--blocks-alone'; '--max' is not '--max-bytes': both are errors, exit code 2
    for argv in (["eval", "run", "--blocks", "2"], ["eval", "run", "--max", "5"], ["generate", "run", "--temp", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        assert "unrecognized arguments" in capsys.readouterr().err


def test_generate_pipeline_timeout_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import blocktrain.serve.client.pipeline as client
    from blocktrain.errors import ServeError

    seen: list[float] = []

    class FakeClient:
        def __init__(self, address: str, timeout_s: float = 60.0, **kw: object) -> None:
            seen.append(timeout_s)

        async def __aenter__(self) -> FakeClient:
            raise ServeError("no pipeline in this test")

        async def __aexit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(client, "PipelineClient", FakeClient)
    assert main(["generate", "--pipeline", "127.0.0.1:9", "--timeout", "7.5", "--no-progress"]) == 2
    assert seen == [7.5] and "no pipeline in this test" in capsys.readouterr().err


def test_eval_into_a_log_file_prints_few_lines(run_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0"}  # a bar that redraws on every batch
    with log.open("wb") as f:  # not a terminal, as in 'bash scripts/main.sh > log 2>&1'
        proc = subprocess.run(
            [sys.executable, "-m", "blocktrain", "eval", str(run_dir), "--data", str(data_dir), "--batch-size", "1",
             "--blocks-alone"],
            stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    lines = [x for x in re.split(r"[\r\n]+", text) if x.strip()]  # a redraw in place is a line in a log
    assert len(lines) < 50, text
    assert "100%" in text  # each bar still reports its end


def test_token_add_prints_a_token_the_store_keeps_hashed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from blocktrain.coordinator.store import Store

    assert main(["token", "add", "w0", "--run-dir", str(tmp_path / "run")]) == 0
    token = capsys.readouterr().out.strip()
    store = Store(tmp_path / "run")
    try:
        hashes = store.tokens.token_hashes()
    finally:
        store.close()
    assert token.startswith("bt_") and len(hashes) == 1 and hashes[0][0] == "w0"
    assert token not in str(hashes) and hashlib.sha256(token.encode()).hexdigest() in str(hashes)
