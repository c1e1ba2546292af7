"""Decentralised training of the ``stack`` objective: block states, frozen downloads, stack workers.

In-process coordinators (FastAPI TestClient) for the state machine, and real
workers against a coordinator served by uvicorn on 127.0.0.1 for the frozen
downloads (count, cache, hash check) and the training that uses them.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import load_file, pack, tensors_sha256, unpack
from blocktrain.config import Objective, Precision, Schedule
from blocktrain.coordinator.app import create_app
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream, mix_seed
from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.model.block import BlockDenoiser
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset
from blocktrain.protocol.codes import BlockState
from blocktrain.protocol.delta import Compression, decode_delta, pack_delta
from blocktrain.protocol.weights import load_trainable
from blocktrain.train.step import lr_at, make_optimizer, optimizer_step
from blocktrain.worker.loop import Worker
from blocktrain.worker.options import WorkerOptions, WorkerSummary
from tests.distributed_utils import (  # noqa: F401
    HANDMADE,
    FakeClock,
    ThreadServer,
    add_token,
    cli,
    corpus,
    free_port,
    get_status,
    one_row,
    procs,
    wait_for,
)

STACK = replace(get_preset("tiny"), objective=Objective.STACK)


def stack_coordinator(run: Path, data: DataDir | None = None, clock: Any = None, **settings: Any) -> Coordinator:
    """A stack coordinator with :data:`HANDMADE`'s settings unless a test says otherwise."""
    settings.setdefault("fsync", False)
    for name, value in HANDMADE.items():
        settings.setdefault(name, value)
    if clock is None:
        return Coordinator(run, STACK, CoordinatorSettings(**settings), data)
    return Coordinator(run, STACK, CoordinatorSettings(**settings), data, clock=clock)


def delta_for(c: Coordinator, k: int, seed: int = 0, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in c.block_shapes[k].items()}


def finish_block(c: Coordinator, k: int, name: str) -> None:
    """Close every round of block k with one small update from worker ``name`` (pinned to k)."""
    c.add_token(name)
    c.register(name, k)
    for v in range(c.block_rounds(k)):
        c.submit(name, k, pack_delta(delta_for(c, k, seed=v), Compression.BF16, block=k, base_version=v,
                                     base_sha=c.weights_sha[k], samples=4))
    c.leave(name)


def worker_opts(url: str, token: str, block: int, cache: Path) -> WorkerOptions:
    return WorkerOptions(url=url, token=token, block=block, local_steps=2, compression=Compression.NONE,
                         progress=False, poll_s=0.05, give_up_s=30, precision=Precision.FP32, device="cpu",
                         frozen_cache=cache)


def run_worker(c: Coordinator, name: str, block: int, cache: Path, data: DataDir) -> WorkerSummary:
    token = c.add_token(name)
    with ThreadServer(c, background=False) as srv:
        return Worker(worker_opts(srv.url, token, block, cache), data).run()


def test_stack_coordinator_opens_block_zero_only(tmp_path: Path) -> None:
    c = stack_coordinator(tmp_path / "run", clock=FakeClock(), rounds=2)
    assert "tok_emb.weight" in c.block_shapes[0] and "tok_emb.weight" not in c.block_shapes[1]  # schemas per block
    with TestClient(create_app(c, background=False)) as client:
        tokens = {n: c.add_token(n) for n in ("a", "b", "c", "pinned")}

        def h(n: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {tokens[n]}"}

        st = client.get("/v1/status").json()
        assert st["objective"] == "stack"
        assert [b["state"] for b in st["blocks"]] == ["open", "waiting", "waiting", "waiting"]
        assert [b["round_state"] for b in st["blocks"]] == ["open", "waiting", "waiting", "waiting"]
        metrics = client.get("/metrics").text
        assert 'blocktrain_block_state{block="0",state="open"} 1' in metrics
        assert 'blocktrain_block_state{block="1",state="waiting"} 1' in metrics
        assert 'blocktrain_block_state{block="1",state="open"} 0' in metrics
        # unpinned workers all go to the only open block, however many replicas it has
        got = [client.post("/v1/register", json={"block": None}, headers=h(n)).json()["block"] for n in "abc"]
        assert got == [0, 0, 0]
        reg = client.post("/v1/register", json={"block": 2}, headers=h("pinned")).json()
        assert reg["block"] == 2 and reg["block_state"] == "waiting" and "opens once blocks 0..1" in reg["message"]
        work = client.get("/v1/work", headers=h("pinned")).json()
        assert (work["block"], work["round_state"], work["finished"], work["frozen"]) == (2, "waiting", False, [])
        r = client.get("/v1/blocks/0/frozen", headers=h("a"))
        assert r.status_code == 409 and r.json()["error"] == "not_finished"
        assert client.get("/v1/blocks/0/frozen").status_code == 401
        assert client.get("/v1/blocks/9/frozen", headers=h("a")).status_code == 404
        body = pack_delta(delta_for(c, 2), Compression.BF16, block=2, base_version=0, base_sha=c.weights_sha[2], samples=4)
        r = client.post("/v1/blocks/2/updates", content=body, headers=h("pinned"))
        assert r.status_code == 409 and r.json()["error"] == "waiting"
    assert c.version == {0: 0, 1: 0, 2: 0, 3: 0}
    c.close()


def test_block_one_opens_after_block_zero_finishes_and_restart_keeps_states(tmp_path: Path) -> None:
    run = tmp_path / "run"
    c = stack_coordinator(run, clock=FakeClock(), rounds=2)
    c.add_token("mover")
    assert c.register("mover", None).block == 0
    c.leave("mover")  # not a live replica of block 0, so one update closes each of its rounds
    finish_block(c, 0, "seed")
    assert c.state == {0: BlockState.FINISHED, 1: BlockState.OPEN, 2: BlockState.WAITING, 3: BlockState.WAITING}
    work = c.work("mover").model_dump(mode="json")  # unpinned: moved from the finished block to the open one
    assert work["block"] == 1 and work["block_state"] == "open" and work["round_state"] == "open"
    assert work["frozen"] == [{"block": 0, "version": 2, "weights_sha": c.weights_sha[0]}]
    v, sha, payload = c.frozen_bytes(0)
    tensors, meta = unpack(payload)
    assert (v, sha, meta["version"], meta["block_index"], meta["kind"]) == (2, c.weights_sha[0], "2", "0", "frozen")
    assert tensors_sha256(tensors) == sha and set(tensors) == set(c.block_shapes[0])
    for n, t in tensors.items():
        assert torch.equal(t, c.weights[0][n]), n
    c.close()
    c2 = stack_coordinator(run, clock=FakeClock(), rounds=2)
    assert c2.state == {0: BlockState.FINISHED, 1: BlockState.OPEN, 2: BlockState.WAITING, 3: BlockState.WAITING}
    rows = c2.store.q("SELECT block, state FROM block_states ORDER BY block")
    assert [(r["block"], r["state"]) for r in rows] == [(0, "finished"), (1, "open"), (2, "waiting"), (3, "waiting")]
    assert c2.frozen_bytes(0)[:2] == (2, sha)
    assert c2.work("mover").block == 1
    c2.close()


def test_h_per_block_gives_every_block_all_its_steps_in_at_least_the_rounds(tmp_path: Path) -> None:
    """--local-steps 0: block k's H is its own steps // --rounds, and the block trains all its steps in rounds of that
    H, so at least --rounds rounds (the step ratio gives later blocks fewer steps, hence a smaller H, below the
    default 25); the registration, the work answer and the sample cap all use it."""
    cfg = replace(STACK, stack=replace(STACK.stack, step_ratio=0.7))
    n = 5  # --rounds
    c = Coordinator(tmp_path / "run", cfg, CoordinatorSettings(rounds=n, local_steps=0, fsync=False, **HANDMADE), clock=FakeClock())
    objective = get_objective(cfg)
    want = [max(1, objective.block_steps(k) // n) for k in range(4)]
    rounds = [objective.block_steps(k) // want[k] for k in range(4)]
    assert want[0] > want[3], want  # the step ratio front-loads the steps
    assert min(rounds) >= n and any(r > n for r in rounds), rounds  # no block's steps are dropped
    for k in range(4):
        c.add_token(f"w{k}")
        reg = c.register(f"w{k}", k)
        assert (reg.rounds, reg.local_steps) == (rounds[k], want[k])
        assert c.work(f"w{k}").steps == want[k]
        c.leave(f"w{k}")
        assert c.block_rounds(k) == rounds[k] and objective.block_steps(k) - rounds[k] * want[k] < want[k]
    token = c.add_token("greedy")
    with TestClient(create_app(c, background=False)) as client:  # a claim one sample over block 0's budget, over HTTP
        auth = {"Authorization": f"Bearer {token}"}
        assert client.post("/v1/register", json={"block": 0}, headers=auth).json()["local_steps"] == want[0]
        too_many = pack_delta(delta_for(c, 0), Compression.BF16, block=0, base_version=0, base_sha=c.weights_sha[0],
                              samples=want[0] * STACK.train.batch_size + 1)
        r = client.post("/v1/blocks/0/updates", content=too_many, headers=auth)
        assert (r.status_code, r.json()["error"]) == (422, "claim"), r.text
    c.leave("greedy")
    finish_block(c, 0, "seed")
    assert c.version[0] == rounds[0] and c.state[1] is BlockState.OPEN
    c.close()
    with pytest.raises(ConfigError, match="--rounds"):
        CoordinatorSettings(local_steps=0)


def test_stack_coordinator_needs_rounds_and_the_progressive_schedule(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--rounds"):
        stack_coordinator(tmp_path / "a", rounds=0)
    concurrent = replace(STACK, train=replace(STACK.train, schedule=Schedule.CONCURRENT))
    with pytest.raises(ConfigError, match="progressive"):
        Coordinator(tmp_path / "b", concurrent, CoordinatorSettings(rounds=1, fsync=False, **HANDMADE))


def test_diffusion_blocks_all_open_and_gate_loss_unchanged(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    cfg = get_preset("tiny")
    c = Coordinator(tmp_path / "run", cfg, CoordinatorSettings(rounds=1, fsync=False, gate_tolerance=0.1, **HANDMADE), corpus)
    assert set(c.state.values()) == {BlockState.OPEN}
    # the gate through the objective computes what diffusion.loss.block_loss computes on the same batch and noise
    k = 2
    block = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
    load_trainable(block, c.weights[k])
    stream = TrainStream(corpus.open("valid").data, cfg.model.context, c.settings.gate_batch, cfg.train.seed,
                         stream=mix_seed(7_777, k))
    with torch.no_grad():
        want = block_loss(block.eval(), k, *stream.batch(0), NoisePartition(cfg.diffusion, cfg.model.n_blocks),
                          cfg.diffusion, stream.generator(0, purpose=1))
    assert c.evaluator.gate_loss(k, c.weights[k]) == float(want.loss)
    c.close()


def test_a_worker_whose_diffusion_block_finishes_moves_to_one_still_open(tmp_path: Path) -> None:
    """A diffusion run opens every block at once: the unpinned worker of a finished block is moved to an open one,
    and only once every block has finished is it told so (the README's one-worker run then ends)."""
    c = Coordinator(tmp_path / "run", get_preset("tiny"), CoordinatorSettings(rounds=1, fsync=False, eval_every=0, **HANDMADE))
    c.add_token("w")
    assert c.register("w", None).block == 0
    c.leave("w")
    for k in range(c.n_blocks):
        finish_block(c, k, f"seed{k}")
        work = c.work("w").model_dump(mode="json")
        c.leave("w")  # not a live replica of its new block: the seed worker's updates close its rounds
        if k < c.n_blocks - 1:
            assert (work["block"], work["block_state"], work["finished"]) == (k + 1, "open", False), k
    assert work["finished"] and c.finished()
    c.close()


def test_stack_gate_reads_the_frozen_blocks_and_eval_composes(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = stack_coordinator(tmp_path / "run", corpus, rounds=1, gate_tolerance=0.5, eval_bytes=256, audit_fraction=0.0)
    ce = c.maybe_evaluate()  # the composed stack at initialisation: about uniform over 256 bytes
    assert ce is not None and abs(ce - math.log(256)) < 0.1
    finish_block(c, 0, "seed")
    ev = Evaluator(STACK, c.settings, corpus)
    frozen = [(c.weights_sha[0], c.weights[0])]
    got = ev.gate_loss(1, c.weights[1], frozen)
    obj = get_objective(STACK)
    b0, b1 = obj.build_block(0), obj.build_block(1)
    load_trainable(b0, c.weights[0])
    load_trainable(b1, c.weights[1])
    stream = TrainStream(corpus.open("valid").data, STACK.model.context, c.settings.gate_batch, STACK.train.seed,
                         stream=mix_seed(7_777, 1))
    with torch.no_grad():
        want = obj.block_loss(b1.eval(), 1, *stream.batch(0), stream.generator(0, purpose=1),
                              [obj.freeze(b0, torch.float32)])
    assert got == float(want.loss)
    c.close()


def test_stack_worker_downloads_frozen_block_once_and_trains_on_it(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = stack_coordinator(tmp_path / "run", rounds=2, round_seconds=60, lease_seconds=60)
    finish_block(c, 0, "seed")
    cache = tmp_path / "cache"
    w0 = {n: t.clone() for n, t in c.weights[1].items()}  # block 1 before its first round
    s1 = run_worker(c, "w1", 1, cache, corpus)
    assert (s1.rounds_pushed, s1.local_steps, s1.frozen_downloads, s1.block) == (2, 4, 1, 1)  # 2 rounds, 1 download
    assert c.state[1] is BlockState.FINISHED and c.state[2] is BlockState.OPEN and c.version[1] == 2
    _, sha0, payload0 = c.frozen_bytes(0)
    assert [p.name for p in cache.iterdir()] == [f"block0-v2-{sha0}.safetensors"]
    assert (cache / f"block0-v2-{sha0}.safetensors").read_bytes() == payload0
    audit_round(c, "w1", 1, 0, w0, corpus)  # round 0 of block 1, replayed on the frozen block 0
    # a second worker on block 2 shares the cache: block 0 comes from disk, only block 1 is downloaded
    s2 = run_worker(c, "w2", 2, cache, corpus)
    assert (s2.rounds_pushed, s2.frozen_downloads) == (2, 1)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [f"block0-v2-{sha0}.safetensors", f"block1-v2-{c.weights_sha[1]}.safetensors"])
    assert c.state[2] is BlockState.FINISHED and c.state[3] is BlockState.OPEN
    c.close()


def audit_round(c: Coordinator, worker: str, k: int, v: int, before: dict[str, torch.Tensor], data: DataDir,
                H: int = 2) -> None:
    """Replay ``worker``'s round v of block k from its recorded stream, on the frozen blocks 0..k-1, with the
    block's schedule at steps v*H.. (fresh AdamW moments, as the worker's first round on the block), and compare
    with the delta it sent (fp32 both: tolerance of a last-bit difference through Adam's sqrt(v))."""
    seed = one_row(c.store, f"SELECT * FROM seeds WHERE worker='{worker}' AND block={k} AND version={v}")
    upd = one_row(c.store, f"SELECT blob FROM updates WHERE worker='{worker}' AND block={k} AND version={v}")
    got = decode_delta(unpack(c.store.blobs.get_blob(upd["blob"]))[0], Compression.NONE)
    obj = get_objective(STACK)
    frozen = []
    for j in range(k):
        bj = obj.build_block(j)
        load_trainable(bj, c.weights[j])
        frozen.append(obj.freeze(bj, torch.float32))
    block = obj.build_block(k)
    load_trainable(block, before)
    opt, _ = make_optimizer(block, STACK.train)
    schedule = replace(STACK.train, steps=c.settings.rounds * H)
    stream = TrainStream(data.open("train").data, STACK.model.context, STACK.train.batch_size, seed["seed"],
                         stream=seed["stream"])
    block.train()
    for i in range(H):
        out = obj.block_loss(block, k, *stream.batch(i), stream.generator(i, purpose=1), frozen)
        optimizer_step(block, opt, out.loss, lr_at(v * H + i, schedule), STACK.train.grad_clip)
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.detach() - before[n], got[n], rtol=1e-4, atol=1e-5)


def test_moved_worker_trains_the_next_block_on_that_blocks_schedule(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """An unpinned worker that finished block 0 moves to block 1 and starts it at the top of block 1's lr schedule
    (its lr follows the block's rounds, not the steps the worker did before)."""
    c = stack_coordinator(tmp_path / "run", rounds=1, round_seconds=60, lease_seconds=60)
    before = {n: t.clone() for n, t in c.weights[1].items()}
    token = c.add_token("w")
    with ThreadServer(c, background=False) as srv:
        s = Worker(replace(worker_opts(srv.url, token, 0, tmp_path / "cache"), block=None), corpus).run()
    assert s.rounds_pushed == 4 and [c.state[k] for k in range(4)] == [BlockState.FINISHED] * 4
    audit_round(c, "w", 1, 0, before, corpus)
    c.close()


def test_damaged_cache_file_is_downloaded_again(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = stack_coordinator(tmp_path / "run", rounds=1, round_seconds=60, lease_seconds=60)
    finish_block(c, 0, "seed")
    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / f"block0-v1-{c.weights_sha[0]}.safetensors"
    path.write_bytes(b"not a safetensors file")
    s = run_worker(c, "w1", 1, cache, corpus)
    assert (s.rounds_pushed, s.frozen_downloads) == (1, 1)
    assert path.read_bytes() == c.frozen_bytes(0)[2]
    c.close()


@pytest.mark.parametrize("tamper", ["corrupt", "altered"])
def test_worker_refuses_a_tampered_frozen_download(tmp_path: Path, corpus: DataDir, tamper: str,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    c = stack_coordinator(tmp_path / "run", rounds=1, round_seconds=60, lease_seconds=60)
    finish_block(c, 0, "seed")
    v, sha, payload = c.frozen_bytes(0)
    if tamper == "corrupt":  # a flipped byte in the last tensor's data: the header's sha256 no longer matches
        bad = payload[:-5] + bytes([payload[-5] ^ 0xFF]) + payload[-4:]
        match = "sha256 mismatch"
    else:  # other weights, consistently packed: only the sha published in /v1/work gives them away
        bad = pack({n: t + 0.01 for n, t in c.weights[0].items()},
                   {"kind": "frozen", "block_index": "0", "version": str(v), "weights_sha": sha})
        match = "altered on the way"
    monkeypatch.setattr(c, "frozen_bytes", lambda k: (v, sha, bad))
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match=match):
        run_worker(c, "w1", 1, cache, corpus)
    assert one_row(c.store, "SELECT COUNT(*) AS n FROM updates WHERE block=1")["n"] == 0  # it never trained on it
    assert not cache.exists() or not any(cache.iterdir())  # and never cached it
    assert c.version[1] == 0
    c.close()


def test_worker_pinned_to_a_waiting_block_waits_then_trains(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    c = stack_coordinator(tmp_path / "run", rounds=1, round_seconds=60, lease_seconds=60)
    token = c.add_token("w1")
    result: dict[str, WorkerSummary] = {}
    with ThreadServer(c, background=False) as srv:
        worker = Worker(worker_opts(srv.url, token, 1, tmp_path / "cache"), corpus)
        thread = threading.Thread(target=lambda: result.update(summary=worker.run()), daemon=True)
        thread.start()
        wait_for(lambda: c.store.q1("SELECT 1 FROM workers WHERE name='w1'") is not None, 30, "w1 to register")
        time.sleep(0.5)  # ten polls while block 1 waits
        assert c.state[1] is BlockState.WAITING and one_row(c.store, "SELECT COUNT(*) AS n FROM updates")["n"] == 0
        finish_block(c, 0, "seed")  # block 0 finishes: block 1 opens and the waiting worker trains it
        thread.join(timeout=60)
    assert not thread.is_alive()
    s = result["summary"]
    assert (s.rounds_pushed, s.frozen_downloads, s.block) == (1, 1, 1)
    assert c.state == {0: BlockState.FINISHED, 1: BlockState.FINISHED, 2: BlockState.OPEN, 3: BlockState.WAITING}
    c.close()


def test_cli_stack_run_trains_every_block_in_order(tmp_path: Path, corpus: DataDir, procs) -> None:  # noqa: F811
    """The commands of OBJECTIVE=stack scripts/exp_six_workers.sh: one unpinned worker follows the open block 0 -> 3."""
    run, port, cache = tmp_path / "run", free_port(), tmp_path / "cache"
    url = f"http://127.0.0.1:{port}"
    token = add_token(run, "w")
    procs.append(cli("coordinator", "--run-dir", str(run), "--preset", "tiny", "--objective", "stack", "--port",
                     str(port), "--rounds", "1", "--no-eval", "--no-fsync", "--threads", "1", stdout=subprocess.DEVNULL))
    wait_for(lambda: get_status(url), 120, "the coordinator")
    assert [b["state"] for b in get_status(url)["blocks"]] == ["open", "waiting", "waiting", "waiting"]
    summary = tmp_path / "w.json"
    worker = cli("worker", "--coordinator", url, "--token", token, "--data", str(corpus.root), "--threads", "1",
                 "--no-progress", "--local-steps", "2", "--precision", "fp32", "--frozen-cache", str(cache),
                 "--summary-json", str(summary), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(worker)
    assert worker.wait(timeout=240) == 0
    st = get_status(url)
    assert [b["state"] for b in st["blocks"]] == ["finished"] * 4 and st["finished"]
    assert [b["version"] for b in st["blocks"]] == [1, 1, 1, 1]
    s = json.loads(summary.read_text())
    # one round per block; block k reads blocks 0..k-1, each downloaded once: blocks 0, 1 and 2
    assert (s["rounds_pushed"], s["frozen_downloads"], s["block"]) == (4, 3, 3)
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["block0", "block1", "block2"]


def test_a_failed_copy_of_a_warm_started_block_does_not_escape_the_close(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack that copies block k-1 into block k warm-starts block k as block k-1 finishes, and wrote its copy there
    itself: on a full disk the OSError came out of the close (after its commit), past the screened workers' refusals.
    Its copy is tried again like any other."""
    from blocktrain.config import StackInit

    cfg = replace(STACK, stack=replace(STACK.stack, init=StackInit.COPY))
    c = Coordinator(tmp_path / "run", cfg, CoordinatorSettings(fsync=False, rounds=2, **HANDMADE), None,
                    clock=FakeClock())
    try:
        assert c.rounds.objective.inherits()

        def full_disk(k: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(c.checkpoints, "save_checkpoint", full_disk)
        finish_block(c, 0, "seed")  # its last close warm-starts block 1: no raise
        assert c.state[1] is BlockState.OPEN and {0, 1} <= c.rounds._copies_due
    finally:
        c.close()


def test_a_failed_checkpoint_copy_leaves_the_committed_block_states_in_memory(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The run-directory copy of a block's checkpoint is written after the close is committed; when it failed (a full
    disk), the states in memory stayed as before: block 0 open though finished in the store, block 1 waiting, until
    a restart. The states follow the commit, and the failure is logged."""
    c = stack_coordinator(tmp_path / "run", clock=FakeClock(), rounds=2)
    try:
        def full_disk(k: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(c.checkpoints, "save_checkpoint", full_disk)
        finish_block(c, 0, "seed")
        assert c.state == {0: BlockState.FINISHED, 1: BlockState.OPEN, 2: BlockState.WAITING, 3: BlockState.WAITING}
        assert c.version[0] == 2
        monkeypatch.undo()  # room again: block 0's copy is written at the next close, whichever block's
        assert load_file(RunDir(tmp_path / "run").block_path(0))[1]["step"] == "0"
        c.add_token("w1")
        c.register("w1", 1)
        c.submit("w1", 1, pack_delta(delta_for(c, 1), Compression.BF16, block=1, base_version=0,
                                     base_sha=c.weights_sha[1], samples=4))
        assert c.version[1] == 1 and load_file(RunDir(tmp_path / "run").block_path(0))[1]["step"] == "2"
    finally:
        c.close()
