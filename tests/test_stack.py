"""The stack objective: causality, composition, frozen copies, the progressive and concurrent schedules."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocktrain.checkpoint.blocks import load_block
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import Objective, Precision, RunConfig, Schedule
from blocktrain.data.dataset import open_data_dir
from blocktrain.device import autocast, resolve_precision
from blocktrain.errors import CheckpointError, RunError
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.evaluate.report import evaluate_model
from blocktrain.model.stack import StackBlock, StoredLinear, frozen_copy
from blocktrain.objectives import compose_logits, get_objective
from blocktrain.objectives.stack import StackObjective
from blocktrain.presets import get_preset, tiny
from blocktrain.train import schedule
from blocktrain.train.block import train_block
from blocktrain.train.schedule import train_concurrent

CPU = torch.device("cpu")


def stack_cfg(**train: object) -> RunConfig:
    cfg = replace(tiny(), objective=Objective.STACK)
    return cfg.with_train(**train) if train else cfg


def random_blocks(cfg: RunConfig, seed: int = 0) -> list[StackBlock]:
    torch.manual_seed(seed)
    obj = get_objective(cfg)
    blocks = [obj.build_block(k) for k in range(cfg.model.n_blocks)]
    for b in blocks:  # perturb away from init so every layer matters
        for p in b.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
    return blocks  # type: ignore[return-value]


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_no_position_sees_its_own_or_a_later_byte(precision: Precision) -> None:
    """Changing bytes after position t must not move any prefix's log-probs at positions <= t."""
    cfg = stack_cfg()
    model = AssembledModel(random_blocks(cfg), cfg, precision)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, cfg.model.context), generator=g, dtype=torch.uint8)
    t = 11
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randint(0, 256, x2[:, t + 1 :].shape, generator=g, dtype=torch.uint8)
    a, b = model.reference_log_probs(x), model.reference_log_probs(x2)  # (B, b, t, 256)
    assert torch.equal(a[:, :, : t + 1], b[:, :, : t + 1])
    assert not torch.allclose(a[:, :, t + 1 :], b[:, :, t + 1 :])  # the change is visible where it is allowed


def test_composed_model_is_the_last_prefix_and_blocks_chain_through_h() -> None:
    cfg = stack_cfg()
    blocks = random_blocks(cfg)
    obj = get_objective(cfg)
    x = torch.randint(0, 256, (3, 20), dtype=torch.uint8)
    composed = compose_logits(obj, blocks, x, torch.Generator())
    with torch.no_grad():
        h = blocks[0](x)
        manual = [blocks[0].logits(h)]
        for blk in blocks[1:]:
            h = blk(h)
            manual.append(blk.logits(h))
    refs = obj.reference_logits(blocks, x, torch.Generator())
    assert torch.equal(composed, manual[-1])
    for r, m in zip(refs, manual, strict=True):
        assert torch.equal(r, m)


def test_bf16_frozen_copy_computes_what_the_block_computes_under_autocast() -> None:
    cfg = stack_cfg()
    blocks = random_blocks(cfg)
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    with torch.no_grad(), autocast(Precision.BF16, CPU):
        h_full = blocks[1](blocks[0](x))
        frozen = [frozen_copy(b, torch.bfloat16) for b in blocks[:2]]
        h_frozen = frozen[1](frozen[0](x))
    assert h_frozen.dtype == torch.float32  # the residual stream stays fp32
    assert torch.equal(h_full, h_frozen)
    lin = [m for m in frozen[0].modules() if isinstance(m, (torch.nn.Linear, StoredLinear))]
    assert lin and all(m.weight.dtype == torch.bfloat16 for m in lin)
    assert not any(p.requires_grad for p in frozen[0].parameters())
    assert not list(frozen[0].head_layers) and isinstance(frozen[0].head, torch.nn.Identity)


def test_block_k_gets_no_gradient_into_earlier_blocks(tmp_path: Path) -> None:
    cfg = stack_cfg()
    blocks = random_blocks(cfg)
    obj = get_objective(cfg)
    frozen = [obj.freeze(b, torch.float32) for b in blocks[:2]]
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    y = torch.randint(0, 256, (2, 16))
    out = obj.block_loss(blocks[2], 2, x, y, torch.Generator(), frozen)
    out.loss.backward()
    assert all(p.grad is None for f in frozen for p in f.parameters())
    assert all(p.grad is not None for p in blocks[2].parameters())
    with pytest.raises(ValueError, match=r"frozen copies of blocks 0\.\.1"):
        obj.block_loss(blocks[2], 2, x, y, torch.Generator(), frozen[:1])


def test_progressive_schedule_refuses_a_block_before_its_predecessors(tmp_path: Path, data_dir: Path) -> None:
    cfg = stack_cfg(steps=6, eval_bytes=0)
    dd = open_data_dir(data_dir)
    with pytest.raises(RunError, match=r"no checkpoint for block 0.*train-block"):
        train_block(cfg, dd, tmp_path / "run", 1, progress=False)
    train_block(cfg.with_train(steps=3), dd, tmp_path / "run", 0, progress=False)  # block 0 stops short of 6 steps
    with pytest.raises(RunError, match=r"block 0 .* is at step 3 of 6"):
        train_block(cfg, dd, tmp_path / "run", 1, progress=False)


def test_stack_trains_composes_and_reports_every_prefix(tmp_path: Path, data_dir: Path) -> None:
    cfg = stack_cfg(steps=40, lr=1e-2, warmup_steps=4, eval_bytes=1024)
    dd = open_data_dir(data_dir)
    run = tmp_path / "run"
    for k in range(cfg.model.n_blocks):
        s = train_block(cfg, dd, run, k, progress=False)
        assert s.precision == resolve_precision(Precision.BF16, CPU).value and "val_prefix_ce" in s.eval
        assert s.flops_per_step > 0 and s.seconds_per_step > 0
    model = AssembledModel.load(RunDir(run))
    r = evaluate_model(model, dd.open("test"), blocks_alone=True)
    assert len(r["prefix_ce"]) == cfg.model.n_blocks
    assert r["ce_nats_per_byte"] == pytest.approx(r["prefix_ce"][-1])
    assert r["compositional_gain_nats_per_byte"] == pytest.approx(r["prefix_ce"][0] - r["ce_nats_per_byte"])
    assert r["ce_nats_per_byte"] < 4.0  # well below uniform (5.545): the stack learned
    # the checkpoints say which objective wrote them
    assert isinstance(load_block(RunDir(run), RunDir(run).load_config(), 3), StackBlock)


def test_concurrent_schedule_resumes_exactly(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = stack_cfg(steps=8, eval_bytes=0, round_steps=2, refresh_rounds=2, schedule=Schedule.CONCURRENT)
    dd = open_data_dir(data_dir)
    full = train_concurrent(cfg, dd, tmp_path / "full", progress=False)
    real = schedule._checkpoint

    def killed_after_first_checkpoint(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(schedule, "_checkpoint", killed_after_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train_concurrent(cfg, dd, tmp_path / "half", progress=False)
    monkeypatch.setattr(schedule, "_checkpoint", real)
    assert load_block(RunDir(tmp_path / "half"), cfg, 0) is not None  # killed at step 4 of 8
    resumed = train_concurrent(cfg, dd, tmp_path / "half", progress=False)
    assert resumed == full
    for k in range(cfg.model.n_blocks):
        a = load_block(RunDir(tmp_path / "full"), cfg, k).state_dict()
        b = load_block(RunDir(tmp_path / "half"), cfg, k).state_dict()
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("killed", ["staging", "committing"])
def test_a_kill_inside_a_concurrent_checkpoint_resumes_exactly(tmp_path: Path, data_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch, killed: str) -> None:
    """The blocks were saved one after another: a kill between two left them at different steps, and the run could
    only be thrown away. Every block is now staged, the step recorded, then each put in place: a kill while staging
    resumes from the last checkpoint, one while committing puts the rest in place."""
    from blocktrain.train.checkpointing import Checkpointer

    cfg = stack_cfg(steps=12, eval_bytes=0, round_steps=2, refresh_rounds=2, schedule=Schedule.CONCURRENT)
    dd = open_data_dir(data_dir)
    train_concurrent(cfg, dd, tmp_path / "full", progress=False)
    calls = {"n": 0}
    real = getattr(Checkpointer, "stage" if killed == "staging" else "commit")

    def dying(self: Checkpointer, *args: object) -> None:
        calls["n"] += 1
        if calls["n"] == cfg.model.n_blocks + 2:  # the third block of the second checkpoint (step 8)
            raise SystemExit("killed")
        real(self, *args)

    monkeypatch.setattr(Checkpointer, "stage" if killed == "staging" else "commit", dying)
    with pytest.raises(SystemExit):
        train_concurrent(cfg, dd, tmp_path / "half", progress=False)
    monkeypatch.undo()
    train_concurrent(cfg, dd, tmp_path / "half", progress=False)
    for k in range(cfg.model.n_blocks):
        a = load_block(RunDir(tmp_path / "full"), cfg, k).state_dict()
        b = load_block(RunDir(tmp_path / "half"), cfg, k).state_dict()
        assert all(torch.equal(a[n], b[n]) for n in a), k
    assert not list((tmp_path / "half" / "blocks").glob("*.next"))


def test_concurrent_refuses_blocks_at_different_steps(tmp_path: Path, data_dir: Path) -> None:
    cfg = stack_cfg(steps=4, eval_bytes=0)
    dd = open_data_dir(data_dir)
    train_block(cfg, dd, tmp_path / "run", 0, progress=False)  # block 0 alone, progressive
    with pytest.raises(RunError):
        train_block(cfg.with_train(steps=8), dd, tmp_path / "run", 1, progress=False)  # block 0 at 4 of 8
    with pytest.raises(CheckpointError, match="checkpoints them together"):
        train_concurrent(replace(cfg, train=replace(cfg.train, schedule=Schedule.CONCURRENT)), dd, tmp_path / "run", progress=False)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 0.05), (torch.int8, 0.05)])
def test_a_frozen_copy_stored_in_bf16_or_int8_computes_in_fp32_close_to_the_block(dtype: torch.dtype,
                                                                                 atol: float) -> None:
    cfg = replace(get_preset("tiny"), objective=Objective.STACK)
    objective = get_objective(cfg)
    assert isinstance(objective, StackObjective)
    torch.manual_seed(0)
    block = objective.build_block(0)
    x = torch.randint(0, 256, (2, cfg.model.context))
    exact = objective.freeze(block, torch.float32)
    stored = frozen_copy(block, dtype)
    assert any(isinstance(m, StoredLinear) for m in stored.modules())
    assert all(m.weight.dtype == dtype for m in stored.modules() if isinstance(m, StoredLinear))
    with torch.no_grad():
        want = objective.residual_input(1, x, [exact])  # (b, t, d)
        got = objective.residual_input(1, x, [stored])
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert 0 < err < atol * want.abs().max().item(), err  # close, and not the same object computed twice
