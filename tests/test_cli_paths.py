"""User-facing CLI paths end to end, tiny and on loopback: bench quality, eval --blocks-alone,
serving the E2E baseline, --next failover, and verified data directories."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from blocktrain.bench.quality import QualityOptions, _Bench
from blocktrain.checkpoint.run import RunDir
from blocktrain.cli.main import main
from blocktrain.data import integrity
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import ConfigError
from blocktrain.presets import tiny
from tests.conftest import write_data_dir
from tests.forked_cli import ForkedCli, spawn
from tests.serve_utils import free_ports, wait_port

SHAPE = "d_model=32,n_heads=2,n_layers=4,n_blocks=4,context=32,mlp_ratio=2"  # tiny's model
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LN256 = math.log(256)


# --- bench quality ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quality(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Path]:
    """One tiny `bench quality --objective both` (about a minute: every block trains in its own process)."""
    root = tmp_path_factory.mktemp("quality")
    data = write_data_dir(root / "data")
    out = root / "q.json"
    assert main(["bench", "quality", "--preset", "tiny", "--data", str(data), "--steps", "4", "--no-lr-sweep",
                 "--max-eval-bytes", "4096", "--eval-bytes", "512", "--objective", "both", "--out", str(root / "runs"),
                 "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text()), data, root


def test_bench_quality_tiny_end_to_end(quality: tuple[dict[str, Any], Path, Path]) -> None:
    q, data, root = quality
    assert (q["benchmark"], q["preset"], q["objective"], q["primary_objective"]) == ("quality", "tiny", "both", "stack")
    assert (root / "q.md").is_file()
    n_test = (data / "wiki.test.tokens").stat().st_size
    assert q["bytes_scored"] == min(4096, n_test - 1)
    assert set(q["objectives"]) == {"stack", "diffusion"}
    e2e, bt = q["e2e"], q["blocktrain"]
    # CE of every model in (0, 6) nats/byte: 4 steps barely move off uniform (ln 256 = 5.55)
    ces = [e2e["ce_nats_per_byte"], q["e2e_matched_flops"]["ce_nats_per_byte"], *q["blocks_alone_ce"]]
    for name, ev in q["objectives"].items():
        ces += [ev["ce_nats_per_byte"], *ev.get("prefix_ce", []), *ev.get("blocks_alone_ce", [])]
        assert ev["bytes_scored"] == q["bytes_scored"], name
        assert ev["train_steps_per_block"] == [4, 4, 4, 4], name
    assert all(0.0 < c < 6.0 for c in ces), ces
    # each arm's validation CE at the end of its training (what lrs are picked by): every block's, the matched E2E's
    vals = [*q["objectives"]["stack"]["val_prefix_ce"], *q["objectives"]["diffusion"]["val_blocks_alone_ce"],
            q["e2e_matched_flops"]["val_ce"]]
    assert len(vals) == 9 and all(0.0 < v < 6.0 for v in vals), vals
    # the stack's composed model is its last prefix; its gain is over the best prefix
    assert bt["objective"] == "stack" and len(bt["prefix_ce"]) == 4
    assert bt["prefix_ce"][-1] == pytest.approx(bt["ce_nats_per_byte"], abs=1e-12)
    assert len(q["blocks_alone_ce"]) == 4  # the diffusion run's blocks alone
    for gain, want in (
        (q["gap_nats_per_byte"], bt["ce_nats_per_byte"] - e2e["ce_nats_per_byte"]),
        (bt["compositional_gain_nats_per_byte"], bt["prefix_ce"][0] - bt["ce_nats_per_byte"]),
        (bt["gap_matched_flops_nats_per_byte"], bt["ce_nats_per_byte"] - q["e2e_matched_flops"]["ce_nats_per_byte"]),
    ):
        assert math.isfinite(gain) and gain == pytest.approx(want, abs=1e-12)
    # tiny trains every arm in the bench's own process: no arm has a peak memory of its own, so none is reported
    worker = q["block_worker"]
    assert q["arms_isolated"] is False and q["test_bytes_limit"] == 4096
    assert q["memory_ratio_block_over_e2e"] is None and worker["train_mem_bytes"] is None and e2e["train_mem_bytes"] is None
    assert "train memory" not in (root / "q.md").read_text() and "one process" in (root / "q.md").read_text()
    for analytic in (e2e["analytic"], worker["analytic"]):
        assert analytic["total_state_bytes"] == 16 * analytic["params"]  # fp32 weights, grads, two AdamW moments
    assert e2e["train_steps"] == 4 and e2e["train_flops"] == pytest.approx(4 * e2e["flops_per_step"])
    assert 0 < e2e["mfu"] < 1 and 0 < worker["mfu"] < 1


def test_bench_quality_matched_flops_e2e_trains_the_steps_it_reports(quality: tuple[dict[str, Any], Path, Path]) -> None:
    q, _, root = quality
    matched = q["e2e_matched_flops"]
    lines = RunDir(root / "runs" / "e2e-matched-flops").metrics_path("e2e").read_text().splitlines()
    summary = [json.loads(x) for x in lines][-1]
    assert matched["steps"] > 4 and summary["steps"] == matched["steps"]


def test_bench_quality_rederive_recomputes_the_gain(quality: tuple[dict[str, Any], Path, Path], tmp_path: Path) -> None:
    """--rederive recomputes derived figures from the stored CEs (an old file: the stack's gain against its best prefix)."""
    q, _, _ = quality
    old = json.loads(json.dumps(q))
    old["objectives"]["stack"]["compositional_gain_nats_per_byte"] = 0.0
    src = tmp_path / "old.json"
    src.write_text(json.dumps(old))
    assert main(["bench", "quality", "--rederive", str(src), "--json", str(tmp_path / "new.json")]) == 0
    new = json.loads((tmp_path / "new.json").read_text())
    st = new["objectives"]["stack"]
    assert st["compositional_gain_nats_per_byte"] == pytest.approx(st["prefix_ce"][0] - st["ce_nats_per_byte"], abs=1e-12)
    assert new["blocktrain"] == st and st["ce_nats_per_byte"] == q["objectives"]["stack"]["ce_nats_per_byte"]
    assert "compositional gain" in (tmp_path / "new.md").read_text()


def test_bench_quality_e2e_once_at_matched_flops(tmp_path: Path) -> None:
    """--no-matched-steps (the long budget): the stack first, then one E2E run at its training FLOPs, reported as ``e2e``."""
    data = write_data_dir(tmp_path / "data")
    out = tmp_path / "q.json"
    # the lr sweep needs the matched-steps E2E: refused before anything trains
    assert main(["bench", "quality", "--preset", "tiny", "--data", str(data), "--no-matched-steps", "--objective", "stack",
                 "--out", str(tmp_path / "refused")]) == 2
    assert not (tmp_path / "refused").exists()
    assert main(["bench", "quality", "--preset", "tiny", "--data", str(data), "--steps", "3", "--no-lr-sweep",
                 "--no-matched-steps", "--max-eval-bytes", "1024", "--eval-bytes", "0", "--objective", "stack",
                 "--out", str(tmp_path / "runs"), "--json", str(out), "--no-progress"]) == 0
    q = json.loads(out.read_text())
    assert q["e2e_is_matched_flops"] and not (tmp_path / "runs" / "e2e-lr0.003").exists() and not q["resumed"]
    # the same bench again: refused without --resume (or --fresh); with it, every arm goes on from its last checkpoint,
    # here the last, so nothing trains and the CEs are the same
    assert main(args := ["bench", "quality", "--preset", "tiny", "--data", str(data), "--steps", "3", "--no-lr-sweep",
                         "--no-matched-steps", "--max-eval-bytes", "1024", "--eval-bytes", "0", "--objective", "stack",
                         "--out", str(tmp_path / "runs"), "--no-progress"]) == 2
    assert main([*args, "--resume", "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["resumed"] and "Resumed" in (tmp_path / "again.md").read_text()
    assert again["e2e"]["ce_nats_per_byte"] == q["e2e"]["ce_nats_per_byte"]
    assert again["objectives"]["stack"]["ce_nats_per_byte"] == q["objectives"]["stack"]["ce_nats_per_byte"]
    # an arm already finished reports the timings recorded when it trained (they were NaN: no step ran)
    assert again["e2e"]["seconds_per_step"] == q["e2e"]["seconds_per_step"] and math.isfinite(again["e2e"]["mfu"])
    # another seed (or any other training option) on that directory is not a resume of it: refused, nothing trained
    assert main([*args, "--resume", "--seed", "1"]) == 2
    m, e2e, st = q["e2e_matched_flops"], q["e2e"], q["objectives"]["stack"]
    assert e2e["train_steps"] == m["steps"] and e2e["ce_nats_per_byte"] == m["ce_nats_per_byte"]
    assert e2e["train_flops"] == pytest.approx(m["train_flops"], rel=1e-9)  # the analytic FLOPs are the trainer's
    assert m["train_flops"] == pytest.approx(st["train_flops"], rel=0.5 / m["steps"] + 1e-9)  # rounded to whole steps
    assert st["gap_nats_per_byte"] == pytest.approx(st["gap_matched_flops_nats_per_byte"], abs=1e-12)


def test_an_isolated_arm_trains_in_its_own_process_and_reports_its_memory(tmp_path: Path) -> None:
    """``--isolate yes`` (every preset but tiny): the arm is a child process, so its peak memory is its own."""
    data = write_data_dir(tmp_path / "data")
    cfg = replace(tiny(), train=replace(tiny().train, steps=2, eval_bytes=0))
    with pytest.raises(ConfigError, match="--eval-bytes 0 scores none"):  # an lr sweep would pick lr x0.5 unseen
        QualityOptions(cfg=cfg, data=open_data_dir(data), out=tmp_path / "q")
    opts = QualityOptions(cfg=cfg, data=open_data_dir(data), out=tmp_path / "q", progress=True, isolate=True,
                          lr_sweep=False)
    bench = _Bench(opts, planned_flops=opts.e2e_flops_step * 2)
    summary = bench.e2e(tmp_path / "q" / "e2e", 2)
    assert summary["steps"] == 2 and summary["train_mem_bytes"] > 0 and bench.arms == 1
    assert bench.bar.n == pytest.approx(opts.e2e_flops_step * 2 / 1e9)  # the progress bar counts the arm's FLOPs


# --- eval --blocks-alone ------------------------------------------------------------------------------------


def _train_blocks(run: Path, data: Path, objective: str) -> None:
    for k in range(4):
        assert main(["train-block", "--preset", "tiny", "--objective", objective, "--steps", "2", "--out", str(run),
                     "--data", str(data), "--block", str(k), "--eval-bytes", "0", "--no-progress"]) == 0


def _floats(line: str) -> list[float]:
    return [float(v) for v in line.split("  (")[0].split(maxsplit=2)[-1].split(", ")]


@pytest.mark.parametrize("objective", ["stack", "diffusion"])
def test_eval_blocks_alone_prints_the_objectives_references(
    objective: str, tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _train_blocks(run, data_dir, objective)
    capsys.readouterr()
    common = ["eval", str(run), "--data", str(data_dir), "--split", "valid", "--blocks-alone", "--no-progress"]
    assert main([*common, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert main(common) == 0
    text = capsys.readouterr().out.splitlines()
    key, label = ("prefix_ce", "prefix CE") if objective == "stack" else ("blocks_alone_ce", "blocks alone")
    other = "blocks_alone_ce" if objective == "stack" else "prefix_ce"
    assert r["objective"] == objective and other not in r
    refs = r[key]
    assert len(refs) == 4 and all(0 < c < 2 * LN256 for c in refs)
    reference = refs[0] if objective == "stack" else min(refs)  # first prefix, or best block alone
    assert r["compositional_gain_nats_per_byte"] == pytest.approx(reference - r["ce_nats_per_byte"], abs=1e-12)
    if objective == "stack":  # the composed stack is its last prefix
        assert refs[-1] == pytest.approx(r["ce_nats_per_byte"], abs=1e-12)
    printed = [ln for ln in text if ln.startswith(label)]
    assert len(printed) == 1 and _floats(printed[0]) == pytest.approx(refs, abs=5e-5)  # printed to 4 decimals
    assert any(ln.startswith("gain") for ln in text)


# --- serving from the CLI -----------------------------------------------------------------------------------


@contextmanager
def _stages(*argvs: list[str]) -> Iterator[None]:
    """Start `blocktrain serve` processes in order; each argv must hold --listen 127.0.0.1:PORT."""
    procs: list[ForkedCli] = []
    try:
        for argv in argvs:
            proc = spawn(["serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
            procs.append(proc)
            wait_port(int(argv[argv.index("--listen") + 1].rsplit(":", 1)[1]), proc)
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def _generate(port: int, mode: str, n: int = 6) -> str:
    """`blocktrain generate --pipeline` in this process (the stages are the processes under test)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["generate", "--pipeline", f"127.0.0.1:{port}", "--mode", mode, "--bytes", str(n), "--prompt", "abc",
                   "--temperature", "0", "--timeout", "30"])
    assert rc == 0
    return out.getvalue()


def test_serve_e2e_model_answers_generate_baseline() -> None:
    """`serve --model e2e` (two stages of E2E layers) answers `generate --mode baseline` (KV cache)."""
    p0, p1 = free_ports(2)
    with _stages(["--model", "e2e", "--random", SHAPE, "--layers", "0-1", "--listen", f"127.0.0.1:{p0}",
                  "--next", f"127.0.0.1:{p1}"],
                 ["--model", "e2e", "--random", SHAPE, "--layers", "2-3", "--listen", f"127.0.0.1:{p1}"]):
        first = _generate(p0, "baseline")
        assert first.startswith("abc") and first.endswith("\n")
        assert _generate(p0, "baseline") == first  # greedy: the same continuation twice
        recomputed = _generate(p0, "ar")
    assert recomputed == first  # the KV-cached baseline continues exactly as recomputing every prefix does


def test_next_replicas_fail_over_from_a_dead_address() -> None:
    """Stage 0 `--next DEAD,LIVE`: the dead replica is skipped and the pipeline answers as one whole stage does."""
    dead, p0, p1, whole = free_ports(4)
    with _stages(["--random", SHAPE, "--blocks", "2-3", "--listen", f"127.0.0.1:{p1}"],
                 ["--random", SHAPE, "--blocks", "0-1", "--listen", f"127.0.0.1:{p0}",
                  "--next", f"127.0.0.1:{dead},127.0.0.1:{p1}"],
                 ["--random", SHAPE, "--blocks", "0-3", "--listen", f"127.0.0.1:{whole}"]):
        got = _generate(p0, "ar")
        want = _generate(whole, "ar")
    assert got.startswith("abc") and got == want  # random weights are seeded per block: the same model


# --- DataDir.open(verify=True) ------------------------------------------------------------------------------


def test_open_verify_checks_the_published_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dd = open_data_dir(write_data_dir(tmp_path / "data"))
    path = dd.path("valid")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    caplog.set_level(logging.WARNING, logger="blocktrain.data.dataset")
    monkeypatch.setitem(integrity.KNOWN_SHA256, path.name, got)
    split = dd.open("valid", verify=True)
    assert len(split) == path.stat().st_size and not caplog.records  # the published file: silent
    monkeypatch.setitem(integrity.KNOWN_SHA256, path.name, "0" * 64)
    dd.open("valid", verify=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} has sha256 {got}, not the published {'0' * 64}; results will not be comparable"
    ]
    caplog.clear()
    dd.open("valid")  # verify=False does not hash the file
    assert not caplog.records


def test_serve_random_builds_a_stack_that_drafts_for_itself() -> None:
    """`serve --random SHAPE --objective stack`: a stack stage with random weights, so spec mode runs (greedy spec
    equals greedy ar); without --objective the blocks stay diffusion blocks (the scale run's)."""
    from blocktrain.config import Objective
    from blocktrain.serve.runtime.diffusion import BlockSpan
    from blocktrain.serve.runtime.loading import parse_shape, random_run_span
    from blocktrain.serve.runtime.stack import StackSpan

    assert isinstance(random_run_span(parse_shape(SHAPE, objective=Objective.STACK), 0, 1), StackSpan)
    assert cast(BlockSpan, random_run_span(parse_shape(SHAPE), 0, 1)).family != "stack"  # a diffusion span
    (port,) = free_ports(1)
    with _stages(["--random", SHAPE, "--objective", "stack", "--blocks", "0-3", "--listen", f"127.0.0.1:{port}"]):
        spec = _generate(port, "spec", n=8)
        ar = _generate(port, "ar", n=8)
    assert spec.startswith("abc") and spec == ar


def test_the_bench_counts_the_e2e_s_flops_as_its_trainer_does_under_recompute(tmp_path: Path) -> None:
    """--recompute runs each layer's forward twice: the E2E trainer and the stack's blocks count it, the bench's
    matched-FLOPs arithmetic did not (cpu-small: 44.4M against 59.1M FLOPs per token), so the matched E2E got 1.33x
    the stack's FLOPs by its own count."""
    from blocktrain.train.e2e import train_e2e

    data = write_data_dir(tmp_path / "data")
    cfg = replace(tiny(), train=replace(tiny().train, steps=1, eval_bytes=0, recompute=True))
    summary = train_e2e(cfg, open_data_dir(data), tmp_path / "run", progress=False)
    opts = QualityOptions(cfg=cfg, data=open_data_dir(data), out=tmp_path / "q", lr_sweep=False)
    assert opts.e2e_flops_step == pytest.approx(summary.flops_per_step, rel=1e-12)
