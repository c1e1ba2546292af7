"""The serving benchmark's scale row (benchmarks/serving/serve_scale.py): its shape, its extrapolation, its options and a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.serving import serve_scale
from benchmarks.serving.serve_scale import ScaleOptions, paper_shape, scale_shape

from blocktrain.bench.machine import machine_info
from blocktrain.errors import ConfigError
from blocktrain.model.block import BlockDenoiser
from blocktrain.serve.runtime.loading import parse_shape
from tests.serve_utils import free_ports


def test_scale_shape_fits_budget() -> None:
    cfg = parse_shape(scale_shape(10 * 2**30))
    with torch.device("meta"):
        params = cfg.model.n_blocks * sum(p.numel() for p in BlockDenoiser(cfg.model, 0.5).parameters())
    assert 4 * params <= 10 * 2**30 < 4 * params * 1.5  # the largest multiple of 256 that fits
    assert cfg.model.d_model % cfg.model.n_heads == 0


def test_paper_extrapolation_takes_its_numbers_from_the_options_or_this_machine() -> None:
    shape = paper_shape(ScaleOptions(paper_params=10e9, machine_memory_gib=4.0), positions=100, flops_per_s=1e9)
    assert shape == {"params": 10e9, "weights_bytes_fp16": 20e9, "per_stage_bytes_fp16": 20e9 / 3,
                     "machine_memory_bytes": 4 * 2**30, "machines_like_this_for_fp16_weights": 5,  # 20e9 / 4.29e9 = 4.66
                     "sweep_seconds_at_measured_flops": 2000.0}  # 2 x 10e9 x 100 FLOPs at 1e9 FLOP/s
    here = machine_info()["memory_bytes"]
    shape = paper_shape(ScaleOptions(), positions=100, flops_per_s=1e9)
    assert shape["params"] == 75.8e9 and shape["machine_memory_bytes"] == here
    assert shape["machines_like_this_for_fp16_weights"] == math.ceil(2 * 75.8e9 / here)


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"memory_fraction": 0.0}, "--memory-fraction"),
        ({"machine_memory_gib": -1.0}, "--machine-memory-gib"),
        ({"budget_gib": 0.0}, "--budget-gib"),
        ({"paper_params": 0.0}, "--paper-params"),
        ({"hop_delay_ms": float("nan")}, "--hop-delay-ms"),
        ({"output_bytes": 0}, "--output-bytes"),
        ({"base_port": 65534}, "--base-port"),
    ],
)
def test_scale_options_are_validated(opts: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ScaleOptions(**opts)


def test_bad_flags_say_which_to_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_scale.main(["--memory-fraction", "2"]) == 1
    assert "set --memory-fraction" in capsys.readouterr().err


@pytest.mark.slow
def test_scale_row_end_to_end(tmp_path: Path) -> None:
    """A small random shape over three loopback stages: sweep and the AR baseline timed, the paper extrapolated."""
    out = tmp_path / "scale.json"
    assert serve_scale.main(["--shape", "d_model=64,n_heads=2,n_layers=4,n_blocks=4,context=64", "--output-bytes", "8",
                             "--hop-delay-ms", "5", "--json", str(out),
                             "--base-port", str(free_ports(1)[0] // 10 * 10 % 50000 + 10000)]) == 0
    r = json.loads(out.read_text())
    s = r["scale"]
    assert s["blocktrain_params"] > 0 and s["output_bytes"] == 8 and r["network"]["namespaces"] is False
    assert s["speedup_sweep_vs_baseline"] == pytest.approx(s["ar_baseline_seconds"] / s["sweep_seconds"], rel=1e-9)
    assert s["paper_shape"]["params"] == 75.8e9
    assert "Command: `python -m benchmarks.serving.serve_scale" in out.with_suffix(".md").read_text()
