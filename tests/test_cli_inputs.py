"""Bad flag values: a one-line error naming the flag and its range, exit 2, no traceback, nothing deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blocktrain.bench import speed
from blocktrain.cli.main import build_parser, main
from blocktrain.config import SEED_LIMIT, TrainConfig
from blocktrain.data.stream import mix_seed
from blocktrain.errors import ConfigError
from blocktrain.seeds import E2E_INIT, init_seed
from tests.conftest import write_data_dir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny run (every block one step) and its data."""
    root = tmp_path_factory.mktemp("inputs")
    data, run = write_data_dir(root / "data"), root / "run"
    for k in range(4):
        assert main(["train-block", "--preset", "tiny", "--steps", "1", "--out", str(run), "--data", str(data),
                     "--block", str(k), "--no-progress"]) == 0
    return run, data


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run ``argv``: exit 2 and one error line holding every needle; that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("blocktrain: error:")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--batch-size", "0", ">= 1"),  # was ValueError: range() arg 3 must not be zero
    ("--chains", "0", ">= 1"),  # was ValueError: chains must be >= 1
    ("--max-bytes", "-5", ">= 0"),  # was "a split of -4 bytes has nothing to score"
])
def test_eval_refuses_bad_flags(tiny_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str], flag: str, value: str,
                                needle: str) -> None:
    run, data = tiny_run
    refused(["eval", str(run), "--data", str(data), "--no-progress", flag, value], capsys, flag, needle)


def test_eval_max_bytes_zero_scores_the_whole_split(tiny_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    """--max-bytes 0 is the whole split, as bench quality's --max-eval-bytes 0 (it was 'a split of 1 bytes')."""
    run, data = tiny_run
    scored = []
    for extra in ([], ["--max-bytes", "0"]):
        capsys.readouterr()
        assert main(["eval", str(run), "--data", str(data), "--no-progress", "--json", *extra]) == 0
        scored.append(json.loads(capsys.readouterr().out)["bytes_scored"])
    assert scored[0] == scored[1] > 1


@pytest.mark.parametrize(("flag", "value"), [
    ("--bytes", "-1"),  # was ValueError: n_bytes must be >= 0
    ("--temperature", "-1"),  # was sampled greedily, silently
    ("--temperature", "nan"),
    ("--top-k", "-3"),  # was every byte, silently
    ("--seed", "-1"),
    ("--seed", str(2**63)),  # was struct.error in mix_seed
])
def test_generate_refuses_bad_flags(tiny_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str], flag: str,
                                    value: str) -> None:
    run, _ = tiny_run
    refused(["generate", str(run), "--bytes", "2", "--no-progress", flag, value], capsys, flag)


def test_generate_takes_greedy_and_all_bytes(tiny_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The ends of the ranges: temperature 0 is greedy, top-k 0 keeps every byte, 0 bytes prints the prompt."""
    run, _ = tiny_run
    for extra in (["--temperature", "0", "--top-k", "0"], ["--bytes", "0"]):
        assert main(["generate", str(run), "--bytes", "2", "--no-progress", *extra]) == 0


@pytest.mark.parametrize("under", [False, True])
def test_prepare_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], under: bool) -> None:
    """--out FILE was NotADirectoryError, --out FILE/sub FileExistsError."""
    src = write_data_dir(tmp_path / "src") / "wiki.train.tokens"
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    out = file / "sub" if under else file
    refused(["prepare", str(src), "--out", str(out)], capsys, "--out", "not a directory")
    assert file.read_text() == "mine\n"


def test_rederive_of_a_missing_or_broken_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--rederive missing.json was FileNotFoundError."""
    refused(["bench", "quality", "--rederive", str(tmp_path / "missing.json")], capsys, "--rederive", "cannot read")
    (tmp_path / "broken.json").write_text("{")
    refused(["bench", "quality", "--rederive", str(tmp_path / "broken.json")], capsys, "--rederive", "not JSON")
    (tmp_path / "other.json").write_text("[1]")
    refused(["bench", "quality", "--rederive", str(tmp_path / "other.json")], capsys, "not a bench quality result")


def test_coordinator_takes_no_compile_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """The coordinator never read train.compile (it trains nothing); workers compile with their own --compile."""
    base = ["coordinator", "--preset", "tiny", "--run-dir", "r"]
    assert build_parser().parse_args(base).fn.__name__ == "cmd_coordinator"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*base, "--compile", "default"])
    assert exc.value.code == 2 and "--compile" in capsys.readouterr().err
    worker = build_parser().parse_args(["worker", "--coordinator", "http://x", "--compile", "default"])
    assert worker.worker__compile.value == "default"


def test_train_seed_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A seed of 2**63 was taken, then failed deep inside: struct.error in mix_seed, or torch.manual_seed's overflow of
    init_seed = seed * 1009 + role. Seeds below SEED_LIMIT (every seed that trained before) work end to end."""
    for bad in (-1, SEED_LIMIT, 2**63):
        with pytest.raises(ConfigError, match="--seed"):
            TrainConfig(seed=bad)
    top = SEED_LIMIT - 1
    TrainConfig(seed=top)
    torch.Generator().manual_seed(init_seed(top, E2E_INIT))
    mix_seed(top, 2**62, 2**62, 2**62)
    data = write_data_dir(tmp_path / "data")
    argv = ["train-block", "--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "run"), "--data", str(data),
            "--block", "0", "--no-progress"]
    refused([*argv, "--seed", str(2**63)], capsys, "seed", "--seed")
    assert not (tmp_path / "run").exists()
    assert main([*argv, "--seed", str(top)]) == 0


class TimedError(Exception):
    """Raised where the bench would start timing: its --out has been dealt with by then."""


@pytest.fixture
def no_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    def stop(*args: object, **kwargs: object) -> None:
        raise TimedError

    monkeypatch.setattr(speed, "measure_peak_flops", stop)


def test_bench_speed_keeps_an_out_that_is_not_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      no_timing: None) -> None:
    """bench speed deleted its --out unconditionally: `--out .` or `--out runs/notes` lost that directory."""
    data = write_data_dir(tmp_path / "data")
    notes = tmp_path / "notes"
    (notes / "e2e-fp32").mkdir(parents=True)  # one of the bench's own names beside a file of the user's
    (notes / "plan.md").write_text("mine\n")
    argv = ["bench", "speed", "--preset", "tiny", "--data", str(data)]
    refused([*argv, "--out", str(notes)], capsys, f"--out {notes}", "plan.md", "pick another --out")
    assert (notes / "plan.md").read_text() == "mine\n" and (notes / "e2e-fp32").is_dir()
    refused([*argv, "--out", str(notes / "plan.md")], capsys, "not a directory")
    # an earlier bench's directory (its arms, the reference commit's runs) is replaced, as before
    earlier = tmp_path / "bench"
    for name in ("e2e-fp32", "block-bf16", "stack_block-compiled", "e2e-reference"):
        (earlier / name / "metrics").mkdir(parents=True)
    with pytest.raises(TimedError):
        main([*argv, "--out", str(earlier)])
    assert earlier.is_dir() and not any(earlier.iterdir())
    # and so is one holding the result it wrote there itself (--json inside --out), but not another JSON file
    (earlier / "e2e-fp32").mkdir()
    for name in ("speed.json", "speed.md"):
        (earlier / name).write_text("{}")
    with pytest.raises(TimedError):
        main([*argv, "--out", str(earlier), "--json", str(earlier / "speed.json")])
    assert not any(earlier.iterdir())
    (earlier / "other.json").write_text("{}")
    refused([*argv, "--out", str(earlier), "--json", str(earlier / "speed.json")], capsys, "other.json")
