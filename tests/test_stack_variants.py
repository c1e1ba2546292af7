"""The stack's depth variants (issue 18): causality of every prefix, frozen state, warm starts, budgets, round trips."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from blocktrain.checkpoint.blocks import load_block
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import Objective, Precision, RunConfig, Schedule, StackConfig, StackDense, StackHead, StackInit
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import BlockTrainError, ConfigError
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.model.stack import StackBlock
from blocktrain.objectives import get_objective
from blocktrain.objectives.stack import StackObjective
from blocktrain.presets import tiny
from blocktrain.train.block import train_block
from blocktrain.train.metrics import read_jsonl
from blocktrain.train.schedule import train_concurrent

VARIANTS = {
    "head-shared": StackConfig(head=StackHead.SHARED),
    "head-residual": StackConfig(head=StackHead.RESIDUAL),
    "aux-1": StackConfig(aux_layers=1),
    "init-copy": StackConfig(init=StackInit.COPY),
    "init-identity": StackConfig(init=StackInit.IDENTITY),
    "identity+residual": StackConfig(init=StackInit.IDENTITY, head=StackHead.RESIDUAL),
    "steps-front": StackConfig(step_ratio=0.7),
    "copy+front": StackConfig(init=StackInit.COPY, step_ratio=0.7),  # the stack presets' recipe
    "dense-embed": StackConfig(dense=StackDense.EMBED),
    "dense-all": StackConfig(dense=StackDense.ALL),
}


def variant_cfg(stack: StackConfig, **train: object) -> RunConfig:
    cfg = replace(tiny(), objective=Objective.STACK, stack=stack)
    return cfg.with_train(**train) if train else cfg


def _head_weight(block: StackBlock) -> torch.Tensor:
    """A stack block's head weight (its head, typed as a module, is an ``nn.Linear``)."""
    assert isinstance(block.head, nn.Linear)
    return block.head.weight


def inherited_blocks(cfg: RunConfig, seed: int = 0) -> list[StackBlock]:
    """Blocks built as a progressive run builds them: each inherits from the (perturbed) finished blocks before it."""
    torch.manual_seed(seed)
    obj = get_objective(cfg)
    assert isinstance(obj, StackObjective)
    blocks: list[StackBlock] = []
    for k in range(cfg.model.n_blocks):
        b = obj.build_block(k)
        obj.inherit(b, k, blocks, at_init=True)
        for p in b.parameters():  # "training": move every trainable weight so that every layer matters
            if p.requires_grad:
                p.data.add_(0.05 * torch.randn_like(p))
        blocks.append(b)
    return blocks


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_prefix_of_every_variant_is_causal(name: str) -> None:
    """Changing bytes after position t moves no prefix's log-probs at positions <= t, at every t."""
    cfg = variant_cfg(VARIANTS[name])
    model = AssembledModel(inherited_blocks(cfg), cfg, Precision.FP32)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, cfg.model.context), generator=g, dtype=torch.uint8)
    base = model.reference_log_probs(x)  # (B, b, t, 256)
    for t in range(cfg.model.context - 1):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randint(0, 256, x2[:, t + 1 :].shape, generator=g, dtype=torch.uint8)
        moved = model.reference_log_probs(x2)
        assert torch.equal(base[:, :, : t + 1], moved[:, :, : t + 1]), f"{name}: a prefix saw a byte after {t}"
        assert not torch.allclose(base[:, :, t + 1 :], moved[:, :, t + 1 :])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_frozen_blocks_and_frozen_heads_get_no_gradient(name: str) -> None:
    cfg = variant_cfg(VARIANTS[name])
    blocks = inherited_blocks(cfg)
    obj = get_objective(cfg)
    k = 2
    frozen = [obj.freeze(b, torch.float32) for b in blocks[:k]]
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    y = torch.randint(0, 256, (2, 16))
    obj.block_loss(blocks[k], k, x, y, torch.Generator(), frozen).loss.backward()
    assert all(p.grad is None for f in frozen for p in f.parameters())
    trainable = [p for p in blocks[k].parameters() if p.requires_grad]
    fixed = [p for p in blocks[k].parameters() if not p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    assert all(p.grad is None for p in fixed)
    if VARIANTS[name].head is not StackHead.PRIVATE:  # the shared / residual head of an earlier block is frozen
        assert fixed
    else:
        assert not fixed


def test_identity_init_starts_prefix_k_at_prefix_k_minus_1() -> None:
    cfg = variant_cfg(StackConfig(init=StackInit.IDENTITY))
    obj = get_objective(cfg)
    assert isinstance(obj, StackObjective)
    torch.manual_seed(0)
    b0 = obj.build_block(0)
    for p in b0.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    b1 = obj.build_block(1)
    obj.inherit(b1, 1, [b0], at_init=True)
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    with torch.no_grad():
        h1 = b0(x)
        assert torch.equal(b1(h1), h1)  # zeroed branches pass the stream through
        assert torch.equal(b1.logits(b1(h1)), b0.logits(h1))
    assert all(p.requires_grad for p in b1.parameters())  # a private head: trained from there


def test_copy_init_copies_layers_and_head() -> None:
    cfg = variant_cfg(StackConfig(init=StackInit.COPY))
    blocks = inherited_blocks(cfg)
    obj = get_objective(cfg)
    fresh = obj.build_block(2)
    obj.inherit(fresh, 2, blocks[:2], at_init=True)
    a, b = fresh.state_dict(), blocks[1].state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a if n.startswith(("layers.", "ln_f.", "head.")))


def test_residual_head_adds_to_the_frozen_head_of_block_k_minus_1() -> None:
    cfg = variant_cfg(StackConfig(head=StackHead.RESIDUAL))
    blocks = inherited_blocks(cfg)
    obj = get_objective(cfg)
    assert isinstance(obj, StackObjective)
    b2 = obj.build_block(2)
    obj.inherit(b2, 2, blocks[:2], at_init=True)
    h = torch.randn(2, 8, cfg.model.d_model)
    with torch.no_grad():
        assert torch.allclose(b2.logits(h), blocks[1].logits(h), atol=1e-6)  # its own head starts at zero


def test_shared_head_is_block_0s_head() -> None:
    cfg = variant_cfg(StackConfig(head=StackHead.SHARED))
    blocks = inherited_blocks(cfg)
    for b in blocks[1:]:
        assert torch.equal(_head_weight(b), _head_weight(blocks[0])) and not _head_weight(b).requires_grad


def test_aux_layers_leave_the_last_block_plain() -> None:
    cfg = variant_cfg(StackConfig(aux_layers=2))
    obj = get_objective(cfg)
    assert isinstance(obj, StackObjective)
    assert [len(obj.build_block(k).head_layers) for k in range(4)] == [2, 2, 2, 0]


@pytest.mark.parametrize("ratio", [0.5, 0.7, 1.4])
def test_step_ratio_keeps_the_stacks_flops(ratio: float) -> None:
    cfg = variant_cfg(StackConfig(step_ratio=ratio), steps=1000)
    obj = get_objective(cfg)
    F = [obj.train_flops_per_token(k) for k in range(4)]
    steps = [obj.block_steps(k) for k in range(4)]
    assert sum(s * f for s, f in zip(steps, F, strict=True)) == pytest.approx(1000 * sum(F), rel=2e-3)
    assert all((b < a) if ratio < 1 else (b > a) for a, b in itertools.pairwise(steps))


def test_lr_later_sets_the_later_blocks_peak_lr_and_not_the_architecture(tmp_path: Path, data_dir: Path) -> None:
    """stack.lr_later: block 0 at train.lr, blocks 1.. at lr_later x train.lr, as train_block's schedule applies it (the
    lr its metrics log); a recipe, not an architecture: the key (which blocks compose) is unchanged."""
    cfg = variant_cfg(StackConfig(init=StackInit.COPY, lr_later=0.5), steps=4, warmup_steps=1, eval_bytes=0, log_every=1,
                      precision=Precision.FP32)
    obj = get_objective(cfg)
    assert [obj.block_lr(k) for k in range(4)] == [cfg.train.lr] + [0.5 * cfg.train.lr] * 3
    assert get_objective(replace(cfg, objective=Objective.DIFFUSION)).block_lr(2) == cfg.train.lr
    assert cfg.architecture_key() == variant_cfg(StackConfig(init=StackInit.COPY)).architecture_key()
    dd = open_data_dir(data_dir)
    for k in (0, 1):
        train_block(cfg, dd, tmp_path / "run", k, progress=False)
    peaks = [max(r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics" / f"block_{k}.jsonl") if "lr" in r)
             for k in (0, 1)]
    assert peaks == pytest.approx([cfg.train.lr, 0.5 * cfg.train.lr], rel=1e-12)
    train_concurrent(cfg.with_train(schedule=Schedule.CONCURRENT, round_steps=2), dd, tmp_path / "concurrent",
                     progress=False)  # every block at once, each at its own peak lr
    peaks = [max(r["lr"] for r in read_jsonl(tmp_path / "concurrent" / "metrics" / f"block_{k}.jsonl") if "lr" in r)
             for k in range(4)]
    assert peaks == pytest.approx([cfg.train.lr] + [0.5 * cfg.train.lr] * 3, rel=1e-12)
    with pytest.raises(ConfigError, match="lr_later"):
        StackConfig(lr_later=0.0)
    with pytest.raises(ConfigError, match="lr_later"):
        StackConfig(lr_later=float("inf"))


def test_bad_combinations_are_refused_with_a_fix() -> None:
    with pytest.raises(ConfigError, match="--aux-layers 0 or --head private"):
        StackConfig(aux_layers=1, head=StackHead.SHARED)
    with pytest.raises(ConfigError, match="step_ratio"):
        StackConfig(step_ratio=0.0)
    with pytest.raises(ConfigError, match="step_ratio"):
        StackConfig(step_ratio=float("nan"))


def test_dense_inputs_start_as_the_plain_stack_and_learn_their_mix() -> None:
    """alpha starts one-hot on h_k: the same weights give the plain stack's logits; the mix then takes gradient."""
    for dense in (StackDense.EMBED, StackDense.ALL):
        cfg = variant_cfg(StackConfig(dense=dense))
        plain_cfg = variant_cfg(StackConfig())
        obj, plain = get_objective(cfg), get_objective(plain_cfg)
        torch.manual_seed(0)
        blocks = [obj.build_block(k) for k in range(4)]
        same = [plain.build_block(k) for k in range(4)]
        for a, b in zip(same, blocks, strict=True):
            a.load_state_dict({n: t for n, t in b.state_dict().items() if n != "mix"})
        x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
        for r, q in zip(obj.reference_logits(blocks, x, torch.Generator()),
                        plain.reference_logits(same, x, torch.Generator()), strict=True):
            torch.testing.assert_close(r, q, rtol=0, atol=1e-6)
        frozen = [obj.freeze(b, torch.float32) for b in blocks[:3]]
        obj.block_loss(blocks[3], 3, x, torch.randint(0, 256, (2, 16)), torch.Generator(), frozen).loss.backward()
        mix = blocks[3].mix
        assert mix is not None and mix.shape == ((2,) if dense is StackDense.EMBED else (4,)) and mix.grad is not None


def test_serving_refuses_a_dense_stack_with_a_fix(tmp_path: Path, data_dir: Path) -> None:
    from blocktrain.serve.runtime.loading import load_run_span

    cfg = variant_cfg(StackConfig(dense=StackDense.ALL), steps=1, eval_bytes=0)
    for k in range(cfg.model.n_blocks):
        train_block(cfg, open_data_dir(data_dir), tmp_path / "run", k, progress=False)
    with pytest.raises(ConfigError, match="--dense off"):
        load_run_span(RunDir(tmp_path / "run"), 0, 3)


@pytest.mark.parametrize("name", ["init-identity", "head-residual", "copy+front", "dense-all"])
def test_progressive_variant_trains_round_trips_and_composes(name: str, tmp_path: Path, data_dir: Path) -> None:
    cfg = variant_cfg(VARIANTS[name], steps=8, eval_bytes=0, checkpoint_every=4)
    dd = open_data_dir(data_dir)
    run = tmp_path / "run"
    obj = get_objective(cfg)
    for k in range(cfg.model.n_blocks):
        s = train_block(cfg, dd, run, k, progress=False)
        assert s.steps == obj.block_steps(k)
    loaded = RunDir(run).load_config()
    assert loaded.stack == cfg.stack  # the variant is part of the run's config and architecture key
    blocks = [load_block(RunDir(run), loaded, k) for k in range(cfg.model.n_blocks)]
    model = AssembledModel.load(RunDir(run))
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    direct = AssembledModel(blocks, loaded, Precision.FP32)
    assert torch.equal(model.reference_log_probs(x), direct.reference_log_probs(x))
    if name == "head-residual":  # the frozen head went into the checkpoint: block 3 reads block 2's head
        b3, b2 = blocks[3], blocks[2]
        assert isinstance(b3, StackBlock) and isinstance(b2, StackBlock) and b3.prev_head is not None
        assert torch.equal(b3.prev_head.head.weight, _head_weight(b2))


def test_concurrent_refuses_an_unequal_budget(tmp_path: Path, data_dir: Path) -> None:
    cfg = variant_cfg(StackConfig(step_ratio=0.7), steps=8, eval_bytes=0, schedule=Schedule.CONCURRENT)
    with pytest.raises(BlockTrainError, match="--step-ratio 1"):
        train_concurrent(cfg, open_data_dir(data_dir), tmp_path / "run", progress=False)


def test_concurrent_residual_heads_follow_the_refresh(tmp_path: Path, data_dir: Path) -> None:
    cfg = variant_cfg(StackConfig(head=StackHead.RESIDUAL, init=StackInit.IDENTITY), steps=4, eval_bytes=0,
                      round_steps=2, refresh_rounds=1, schedule=Schedule.CONCURRENT)
    train_concurrent(cfg, open_data_dir(data_dir), tmp_path / "run", progress=False)
    blocks = [load_block(RunDir(tmp_path / "run"), cfg, k) for k in range(cfg.model.n_blocks)]
    b1 = blocks[1]
    assert isinstance(b1, StackBlock) and b1.prev_head is not None
    # refreshed at step 2 from block 0's head of then; block 0 trained 2 more steps after
    assert not torch.equal(b1.prev_head.head.weight, torch.zeros_like(b1.prev_head.head.weight))


@pytest.mark.parametrize("killed_at", [1, 2])
def test_a_resumed_concurrent_run_logs_each_step_once(tmp_path: Path, data_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch, killed_at: int) -> None:
    """The concurrent schedule never dropped the metrics of steps after the checkpoint it resumed from: killed after
    steps 5..8 ran and before their checkpoint, the resumed run logged them again (helper-60); killed before its
    first checkpoint (steps 1..4), it resumed at 0 and logged those twice (helper-61)."""
    from collections import Counter

    from blocktrain.train import schedule

    cfg = replace(tiny(), objective=Objective.STACK).with_train(steps=8, eval_bytes=0, round_steps=2, refresh_rounds=2,
                                                                schedule=Schedule.CONCURRENT, log_every=1)
    real, calls = schedule._checkpoint, []

    def killed_before_the_second(*args: object) -> None:
        calls.append(1)
        if len(calls) == killed_at:
            raise KeyboardInterrupt  # the steps of this refresh ran, their checkpoint never written
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(schedule, "_checkpoint", killed_before_the_second)
    with pytest.raises(KeyboardInterrupt):
        train_concurrent(cfg, open_data_dir(data_dir), tmp_path / "run", progress=False)
    monkeypatch.setattr(schedule, "_checkpoint", real)
    train_concurrent(cfg, open_data_dir(data_dir), tmp_path / "run", progress=False)
    for k in range(cfg.model.n_blocks):
        steps = [r["step"] for r in read_jsonl(RunDir(tmp_path / "run").metrics_path(f"block_{k}"))
                 if "step" in r and "loss" in r]
        assert sorted(steps) == list(range(1, 9)), (k, Counter(steps))
