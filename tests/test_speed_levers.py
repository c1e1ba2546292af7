"""The speed levers of issue 42: torch.compile of a step's modules, the profiler hook, TF32 on CUDA, and the
diffusion noise drawn where the step computes."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocktrain import device as device_mod
from blocktrain.config import CompileMode, Objective, Precision
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.simulate import BlockRun, LocalRounds
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import ConfigError
from blocktrain.objectives import get_objective
from blocktrain.presets import tiny
from blocktrain.train.block import train_block
from blocktrain.train.e2e import train_e2e
from blocktrain.train.metrics import read_jsonl


def _losses(run: Path, name: str) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics" / f"{name}.jsonl") if "loss" in r and "event" not in r]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.timeout(300)
def test_a_compiled_stack_block_trains_as_the_eager_one(tmp_path: Path, data_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Block 1 of a stack run, compiled with its frozen block 0, follows the eager run's losses (inductor fuses and
    reorders fp32 arithmetic: 1e-3 relative over 6 steps) and saves the same state-dict keys."""
    compiled_modes: list[tuple[str, object]] = []
    real_compile = torch.nn.Module.compile

    def spy(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        compiled_modes.append((type(self).__name__, kwargs.get("mode")))
        real_compile(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    cfg = tiny().with_train(steps=6, eval_bytes=0, log_every=1, precision=Precision.FP32)
    cfg = replace(cfg, objective=Objective.STACK)
    dd = open_data_dir(data_dir)
    train_block(cfg, dd, tmp_path / "eager", 0, progress=False)
    shutil.copytree(tmp_path / "eager", tmp_path / "compiled")
    train_block(cfg, dd, tmp_path / "eager", 1, progress=False)
    train_block(cfg.with_train(compile=CompileMode.DEFAULT), dd, tmp_path / "compiled", 1, progress=False)
    assert [m for _, m in compiled_modes] == ["default", "default"]  # the frozen block 0 and block 1: once each
    eager, compiled = _losses(tmp_path / "eager", "block_1"), _losses(tmp_path / "compiled", "block_1")
    assert len(eager) == len(compiled) == 6
    assert compiled == pytest.approx(eager, rel=1e-3)
    from safetensors import safe_open

    keys = []
    for run in ("eager", "compiled"):
        with safe_open(str(tmp_path / run / "blocks" / "block_1.safetensors"), "pt") as f:
            keys.append(sorted(f.keys()))
    assert keys[0] == keys[1] and not any("_orig_mod" in k for k in keys[1])


def test_the_profile_hook_reports_the_last_steps_top_operators(tmp_path: Path, data_dir: Path) -> None:
    cfg = tiny().with_train(steps=6, eval_bytes=0, profile_steps=2, precision=Precision.FP32)
    train_e2e(cfg, open_data_dir(data_dir), tmp_path / "run", progress=False)
    report = json.loads((tmp_path / "run" / "metrics" / "e2e.profile.json").read_text())
    assert report["steps"] == 2 and report["device"] == "cpu" and report["step_seconds"] > 0
    names = [op["name"] for op in report["ops"]]
    assert any("mm" in n for n in names), names  # the matmuls are there
    assert all(op["calls"] >= 1 and 0 <= op["share"] <= 1 for op in report["ops"])
    assert sum(op["share"] for op in report["ops"]) <= 1 + 1e-9
    assert "| operator |" in (tmp_path / "run" / "metrics" / "e2e.profile.md").read_text()


def test_profile_steps_and_compile_are_validated() -> None:
    with pytest.raises(ConfigError, match="profile_steps"):
        tiny().with_train(profile_steps=-1)
    with pytest.raises(ConfigError, match="compile"):  # a string where the enum belongs is refused, not ignored
        tiny().with_train(compile="default")
    assert tiny().with_train(compile=CompileMode.DEFAULT).train.compile is CompileMode.DEFAULT


def test_a_cuda_device_turns_tf32_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolving a CUDA device lets fp32 matmuls use TF32 (checked with CUDA pretended: the flag is global)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.backends.cuda.matmul.allow_tf32
    device_mod._allow_tf32.cache_clear()
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert device_mod.resolve_device("cuda").type == "cuda"
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
        device_mod._allow_tf32.cache_clear()


def test_the_diffusion_loss_draws_its_noise_on_the_block_s_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """No host draw of eps (b, t, d): the counter generator is asked for it on x's device."""
    from blocktrain.diffusion import loss as loss_mod
    from blocktrain.objectives import get_objective

    cfg = tiny()
    obj = get_objective(cfg)
    block = obj.build_block(0)
    asked: list[torch.device] = []
    real = loss_mod.normal

    def spy(shape: tuple[int, ...], generator: torch.Generator, device: torch.device = device_mod.CPU) -> torch.Tensor:
        asked.append(device)
        return real(shape, generator, device)

    monkeypatch.setattr(loss_mod, "normal", spy)
    x = torch.randint(0, 256, (2, 8), dtype=torch.uint8)
    obj.block_loss(block, 0, x, x, torch.Generator().manual_seed(0))
    assert asked == [x.device]

    def host_draw(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("eps drawn by torch.randn")

    monkeypatch.setattr(torch, "randn", host_draw)
    assert torch.isfinite(obj.block_loss(block, 0, x, x, torch.Generator().manual_seed(0)).loss)


def _block_run(compile_mode: CompileMode, data_dir: Path) -> tuple[BlockRun, torch.nn.Module]:
    """In-process rounds of block 1 of a tiny stack (2 replicas, H = 2), on a frozen block 0 of its own."""
    cfg = replace(tiny(), objective=Objective.STACK).with_train(precision=Precision.FP32, compile=compile_mode)
    objective = get_objective(cfg)
    torch.manual_seed(0)
    first = objective.build_block(0)
    frozen = objective.freeze(first, torch.float32)
    run = BlockRun(cfg, CoordinatorSettings(), LocalRounds(workers=2, local_steps=2, steps=4), open_data_dir(data_dir),
                   k=1, frozen=[frozen], earlier=[first])
    return run, frozen


def test_the_in_process_rounds_compile_their_replicas_and_copies_of_the_frozen_blocks(data_dir: Path) -> None:
    """train.compile reaches the in-process rounds as it reaches a worker: every replica's block and the frozen block
    it reads are compiled, the frozen one as a copy (the caller's module stays eager); OFF compiles nothing."""
    run, frozen = _block_run(CompileMode.DEFAULT, data_dir)
    assert all(r._compiled_call_impl is not None for r in run.replicas)
    assert all(f is not frozen and f._compiled_call_impl is not None for f in run.task.frozen)
    assert frozen._compiled_call_impl is None
    eager, _ = _block_run(CompileMode.OFF, data_dir)
    assert all(r._compiled_call_impl is None for r in eager.replicas)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.timeout(600)
def test_compiled_in_process_rounds_publish_what_the_eager_ones_do(data_dir: Path) -> None:
    """Two rounds of two compiled replicas publish the eager run's weights to 1e-3 of the weights' change (inductor
    reorders fp32 arithmetic)."""
    runs = []
    for mode in (CompileMode.OFF, CompileMode.DEFAULT):
        run, _ = _block_run(mode, data_dir)
        start = {n: w.clone() for n, w in run.W.items()}
        for offset, h in zip(run.offsets, run.opts.round_steps, strict=True):
            run.round(h, offset)
        runs.append((start, run.finish().weights))
    (start, eager), (_, compiled) = runs
    change = sum(float((eager[n] - start[n]).norm() ** 2) for n in eager) ** 0.5
    diff = sum(float((compiled[n] - eager[n]).norm() ** 2) for n in eager) ** 0.5
    assert change > 0 and diff <= 1e-3 * change, (diff, change)
