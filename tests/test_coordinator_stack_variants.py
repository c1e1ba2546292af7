"""Decentralised training of a stack depth variant: the coordinator warm-starts a block as it opens, and the
worker, the loss gate and the mirrored checkpoints carry the frozen heads it reads (issue 18)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.config import Objective, Precision, RunConfig, StackConfig, StackHead, StackInit
from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.model.stack import StackBlock
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import whole_blocks
from blocktrain.presets import get_preset
from blocktrain.protocol.codes import BlockState
from blocktrain.protocol.delta import Compression, decode_delta
from blocktrain.protocol.weights import load_trainable, trainable_state
from blocktrain.train.step import lr_at, make_optimizer, optimizer_step
from blocktrain.worker.loop import Worker
from blocktrain.worker.options import WorkerSummary
from tests.distributed_utils import HANDMADE, ThreadServer, corpus, one_row, wait_for  # noqa: F401
from tests.test_coordinator_stack import finish_block, worker_opts

VARIANT = replace(get_preset("tiny"), objective=Objective.STACK,
                  stack=StackConfig(init=StackInit.IDENTITY, head=StackHead.RESIDUAL))
H = 2  # local steps per round


def replay_round_zero(c: Coordinator, worker: str, k: int, fresh: dict[str, torch.Tensor], data: DataDir,
                      cfg: RunConfig = VARIANT, lr: float | None = None) -> None:
    """Version 0 of block k is the fresh block warm-started from block k-1's final weights, and ``worker``'s round
    on it equals a local replay on the frozen blocks with the frozen head of block k-1 (fp32 both), at peak ``lr``
    (default: the block's own, ``Objective.block_lr``)."""
    obj = get_objective(cfg)
    v0_blob = one_row(c.store, f"SELECT weights_blob FROM versions WHERE block={k} AND version=0")["weights_blob"]
    v0 = unpack(c.store.blobs.get_blob(v0_blob))[0]
    earlier = whole_blocks(obj, [c.weights[j] for j in range(k)])
    expect = obj.build_block(k)
    load_trainable(expect, fresh)
    obj.inherit(expect, k, earlier, at_init=True)
    assert all(torch.equal(v0[n], t) for n, t in trainable_state(expect).items())
    upd = one_row(c.store, f"SELECT blob FROM updates WHERE worker='{worker}' AND block={k} AND version=0")
    seed = one_row(c.store, f"SELECT * FROM seeds WHERE worker='{worker}' AND block={k} AND version=0")
    got = decode_delta(unpack(c.store.blobs.get_blob(upd["blob"]))[0], Compression.NONE)
    frozen = [obj.freeze(b, torch.float32) for b in earlier]
    block = obj.build_block(k)
    load_trainable(block, v0)
    obj.inherit(block, k, earlier, at_init=False)
    opt, _ = make_optimizer(block, cfg.train)
    stream = TrainStream(data.open("train").data, cfg.model.context, cfg.train.batch_size, seed["seed"],
                         stream=seed["stream"])
    schedule = replace(cfg.train, steps=H, lr=obj.block_lr(k) if lr is None else lr)
    block.train()
    for i in range(H):
        out = obj.block_loss(block, k, *stream.batch(i), stream.generator(i, purpose=1), frozen)
        optimizer_step(block, opt, out.loss, lr_at(i, schedule), cfg.train.grad_clip)
    for n, p in block.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach() - v0[n], got[n], rtol=1e-4, atol=1e-5)


def coordinator(run: Path, data: DataDir, cfg: RunConfig = VARIANT) -> Coordinator:
    return Coordinator(run, cfg, CoordinatorSettings(rounds=1, round_seconds=60, lease_seconds=60, fsync=False,
                                                         gate_tolerance=5.0, eval_bytes=512, audit_fraction=0.0,
                                                         **HANDMADE), data)


def test_variant_run_warm_starts_and_replays_exactly(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = coordinator(tmp_path / "run", corpus)
    obj = get_objective(VARIANT)
    fresh = {k: {n: t.clone() for n, t in c.weights[k].items()} for k in range(4)}
    token = c.add_token("w")
    with ThreadServer(c, background=False) as srv:
        s = Worker(replace(worker_opts(srv.url, token, 0, tmp_path / "cache"), block=None), corpus).run()
    assert s.rounds_pushed == 4 and [c.state[k] for k in range(4)] == [BlockState.FINISHED] * 4
    for k in range(1, 4):
        replay_round_zero(c, "w", k, fresh[k], corpus)
    # the mirrored checkpoints hold the frozen heads: the run composes as the coordinator's blocks do
    model = AssembledModel.load(RunDir(tmp_path / "run"), precision=Precision.FP32)
    local = AssembledModel(whole_blocks(obj, [c.weights[k] for k in range(4)]), VARIANT, Precision.FP32)
    x = torch.randint(0, 256, (2, 16), dtype=torch.uint8)
    assert torch.equal(model.reference_log_probs(x), local.reference_log_probs(x))
    b3 = model.blocks[3]
    assert isinstance(b3, StackBlock) and b3.prev_head is not None
    c.close()


def test_a_worker_waiting_on_a_block_trains_its_warm_start_not_the_stale_version_0(
    tmp_path: Path, corpus: DataDir  # noqa: F811
) -> None:
    """Version 0 of a waiting block is replaced as it opens; the pinned worker that pulled the old one pulls again."""
    c = coordinator(tmp_path / "run", corpus)
    fresh = {n: t.clone() for n, t in c.weights[1].items()}
    token = c.add_token("w1")
    result: dict[str, WorkerSummary] = {}
    with ThreadServer(c, background=False) as srv:
        worker = Worker(worker_opts(srv.url, token, 1, tmp_path / "cache"), corpus)
        thread = threading.Thread(target=lambda: result.update(summary=worker.run()), daemon=True)
        thread.start()
        wait_for(lambda: getattr(worker, "base_version", -1) == 0, 30, "w1 to pull block 1's version 0")
        stale = worker.base_sha
        finish_block(c, 0, "seed")  # block 1 opens, warm-started
        assert c.weights_sha[1] != stale
        thread.join(60)
    assert result["summary"].rounds_pushed == 1
    replay_round_zero(c, "w1", 1, fresh, corpus)
    c.close()


def test_a_step_split_gives_each_block_its_rounds(tmp_path: Path) -> None:
    cfg = replace(VARIANT, stack=replace(VARIANT.stack, step_ratio=0.5), train=replace(VARIANT.train, steps=40))
    c = Coordinator(tmp_path / "run", cfg, CoordinatorSettings(rounds=8, fsync=False, **HANDMADE))
    obj = get_objective(cfg)
    rounds = [c.block_rounds(k) for k in range(4)]
    assert rounds == [round(8 * obj.block_steps(k) / 40) for k in range(4)] and rounds[0] > rounds[3] >= 1
    finish_block(c, 0, "seed")  # one update per round of block 0's own count
    assert c.version[0] == rounds[0] and c.state[0] is BlockState.FINISHED and c.state[1] is BlockState.OPEN
    c.close()


def test_a_worker_trains_a_later_block_at_its_own_lr(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """stack.lr_later reaches the worker: its round on block 1 equals a local replay at lr_later x train.lr, not at
    train.lr."""
    cfg = replace(VARIANT, stack=replace(VARIANT.stack, lr_later=0.5))
    c = coordinator(tmp_path / "run", corpus, cfg)
    finish_block(c, 0, "seed")  # block 1 opens, warm-started from block 0
    fresh = {n: t.clone() for n, t in c.weights[1].items()}
    token = c.add_token("w1")
    with ThreadServer(c, background=False) as srv:
        assert Worker(worker_opts(srv.url, token, 1, tmp_path / "cache"), corpus).run().rounds_pushed == 1
    replay_round_zero(c, "w1", 1, fresh, corpus, cfg)
    with pytest.raises(AssertionError):  # the same round at block 0's lr is another round
        replay_round_zero(c, "w1", 1, fresh, corpus, cfg, lr=cfg.train.lr)
    c.close()
