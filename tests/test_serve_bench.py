"""Serving CLI and benchmark pieces: span splits, quality helpers, end-to-end CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from blocktrain.bench.serve_pipeline import split_blocks, split_layers
from blocktrain.bench.serve_quality import generative_ce, repeat_fraction
from blocktrain.cli.main import main
from blocktrain.evaluate.assembled import E2EModel
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.e2e import E2ETransformer
from blocktrain.presets import tiny
from blocktrain.serve.runtime.loading import parse_span
from tests.forked_cli import spawn
from tests.serve_utils import free_ports, wait_port


def test_span_splits() -> None:
    assert split_layers(8) == [(0, 2), (3, 5), (6, 7)]
    assert split_blocks(4) == [(0, 1), (2, 2), (3, 3)]
    assert split_layers(16) == [(0, 5), (6, 10), (11, 15)]
    assert parse_span("0-1") == (0, 1) and parse_span("3") == (3, 3)
    with pytest.raises(ValueError, match="LO-HI"):
        parse_span("a-b")


def test_quality_helpers() -> None:
    assert repeat_fraction(b"abcdabcd") == pytest.approx(1 / 5)
    assert repeat_fraction(b"abcdefgh") == 0.0
    cfg = tiny()
    model = E2EModel(E2ETransformer(cfg.model), cfg)
    prompt, out = b"hello ", b"world"
    seq = prompt + out
    with torch.no_grad():
        logp = torch.log_softmax(model.model(torch.tensor([list(seq[:-1])])), -1)[0]
    manual = -sum(float(logp[len(prompt) - 1 + i, out[i]]) for i in range(len(out))) / len(out)
    assert generative_ce(model, prompt, out) == pytest.approx(manual, rel=1e-5)
    # an output of several windows is scored in eval's windows: with a one-byte prompt, every scored byte is output
    long = bytes(range(65, 65 + 26)) * 4  # 104 bytes against a context of 32
    windowed = score_split(lambda x: model.log_probs(x), np.frombuffer(b"h" + long, dtype=np.uint8), cfg.model.context)
    assert generative_ce(model, b"h", long) == pytest.approx(windowed.ce_nats_per_byte, rel=1e-5)


def test_cli_serve_and_generate_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`blocktrain serve` (random tiny weights, one stage) answers `blocktrain generate --pipeline`."""
    (port,) = free_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shape = "d_model=32,n_heads=2,n_layers=4,n_blocks=4,context=32,mlp_ratio=2"
    serve = spawn(["serve", "--random", shape, "--blocks", "0-3", "--listen", f"127.0.0.1:{port}"],
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)  # a forked process (tests/forked_cli.py)
    try:
        wait_port(port, serve)
        for mode in ("sweep", "ar"):  # the client runs in this process; the stage is the process under test
            assert main(["generate", "--pipeline", f"127.0.0.1:{port}", "--mode", mode, "--bytes", "8", "--prompt", "abc",
                         "--sweeps", "2"]) == 0
            assert capsys.readouterr().out.startswith("abc")
        assert main(["generate", "--pipeline", "127.0.0.1:1", "--bytes", "4"]) == 2
        assert "cannot reach the entry stage" in capsys.readouterr().err
    finally:
        serve.terminate()
        serve.wait(10)


@pytest.mark.slow
def test_bench_serve_end_to_end(tmp_path: Path, data_dir: Path) -> None:
    """The whole benchmark on loopback with a tiny trained run (about 30 s)."""
    from blocktrain.cli.main import main

    run = tmp_path / "run"
    common = ["--preset", "tiny", "--out", str(run), "--data", str(data_dir), "--steps", "5", "--no-progress"]
    assert main(["train", *common]) == 0
    assert main(["train-e2e", *common]) == 0
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--run", str(run), "--data", str(data_dir),
            "--prompt-bytes", "12", "--output-bytes", "16", "--prompts", "2", "--tf-bytes", "256", "--long-output-bytes", "52",
            "--sweeps", "2",  # no k = 1: the summary's headline sweep was sweep_k1 by name (a KeyError after the run)
            "--json", str(out), "--base-port", str(free_ports(1)[0] // 10 * 10 % 50000 + 10000)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert (r["output_bytes"], r["hops_per_traversal"], r["prompt_bytes"]) == (16, 3, 12)
    assert r["hop_delay_ms"] >= 0 and r["sweep_k"] == 2 and list(r["sweeps"]) == ["sweep_k2"]
    for key in ("sweep_seconds", "ar_seconds", "ar_baseline_seconds", "floor_seconds"):
        assert 0 < r[key] < 600, (key, r[key])  # a tiny run on loopback: well under ten minutes
    assert r["speedup_sweep_vs_baseline"] == pytest.approx(r["ar_baseline_seconds"] / r["sweep_seconds"], rel=1e-9)
    assert r["sweep_bytes_per_s"] == pytest.approx(16 / r["sweep_seconds"], rel=1e-9)
    for key in ("sweep_generative_ce", "ar_generative_ce", "baseline_generative_ce", "reference_continuation_ce"):
        assert 0 < r[key] < 3 * math.log(256), (key, r[key])  # nats/byte under a 5-step E2E judge
    for key in ("sweep_wire_bytes", "ar_wire_bytes", "ar_baseline_wire_bytes"):
        assert r[key] > 0, key
    tf = r["teacher_forced_ce"]
    assert tf["blocktrain_pipeline_score"] == pytest.approx(tf["blocktrain_local"], abs=1e-4)
    assert r["sweep_seconds"] >= 3 * r["hop_delay_ms"] / 1000
    assert "scale" not in r  # the scale row is benchmarks/serving/serve_scale.py (tests/test_serve_scale.py)
    assert r["long_output_bytes"] == 52 and 0 < r["baseline_long_seconds"] < 600  # 12 + 52 bytes: two windows of 32
    assert 0 < r["baseline_long_generative_ce"] < 3 * math.log(256) and r["baseline_long_wire_bytes"] > 0
    ces = r["baseline_long_generative_ce_per_prompt"]  # two prompts: their mean, and its standard error
    assert len(ces) == 2 and r["baseline_long_generative_ce"] == pytest.approx(sum(ces) / 2, rel=1e-12)
    assert r["baseline_long_generative_ce_sem"] == pytest.approx(abs(ces[0] - ces[1]) / 2, rel=1e-9)
    assert "| AR baseline (E2E, KV cache; re-prefills" in out.with_suffix(".md").read_text()


def test_the_serving_bench_reads_the_data_its_run_trained_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --data: the directory run.json records, its fingerprint checked; a run whose data changed is refused."""
    from dataclasses import replace

    from blocktrain.bench.serve_options import ServeBenchOptions
    from blocktrain.bench.serve_quality import bench_data
    from blocktrain.checkpoint.run import RunDir
    from blocktrain.data.dataset import open_data_dir
    from blocktrain.errors import DataError
    from tests.conftest import write_data_dir

    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    data = write_data_dir(tmp_path / "data")
    RunDir(tmp_path / "run").init(replace(tiny(), dataset=open_data_dir(data).fingerprint()), data)
    opts = ServeBenchOptions(run=tmp_path / "run")
    assert bench_data(opts).root == data.resolve()
    for split in data.iterdir():
        if split.is_file():
            split.write_bytes(split.read_bytes() + b" changed")
    with pytest.raises(DataError, match="--data"):
        bench_data(opts)


def test_every_mode_is_warmed_up_before_its_first_timed_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first task's mode was warmed up: the other modes' first timed rows paid for their own first use (the
    ar and stack_ar rows, timed once each, entirely), so their times were not comparable to the warmed ones
    (helper-69). Each mode is warmed once now, before its first timed output."""
    import asyncio
    from typing import Any

    from blocktrain.bench import serve_client

    calls: list[tuple[str, str]] = []

    class Client:
        counters = type("Counters", (), {"bytes_out": 0})()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def connect(self) -> None:
            pass

        async def close(self) -> None:
            pass

        async def __aenter__(self) -> Client:
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

    async def generate_with(c: Any, mode: str, prompt: bytes, n: int, **kw: Any) -> bytes:
        calls.append(("warm" if kw.get("seed") == 999 else "other", mode))
        return b"x" * n

    async def timed_output(c: Any, task: dict[str, Any], prompt: bytes, n: int, seed: int, **kw: Any) -> tuple[bytes, None]:
        calls.append(("timed", task["mode"]))
        return b"x" * n, None

    async def nothing(*args: Any) -> Any:
        return (0, 0)

    monkeypatch.setattr(serve_client, "PipelineClient", Client)
    monkeypatch.setattr(serve_client, "generate_with", generate_with)
    monkeypatch.setattr(serve_client, "timed_output", timed_output)
    monkeypatch.setattr(serve_client, "wait_ready", nothing)
    monkeypatch.setattr(serve_client, "_stats", nothing)
    tasks = [{"name": "sweep_k1", "mode": "sweep", "repeat": 2, "quality": False},
             {"name": "ar", "mode": "ar", "quality": False},
             {"name": "spec", "mode": "spec", "draft_min": 1, "draft_max": 8, "quality": False}]
    plan = {"entry": ["127.0.0.1", 1], "stages": [["127.0.0.1", 1]], "prompts": [[104, 105]], "output_bytes": 8,
            "temperature": 1.0, "top_k": 0, "seed": 0, "tasks": tasks}
    asyncio.run(serve_client.run_plan(plan))
    timed = [c for c in calls if c[0] != "other"]
    assert timed == [("warm", "sweep"), ("timed", "sweep"), ("timed", "sweep"), ("warm", "ar"), ("timed", "ar"),
                     ("warm", "spec"), ("timed", "spec")]
