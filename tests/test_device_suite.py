"""The device suite's smoke (issue 42): ``SUITE=smoke DEVICE=cpu bash scripts/device_suite.sh`` runs its jobs at
the tiny preset on CPU (the paper-width job is GPU-only), writes every result file, packs them into one archive,
and a second run resumes (skips the finished jobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.distributed_utils import write_corpus

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(420)]


def _suite(results: Path, data: Path, **extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "SUITE": "smoke", "DEVICE": "cpu", "RESULTS": str(results), "DATA": str(data),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}
    t0 = time.perf_counter()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh")], env=env, capture_output=True, text=True,
                          timeout=400)
    return done, time.perf_counter() - t0


def test_the_smoke_suite_runs_every_job_packs_and_resumes(tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "data").root
    results = tmp_path / "device-suite"
    done, wall = _suite(results, data)
    assert done.returncode == 0, done.stderr[-3000:]
    rcs = {p.stem: p.read_text().split()[0] for p in results.glob("*.rc")}
    jobs = ("checks", "noise-speed", "optimizer-speed", "speed-tiny", "depth", "averaging", "live", "serve", "audit")
    assert rcs == dict.fromkeys((*jobs, "summaries"), "0"), (rcs, done.stderr[-3000:])
    checks = json.loads((results / "device-checks.json").read_text())
    assert checks["ok"] and checks["noise_hashes_equal"] and checks["device"] == "cpu"
    assert checks["optimizer_max_abs_diff"] == 0.0  # the CPU against itself
    noise = json.loads((results / "device-noise-speed.json").read_text())
    assert [r["preset"] for r in noise["rows"]] == ["cpu-mini", "cpu-small", "paper"]
    opt = json.loads((results / "device-optimizer-speed.json").read_text())
    assert [r["preset"] for r in opt["rows"]] == ["cpu-mini"] and opt["rows"][0]["round_adamw_s"] > 0
    speed = json.loads((results / "device-speed-tiny.json").read_text())
    assert speed["device"] == "cpu"
    for trainer in ("e2e", "block", "stack_block"):  # every bf16 run profiled: its top operators, by own time
        ops = speed[trainer]["bf16_profile"]
        assert ops and all(0 <= o["share"] <= 1 and o["calls"] >= 1 for o in ops)
    depth = json.loads((results / "device-depth.json").read_text())
    (row,) = depth["rows"]
    assert row["key"] == "tiny-lr2e-3-seed0" and row["device"] == "cpu" and row["lr"] == 2e-3
    assert row["preset"] == "tiny" and set(row["ce"]) == {"stack", "stack_prefix0", "e2e_matched_flops"}
    assert "gap_stack_minus_e2e" in depth["summary"]["tiny"]
    assert json.loads((results / "device-averaging.json").read_text())
    avg = [json.loads(line) for line in (results / "averaging.jsonl").read_text().splitlines()]
    workers = [r for r in avg if r["kind"] == "m"]  # the volunteers' rows run the coordinator's default
    assert {r["block"] for r in workers} == {"cold", "stack"} and {r["inner_start"] for r in workers} == {"shared_mv"}
    audit = json.loads((results / "device-audit.json").read_text())  # the worker on the device, replays on the CPU
    cases = {r["case"] for r in audit["rows"] if r["replay_device"] == "cpu"}
    assert {"honest", "honest, derived from 1 rounds"} <= cases, cases
    live = json.loads((results / "device-live.json").read_text())
    assert {r["row"] for r in live["http"]["rows"]} == {"honest6", "sign_flip"}
    with tarfile.open(f"{results}.tar.gz") as tar:  # the archive holds what the folder holds, but the checkpoints
        names = set(tar.getnames())
    assert f"{results.name}/device-depth.json" in names and f"{results.name}/device-live.json" in names
    assert any(results.glob("runs/**/*.safetensors")) and not any(n.endswith(".safetensors") for n in names)
    again, wall_again = _suite(results, data)
    assert json.loads((results / "device-serve.json").read_text())
    assert again.returncode == 0 and again.stderr.count("done already, skipped") == len(jobs), again.stderr[-2000:]
    assert "summaries: start" in again.stderr  # made again from the rows, every run
    assert wall_again < wall / 3


def test_a_job_past_the_deadline_is_skipped_not_marked_done(tmp_path: Path) -> None:
    """DEADLINE_S bounds the whole suite (a lent GPU gives ten minutes a command): a job with under 30 s left is
    skipped, and not marked done, so the next run does it; the archive goes to ARCHIVE."""
    data = write_corpus(tmp_path / "data").root
    results, archive = tmp_path / "device-suite", tmp_path / "out" / "suite.tar.gz"
    archive.parent.mkdir()
    done, _ = _suite(results, data, DEADLINE_S="20", ARCHIVE=str(archive))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("before the deadline (the next run does it)") >= 8, done.stderr[-3000:]
    assert not list(results.glob("*.done")) and archive.is_file()


def test_depth_rows_resume_from_the_rows_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``device_depth.py rows`` trains only the (lr, seed) pairs whose key is not in the JSONL yet (a line cut short
    is skipped, not fatal; 0.002 is the 2e-3 done), keys each as its lr is written, and counts a bench that fails, or exits 0 without its
    JSON, as a missing row; the rows after it still run."""
    from benchmarks.quality import device_depth

    jsonl = tmp_path / "depth.jsonl"
    done = {"key": "tiny-lr2e-3-seed0", "preset": "tiny", "lr": 2e-3, "seed": 0,
            "recipe": device_depth.recipe_of("tiny"), "max_eval_bytes": 4096}
    stale = {**done, "key": "tiny-lr1e-3-seed0", "lr": 1e-3, "recipe": "an-older-recipe"}  # trained again
    jsonl.write_text(json.dumps(done) + "\n" + json.dumps(stale) + "\n" + '{"key": "tiny-lr3e')  # killed mid-write
    ran: list[list[str]] = []

    def fake_bench(cmd: list[str], log_path: Path, timeout: float | None) -> str | None:
        ran.append(cmd)
        return "exit 3" if len(ran) == 1 else None  # the first fails; the second exits 0 but wrote no JSON

    monkeypatch.setattr(device_depth, "run_bench", fake_bench)
    failed = device_depth.train_rows("tiny", ["0.002", "3e-3", "1e-3"], [0], "cpu", tmp_path / "data", tmp_path / "runs",
                                     jsonl, 4096, timeout=5)
    assert failed == 2 and len(ran) == 2
    assert [c[c.index("--lr") + 1] for c in ran] == ["3e-3", "1e-3"] and ran[0][ran[0].index("--device") + 1] == "cpu"
    assert ran[0][ran[0].index("--json") + 1] == str(tmp_path / "runs" / "depth-tiny-lr3e-3-seed0.json")
    assert "--resume" in ran[0] and "--fresh" not in ran[0]  # a row cut by its time limit goes on where it was
    assert [r["key"] for r in device_depth.read_rows(jsonl)] == ["tiny-lr2e-3-seed0", "tiny-lr1e-3-seed0"]  # no new row
    for at_bytes in (4096, 8192):  # a row scored on other bytes than asked now is trained again too
        ran.clear()
        device_depth.train_rows("tiny", ["0.002"], [0], "cpu", tmp_path / "data", tmp_path / "runs", jsonl, at_bytes,
                                timeout=5)
        assert len(ran) == (at_bytes != 4096)


def test_the_depth_summary_refuses_rows_of_two_recipes_or_scored_bytes() -> None:
    """A suite resumed in a later session skipped the rows it had, keyed by (preset, lr, seed) alone, and averaged
    rows trained under an older recipe or scored on other bytes with the new ones (helper-69)."""
    from benchmarks.quality import device_depth

    rows = [_depth_row(1e-3, 0, (1.3,) * 3, (1.3,) * 3), _depth_row(1e-3, 1, (1.3,) * 3, (1.3,) * 3)]
    for r in rows:
        r.update(recipe="a", bytes_scored=100)
    device_depth.summarise(rows)
    for field, other in (("recipe", "b"), ("bytes_scored", 50)):
        mixed = [rows[0], {**rows[1], field: other}]
        with pytest.raises(ValueError, match="mix recipes or scored bytes"):
            device_depth.summarise(mixed)
        kept, left_out = device_depth.newest_setting(mixed)  # what the suite's summary stands on meanwhile
        assert kept == [mixed[1]] and left_out == [rows[0]["key"]]
        device_depth.summarise(kept)


def test_a_depth_bench_past_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    """``run_bench`` kills the bench's whole process group at the timeout (a child it started included) and says so;
    a bench killed by a signal is reported as such, and its output is appended to its log."""
    from benchmarks.quality.device_depth import run_bench

    pid_file, log_path = tmp_path / "child.pid", tmp_path / "bench.log"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.perf_counter()
    assert run_bench([sys.executable, "-c", script], log_path, timeout=3) == "cut at 3 s"
    assert time.perf_counter() - t0 < 30 and "started" in log_path.read_text()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the bench's child outlived the timeout"
    assert run_bench([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], log_path,
                     timeout=30) == "killed by signal 15"
    assert run_bench([sys.executable, "-c", "print('ok')"], log_path, timeout=30) is None
    assert log_path.read_text().count("started") == 1 and log_path.read_text().endswith("ok\n")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its adopter, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _depth_row(lr: float, seed: int, test: tuple[float, float, float], val: tuple[float, float, float] | None) -> dict:
    arms = ("stack", "stack_prefix0", "e2e_matched_flops")
    row = {"key": f"p-lr{lr}-seed{seed}", "preset": "p", "lr": lr, "seed": seed, "ce": dict(zip(arms, test, strict=True))}
    if val is not None:
        row["val_ce"] = dict(zip(arms, val, strict=True))
    return row


def test_the_depth_summary_picks_lrs_on_validation_among_complete_lrs(tmp_path: Path) -> None:
    """The summary picked each arm's lr by its test CE, and compared a one-seed lr's lucky seed with another lr's
    three-seed mean; two spellings of one lr counted as two seeds. It picks on validation now, among the lrs that
    have every seed (the others are named as left out); a diverged run (validation CE NaN) loses; a row written again
    (0.002 for 2e-3) replaces the first; one seed has no spread; the gap pairs seeds."""
    from benchmarks.quality import device_depth

    jsonl = tmp_path / "depth.jsonl"
    rows = [
        _depth_row(1e-3, 0, (1.30, 1.40, 1.50), (1.35, 1.45, 1.55)),
        _depth_row(2e-3, 0, (1.25, 1.42, 1.52), (1.33, 1.43, 1.53)),  # best test and validation on seed 0 ...
        _depth_row(2e-3, 1, (1.40, 1.44, 1.54), (1.40, 1.44, 1.54)),  # ... not over both seeds
        _depth_row(1e-3, 1, (9.0, 9.0, 9.0), None),  # (replaced below)
    ]
    for r in rows:
        device_depth.append_row(jsonl, r)
    device_depth.append_row(jsonl, _depth_row(0.001, 1, (1.31, 1.41, 1.51), (1.36, 1.46, 1.56)))  # 1e-3 again
    with jsonl.open("a") as f:
        f.write('{"key": "cut')  # a row killed mid-write; the next one starts on its own line
    device_depth.append_row(jsonl, _depth_row(3e-3, 0, (1.20, 1.20, 1.20), (1.00, 1.00, 1.00)))  # one seed only
    got = device_depth.summarise(device_depth.read_rows(jsonl))["p"]
    assert got["rows"] == 5
    stack, e2e = got["arms"]["stack"], got["arms"]["e2e_matched_flops"]
    # 3e-3 lacks seed 1: left out (on seed 0 alone it would win); of the two complete lrs 1e-3 has the lower
    # validation mean (1.355 against 1.365), though 2e-3 had the best single seed
    assert (stack["best_lr"], stack["picked_on"], stack["seeds_compared"]) == (1e-3, "validation", [0, 1])
    assert stack["excluded_incomplete"] == [3e-3] and not stack["uneven"]
    assert stack["seeds"] == 2 and stack["spread"] == pytest.approx(0.01) and stack["mean"] == pytest.approx(1.305)
    assert e2e["best_lr"] == 2e-3  # the E2E's 2e-3 (1.535) beats its 1e-3 (1.555)
    assert got["gap_seeds"] == [0, 1] and got["gap_stack_minus_e2e"] == pytest.approx(((1.30 - 1.52) + (1.31 - 1.54)) / 2)
    assert got["gap_spread"] == pytest.approx(0.01)
    table = device_depth.table(device_depth.summarise(device_depth.read_rows(jsonl)))
    assert "0.003 left out" in table and "validation, 2 seeds" in table
    # a diverged lr loses, though it comes first: 1e-3's validation CE is NaN (recorded as None)
    diverged = [r for r in device_depth.read_rows(jsonl) if r["lr"] != 3e-3]
    for r in diverged:
        if r["lr"] == 1e-3:
            r["val_ce"] = {"stack": None, "stack_prefix0": None, "e2e_matched_flops": None}  # NaN is recorded as None
    assert device_depth.summarise(diverged)["p"]["arms"]["stack"]["best_lr"] == 2e-3
    one = device_depth.summarise([_depth_row(1e-3, 0, (1.3, 1.4, 1.5), (1.3, 1.4, 1.5))])["p"]
    assert one["arms"]["stack"]["spread"] is None and one["gap_spread"] is None
    uneven = device_depth.summarise([_depth_row(1e-3, 0, (1.3,) * 3, (1.3,) * 3), _depth_row(2e-3, 1, (1.2,) * 3, (1.2,) * 3)])
    assert uneven["p"]["arms"]["stack"]["uneven"] and uneven["p"]["gap_seeds"] in ([0], [1])
    old = [{k: v for k, v in r.items() if k != "val_ce"} for r in device_depth.read_rows(jsonl)]
    assert device_depth.summarise(old)["p"]["arms"]["stack"]["picked_on"] == "test"  # rows from before validation


def test_a_suite_told_to_stop_ends_the_job_it_runs(tmp_path: Path) -> None:
    """Each job runs under ``timeout``, which leads a process group of its own: a Ctrl-C or SIGTERM to the suite ended
    the suite and its packer, and left the running job training on for up to its limit (helper-69). The exit trap
    now signals every running job's timeout, which passes the signal on to its command."""
    import signal

    data = write_corpus(tmp_path / "data").root
    results, pidfile = tmp_path / "device-suite", tmp_path / "job.pid"
    fake = tmp_path / "python"  # the real interpreter, but the first job's command stands still until it is ended
    fake.write_text(f'#!/usr/bin/env bash\ncase "$*" in *device_checks.py*) echo $$ > {pidfile}; exec sleep 300;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "SUITE": "smoke", "DEVICE": "cpu", "RESULTS": str(results), "DATA": str(data),
           "PYTHON": str(fake), "OMP_NUM_THREADS": "1"}
    suite = subprocess.Popen(["bash", str(ROOT / "scripts" / "device_suite.sh")], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (pidfile.is_file() and pidfile.read_text().strip()):
            assert suite.poll() is None and time.monotonic() < deadline, "the first job never started"
            time.sleep(0.1)
        job = int(pidfile.read_text())
        suite.send_signal(signal.SIGTERM)
        assert suite.wait(timeout=60) == 143
        deadline = time.monotonic() + 20
        while _alive(job):
            assert time.monotonic() < deadline, "the job outlived the suite"
            time.sleep(0.1)
        assert not (results / "checks.done").exists()
    finally:
        if suite.poll() is None:
            suite.kill()
