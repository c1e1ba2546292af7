"""Training, resuming, assembling and scoring on the tiny preset."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.generate import generate
from blocktrain.evaluate.report import evaluate_model
from blocktrain.evaluate.scoring import score_split
from blocktrain.presets import tiny
from blocktrain.train.block import train_block
from blocktrain.train.e2e import train_e2e
from tests.conftest import write_data_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, Path, Path]:
    root = tmp_path_factory.mktemp("trained")
    data = write_data_dir(root / "data")
    cfg = tiny().with_train(steps=200, lr=1e-2, warmup_steps=10, eval_bytes=0)
    dd = open_data_dir(data)
    run = root / "run"
    train_e2e(cfg, dd, run, progress=False)
    for k in range(cfg.model.n_blocks):
        train_block(cfg, dd, run, k, progress=False)
    return cfg, data, run


def test_run_layout_and_metrics(trained: tuple[RunConfig, Path, Path]) -> None:
    cfg, _, run = trained
    rd = RunDir(run)
    assert rd.has_blocks(cfg.model.n_blocks) and rd.has_e2e()
    assert rd.load_config() == cfg
    lines = rd.metrics_path("block_2").read_text().splitlines()
    assert '"event": "summary"' in lines[-1]


@pytest.mark.parametrize("signal", [KeyboardInterrupt, SystemExit])
def test_resume_after_kill_is_exact(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, signal: type[BaseException]
) -> None:
    """Ctrl-C saves at the current step; a hard stop falls back to the last periodic checkpoint."""
    from blocktrain.checkpoint.safetensors_io import load_file
    from blocktrain.objectives.diffusion import DiffusionObjective as Tb

    dd = open_data_dir(data_dir)
    cfg = tiny().with_train(steps=12, checkpoint_every=4, eval_bytes=0)
    train_block(cfg, dd, tmp_path / "straight", 1, progress=False)

    real_loss = Tb.block_loss
    calls = {"n": 0}

    def dying_loss(self: object, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 7:
            raise signal()
        return real_loss(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Tb, "block_loss", dying_loss)
    with pytest.raises(signal):
        train_block(cfg, dd, tmp_path / "resumed", 1, progress=False)
    saved = load_file(RunDir(tmp_path / "resumed").block_path(1))[1]["step"]
    assert saved == ("6" if signal is KeyboardInterrupt else "4")
    monkeypatch.setattr(Tb, "block_loss", real_loss)
    train_block(cfg, dd, tmp_path / "resumed", 1, progress=False)

    a, ma = load_file(RunDir(tmp_path / "straight").block_path(1))
    b, mb = load_file(RunDir(tmp_path / "resumed").block_path(1))
    assert ma["step"] == mb["step"] == "12"
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


@pytest.mark.parametrize("killed", ["before_weights", "after_weights"])
def test_a_kill_inside_a_checkpoint_leaves_a_pair_that_resumes_exactly(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, killed: str
) -> None:
    """A save wrote the optimiser state, then the weights: a kill between the two left them at different steps, and
    the run could only be deleted. The new state now waits beside the old one until the weights are written."""
    from blocktrain.checkpoint.safetensors_io import load_file
    from blocktrain.train import checkpointing

    dd = open_data_dir(data_dir)
    cfg = tiny().with_train(steps=12, checkpoint_every=4, eval_bytes=0)
    train_block(cfg, dd, tmp_path / "straight", 1, progress=False)
    real = checkpointing.save_model

    def dying(path: Path, *args: object, step: int, **kwargs: object) -> str:
        if step == 8 and killed == "before_weights":
            raise SystemExit("killed")
        out = real(path, *args, step=step, **kwargs)  # type: ignore[arg-type, misc]
        if step == 8:
            raise SystemExit("killed")
        return out

    monkeypatch.setattr(checkpointing, "save_model", dying)
    with pytest.raises(SystemExit):
        train_block(cfg, dd, tmp_path / "resumed", 1, progress=False)
    monkeypatch.setattr(checkpointing, "save_model", real)
    train_block(cfg, dd, tmp_path / "resumed", 1, progress=False)
    a, _ = load_file(RunDir(tmp_path / "straight").block_path(1))
    b, mb = load_file(RunDir(tmp_path / "resumed").block_path(1))
    assert mb["step"] == "12" and not list((tmp_path / "resumed" / "blocks").glob("*.next"))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_single_block_run_builds_only_its_block(tmp_path: Path, data_dir: Path) -> None:
    cfg = tiny().with_train(steps=2, eval_bytes=0)
    s = train_block(cfg, open_data_dir(data_dir), tmp_path / "r", 3, progress=False)
    files = sorted(p.name for p in (tmp_path / "r" / "blocks").iterdir())
    assert files == ["block_3.safetensors", "block_3.state.safetensors"]
    from blocktrain.model.block import BlockDenoiser

    assert s.params == sum(p.numel() for p in BlockDenoiser(cfg.model, 0.5).parameters())


def test_checkpoint_from_other_config_rejected(tmp_path: Path, data_dir: Path) -> None:
    dd = open_data_dir(data_dir)
    cfg = tiny().with_train(steps=2, eval_bytes=0)
    train_block(cfg, dd, tmp_path / "r", 0, progress=False)
    other = replace(cfg, model=replace(cfg.model, d_model=64))
    with pytest.raises(ConfigError, match=r"another model/diffusion config .*choose a new --out directory"):
        train_block(other, dd, tmp_path / "r", 0, progress=False)
    rd = RunDir(tmp_path / "r")
    bad = bytearray(rd.block_path(0).read_bytes())
    bad[-3] ^= 0xFF
    rd.block_path(0).write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="sha256"):
        AssembledModel.load(rd) if rd.has_blocks(4) else train_block(cfg, dd, tmp_path / "r", 0, progress=False)


def test_learning_beats_uniform(trained: tuple[RunConfig, Path, Path]) -> None:
    cfg, data, run = trained
    valid = open_data_dir(data).open("valid")
    e2e = evaluate_model(E2EModel.load(RunDir(run)), valid)
    bt = evaluate_model(AssembledModel.load(RunDir(run)), valid, chains=3, blocks_alone=True)
    assert e2e["bytes_scored"] == bt["bytes_scored"] == len(valid) - 1
    assert e2e["ce_nats_per_byte"] < np.log(256) - 1.0
    assert bt["ce_nats_per_byte"] < np.log(256) - 0.5
    assert len(bt["blocks_alone_ce"]) == cfg.model.n_blocks
    assert (bt["model"], bt["split"]) == ("blocktrain", "valid")
    ce = bt["ce_nats_per_byte"]
    assert bt["bits_per_byte"] == pytest.approx(ce / np.log(2), rel=1e-12)
    assert bt["perplexity"] == pytest.approx(np.exp(ce), rel=1e-12)
    assert all(0.0 < a < 2 * np.log(256) for a in bt["blocks_alone_ce"])
    assert bt["compositional_gain_nats_per_byte"] == pytest.approx(min(bt["blocks_alone_ce"]) - ce, abs=1e-12)
    # the mixture of 3 chains: no worse than their mean CE (Jensen), nor than log 3 above the best chain
    mix, per_chain = bt["ce_mixture_nats_per_byte"], bt["ce_per_chain"]
    assert mix is not None and len(per_chain) == 3
    assert 0.0 < mix <= min(float(np.mean(per_chain)), min(per_chain) + np.log(3)) + 1e-9


def test_chain_zero_of_k_equals_k1(trained: tuple[RunConfig, Path, Path]) -> None:
    _, data, run = trained
    model = AssembledModel.load(RunDir(run))
    valid = open_data_dir(data).open("valid")
    one = score_split(lambda x: model.log_probs(x, chains=1), valid.data, model.context, max_bytes=500)
    three = score_split(lambda x: model.log_probs(x, chains=3), valid.data, model.context, max_bytes=500)
    assert one.ce_nats_per_byte == pytest.approx(three.ce_nats_per_byte, abs=1e-6)


def test_shuffled_targets_score_clearly_worse(trained: tuple[RunConfig, Path, Path]) -> None:
    """Leak guard: if the chain saw the true next byte, shuffling targets would not hurt."""
    _, data, run = trained
    model = AssembledModel.load(RunDir(run))
    valid = np.asarray(open_data_dir(data).open("valid").data)
    shuffled = valid.copy()
    np.random.default_rng(0).shuffle(shuffled)
    real = score_split(lambda x: model.log_probs(x), valid, model.context).ce_nats_per_byte
    fake = score_split(lambda x: model.log_probs(x), shuffled, model.context).ce_nats_per_byte
    assert fake > real + 0.5


def test_generate_is_reproducible(trained: tuple[RunConfig, Path, Path]) -> None:
    _, _, run = trained
    model = AssembledModel.load(RunDir(run))
    a = generate(model, b"The game", 12, seed=3)
    assert a == generate(model, b"The game", 12, seed=3) and len(a) == 12
    assert len(generate(E2EModel.load(RunDir(run)), b"The", 5, temperature=0)) == 5


def test_interrupt_after_optimizer_step_resumes_exactly(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while logging (after opt.step) must record the step as done, not repeat it."""
    import blocktrain.train.loop as loop
    from blocktrain.checkpoint.safetensors_io import load_file

    dd = open_data_dir(data_dir)
    cfg = tiny().with_train(steps=10, checkpoint_every=100, log_every=5, eval_bytes=0)
    train_block(cfg, dd, tmp_path / "straight", 0, progress=False)
    real_write = loop.JsonlWriter.write

    def dying_write(self: object, **record: object) -> None:
        if record.get("step") == 5 and "loss" in record:
            raise KeyboardInterrupt
        real_write(self, **record)  # type: ignore[arg-type]

    monkeypatch.setattr(loop.JsonlWriter, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        train_block(cfg, dd, tmp_path / "resumed", 0, progress=False)
    assert load_file(RunDir(tmp_path / "resumed").block_path(0))[1]["step"] == "5"
    monkeypatch.setattr(loop.JsonlWriter, "write", real_write)
    train_block(cfg, dd, tmp_path / "resumed", 0, progress=False)
    a, _ = load_file(RunDir(tmp_path / "straight").block_path(0))
    b, _ = load_file(RunDir(tmp_path / "resumed").block_path(0))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_the_quality_footer_says_how_many_bytes_were_scored() -> None:
    """A split shorter than the preset's test_bytes is scored whole, and the footer says so, as the table does."""
    import copy
    import json

    from blocktrain.bench.quality_report import format_table

    r = json.loads((Path(__file__).parents[1] / "benchmarks/results/house-repro-tiny-after.json").read_text())
    assert "Scored on the first 65,536 bytes" in format_table(r)
    short = copy.deepcopy(r)
    for arm in (short, short["e2e"], *short["objectives"].values()):
        arm["bytes_scored"] = 32_198
    text = format_table(short)
    assert "Scored on the first" not in text and "Scored on the whole test split, 32,198 bytes" in text


def test_the_bench_bar_moves_while_an_arm_trains(tmp_path: Path) -> None:
    """The bench's bar follows the steps an arm's trainer logs, within about a second, and ends at the arm's share."""
    import io
    import json
    import time

    from tqdm import tqdm

    from blocktrain.progress import MetricsProgress

    metrics = tmp_path / "metrics" / "block_0.jsonl"
    metrics.parent.mkdir()
    metrics.write_text(json.dumps({"step": 90, "loss": 1.0}) + "\n")  # an earlier run's record: not this arm's progress
    bar = tqdm(total=300.0, file=io.StringIO())
    bar.update(100.0)  # arms trained before this one
    follow = MetricsProgress(bar, metrics, steps=100, flops=200e9, interval_s=0.05)
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 10, "loss": 2.0}) + "\n" + json.dumps({"event": "eval", "step": 99}) + "\n")
        f.write('{"step": 50, "lo')  # a line being written
        f.flush()
        deadline = time.monotonic() + 5.0
        while bar.n < 120.0 - 1e-9 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bar.n == pytest.approx(120.0)  # 100 + 200 GFLOP x 10/100; the eval record's step is not a training step
        f.write('ss": 1.5}\n')
        f.flush()
        deadline = time.monotonic() + 5.0
        while bar.n < 200.0 - 1e-9 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bar.n == pytest.approx(200.0)
    follow.close()
    assert bar.n == pytest.approx(300.0)


def test_a_metrics_line_cut_by_a_kill_neither_breaks_the_file_nor_the_next_record(tmp_path: Path) -> None:
    """A kill inside a metrics write left a partial last line: the resumed run appended after it and every read of
    the file raised on it (the run's summary failed once training had finished)."""
    from blocktrain.train.metrics import JsonlWriter, read_jsonl

    path = tmp_path / "m.jsonl"
    JsonlWriter(path).write(step=1, loss=2.0)
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # killed mid-write
    JsonlWriter(path).write(step=3, loss=1.0)  # the resumed run
    assert [r["step"] for r in read_jsonl(path)] == [1, 3]
    assert path.read_text().splitlines()[-1].startswith('{"loss": 1.0')


def test_every_model_s_forward_flops_per_byte_are_counted_one_way() -> None:
    """The report's forward FLOPs per byte: the E2E's were 2 x every parameter (embeddings and norms in, attention out:
    44% under the stack of the same layers at d=64, context 512), the diffusion chain's likewise; all three now count
    matmul weights and attention as the stack and the training FLOPs do. A stack and an E2E of the same layers cost
    the same."""
    from blocktrain.config import Objective
    from blocktrain.diffusion.sampler import evaluations_per_traversal
    from blocktrain.model.e2e import E2ETransformer
    from blocktrain.model.flops import forward_flops_per_token
    from blocktrain.objectives import build_block

    assert tiny().diffusion.steps_per_block == 1 and tiny().diffusion.solver.value == "euler"  # one denoiser per block
    for objective in (Objective.STACK, Objective.DIFFUSION):
        cfg = replace(tiny(), objective=objective)
        m = cfg.model
        blocks = [build_block(cfg, k) for k in range(m.n_blocks)]
        e2e = E2EModel(E2ETransformer(m), cfg).traversal_flops_per_byte()
        assert e2e == forward_flops_per_token(E2ETransformer(m), m.d_model, m.context)
        got = AssembledModel(blocks, cfg).traversal_flops_per_byte()
        if objective is Objective.STACK:
            assert got == e2e
        else:  # each solver step's denoiser softmax(logits) @ E too (E is a buffer: the module count missed it)
            per_block = forward_flops_per_token(blocks[0], m.d_model, m.context)
            with FlopCounterMode(display=False) as counted:
                blocks[0].denoised(torch.zeros(1, 10, 256))  # type: ignore[operator]
            denoiser = counted.get_total_flops() / 10  # per byte: 2 x 256 x d
            assert denoiser == 2 * 256 * m.d_model
            assert got == per_block * evaluations_per_traversal(cfg.diffusion, m.n_blocks) + denoiser * m.n_blocks


@pytest.mark.parametrize(("n", "context", "batch"), [(100, 8, 3), (9, 8, 1), (257, 16, 32)])
def test_on_bytes_receives_every_target_once_in_the_text_s_order(n: int, context: int, batch: int) -> None:
    """score_split hands on_bytes each scored byte's log-prob, selected by places computed once on the host (a boolean
    mask's selection waited for the device every batch): with log p(v) = v, what it hands over is the text itself."""
    data = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)

    def logp_is_the_byte(x: torch.Tensor) -> torch.Tensor:  # (b, t) -> (1, b, t, 256): log p(v) = v
        return torch.arange(256, dtype=torch.float32).expand(1, *x.shape, 256)

    got: list[torch.Tensor] = []
    score_split(logp_is_the_byte, data, context, batch_size=batch, on_bytes=got.append)
    assert torch.equal(torch.cat(got), torch.from_numpy(data[1:].astype(np.float32)))


def test_a_ctrl_c_just_after_a_step_saves_it_under_that_step() -> None:
    """The loop counted a step only after the optimiser had also zeroed its gradients and the timer stopped: a
    Ctrl-C there saved step s + 1's weights labelled as s steps done, and a resume applied step s + 1 again."""
    from blocktrain.train.loop import Hook, train_steps

    model = torch.nn.Linear(4, 1)

    class InterruptedOnce(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            InterruptedOnce.calls += 1
            if InterruptedOnce.calls == 2:  # right after the second step
                raise KeyboardInterrupt
            super().zero_grad(set_to_none=set_to_none)

    saved: list[int] = []

    class Saves(Hook):
        def interrupted(self, done: int) -> None:
            saved.append(done)

    x = torch.randn(8, 4)
    with pytest.raises(KeyboardInterrupt):
        train_steps(model, InterruptedOnce(model.parameters(), lr=0.1), lambda s: (model(x).pow(2).mean(), {}),
                    range(5), lr=lambda s: 0.1, grad_clip=1.0, hooks=[Saves()])
    assert saved == [2]


def test_train_block_starts_from_the_coordinator_s_version_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's version 0 claims train-block's init; train-block seeded, then warmed its runtime up (layers
    built and dropped) before it built the block: other weights. A local run and a distributed one now start alike."""
    import blocktrain.train.block as block_mod
    from blocktrain.protocol.weights import trainable_state
    from tests.distributed_utils import make_coordinator

    data = write_data_dir(tmp_path / "data")
    started: dict[str, torch.Tensor] = {}

    def first_state(**kw: object) -> None:
        started.update(trainable_state(kw["module"]))  # type: ignore[arg-type]
        raise KeyboardInterrupt  # nothing to train: the weights it starts from are the point

    monkeypatch.setattr(block_mod, "run_training", first_state)
    with pytest.raises(KeyboardInterrupt):
        train_block(tiny(), open_data_dir(data), tmp_path / "run", 0, progress=False)
    c = make_coordinator(tmp_path / "coord", open_data_dir(data), eval_every=0)
    try:
        version0 = c.weights[0]
        assert started.keys() == version0.keys()
        assert all(torch.equal(started[n], version0[n]) for n in started)
    finally:
        c.close()


def test_a_run_takes_the_callers_stack_recipe_whatever_its_train_section(tmp_path: Path) -> None:
    """A stack's init, step split and later blocks' lr are how its blocks train, not what they are: RunDir.init kept
    the recorded ones when the train section was unchanged (``--step-ratio 2`` was dropped) and took the caller's when
    it changed. The caller's recipe is the one trained now, either way; the architecture must still agree."""
    from blocktrain.config import Objective
    from blocktrain.presets import cpu_small

    cfg = replace(cpu_small(), objective=Objective.STACK)
    run = RunDir(tmp_path / "run")
    run.init(cfg)
    again = replace(cfg, stack=replace(cfg.stack, step_ratio=2.0))
    assert run.init(again).stack.step_ratio == 2.0
    assert run.init(again.with_train(steps=cfg.train.steps + 1)).stack.step_ratio == 2.0
    with pytest.raises(ConfigError, match="another model"):
        run.init(replace(cfg, model=replace(cfg.model, d_model=cfg.model.d_model * 2)))


def test_generate_refuses_log_probs_that_are_not_finite() -> None:
    """torch.multinomial refused NaN probabilities; the sampler that reads nothing back draws byte 0 from them. A
    diverged model's text is refused once, after the last byte (one read, not one per byte)."""
    from blocktrain.errors import RunError

    class Diverged:
        context, device = 16, torch.device("cpu")

        def log_probs(self, x: torch.Tensor, chains: int = 1, seed: int = 0) -> torch.Tensor:
            out = torch.log_softmax(torch.zeros(1, 1, x.shape[1], 256), -1)
            return out if x.shape[1] < 6 else torch.full_like(out, float("nan"))  # NaN from the third byte on

    with pytest.raises(RunError, match="not finite"):
        generate(Diverged(), b"The ", 4, seed=0)  # type: ignore[arg-type]
    assert len(generate(Diverged(), b"The ", 2, seed=0)) == 2  # type: ignore[arg-type]


def test_a_value_that_is_not_finite_where_nothing_is_scored_stays_out_of_the_score() -> None:
    """The scored positions were selected by multiplying by a 0/1 mask: a -inf or NaN at a position not scored (the
    padded tail, a later window's first half; a bf16 overflow there) made 0 x inf = NaN, and the batch's CE NaN."""
    data = np.frombuffer(bytes(range(50)) * 3, dtype=np.uint8)  # 150 bytes: the last window is padded

    def uniform(x: torch.Tensor) -> torch.Tensor:
        return torch.full((1, *x.shape, 256), -math.log(256.0))

    def poisoned(x: torch.Tensor) -> torch.Tensor:
        lp = uniform(x)
        lp[0, :, :4] = float("nan")  # the first positions of every window: scored only in window 0
        lp[0, 0, :4] = -math.log(256.0)
        return lp

    want = score_split(uniform, data, 16, batch_size=4).ce_nats_per_byte
    got = score_split(poisoned, data, 16, batch_size=4).ce_nats_per_byte
    assert want == pytest.approx(math.log(256.0)) and got == pytest.approx(want)


def test_a_run_killed_between_checkpoints_logs_each_step_once(tmp_path: Path) -> None:
    """A trainer killed hard at step 6 (no Ctrl-C save) resumes from its step-4 checkpoint and logs steps 5 and 6
    again: the metrics file held [1, 2, 3, 4, 5, 5, 6, 7, 8] (a review's repro). The records past the checkpoint are
    dropped on resume, so each step is logged once."""
    from torch import nn

    from blocktrain.presets import get_preset
    from blocktrain.train.metrics import read_jsonl
    from blocktrain.train.run import run_training

    class Killed(BaseException):
        """A hard kill: nothing the trainer catches."""

    cfg = get_preset("tiny").with_train(steps=8, checkpoint_every=4, log_every=1, eval_bytes=0, eval_every=0,
                                        profile_steps=0)
    torch.manual_seed(0)
    module = nn.Linear(4, 4)

    def train(kill_at: int | None) -> None:
        def step_fn(step: int) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
            if step == kill_at:
                raise Killed
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            return (module(x) ** 2).mean(), {}

        run_training(name="toy", module=module, cfg=cfg, step_fn=step_fn, ckpt_path=tmp_path / "toy.safetensors",
                     state_path=tmp_path / "toy.state.safetensors", metrics_path=tmp_path / "toy.jsonl",
                     baseline_rss=0, save_meta={"kind": "toy"}, valid=None, evaluate=("x", lambda x, g: x),
                     progress=False)

    with pytest.raises(Killed):
        train(kill_at=5)  # the sixth step (0-based 5) begins: steps 1-5 are logged, the checkpoint holds 4
    train(kill_at=None)
    steps = [r["step"] for r in read_jsonl(tmp_path / "toy.jsonl") if "loss" in r]
    assert steps == list(range(1, 9)), steps


def test_the_e2e_starts_from_its_seeds_weights_whatever_warms_the_runtime_first(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train_e2e seeded the global generator, then warmed the runtime with a throwaway module drawn from it, so its
    E2E started from other weights than its seed's (benchmarks/quality/e2e_recipe.py seeds and builds at once);
    train_block warms up first. Now train_e2e does too (helper-60)."""
    import blocktrain.train.e2e as E
    from blocktrain.model.e2e import E2ETransformer
    from blocktrain.seeds import E2E_INIT, init_seed

    cfg = tiny().with_train(steps=1, eval_bytes=0)
    got: dict[str, torch.Tensor] = {}

    def first_weights(*, module: torch.nn.Module, **kwargs: object) -> None:
        got.update({n: t.detach().clone() for n, t in module.state_dict().items()})

    monkeypatch.setattr(E, "run_training", first_weights)
    train_e2e(cfg, open_data_dir(data_dir), tmp_path / "run", progress=False)
    torch.manual_seed(init_seed(cfg.train.seed, E2E_INIT))
    want = E2ETransformer(cfg.model).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that died hard after its step-0 save resumed at 0 and kept the metrics of the steps it had run, so it
    logged them twice: drop_after ran only past step 0 (helper-61)."""
    import blocktrain.train.loop as loop
    from blocktrain.train.metrics import read_jsonl

    dd = open_data_dir(data_dir)
    cfg = tiny().with_train(steps=6, checkpoint_every=100, log_every=1, eval_bytes=0)
    real_write = loop.JsonlWriter.write

    def dying_write(self: object, **record: object) -> None:
        real_write(self, **record)  # type: ignore[arg-type]
        if record.get("step") == 3 and "loss" in record:
            raise RuntimeError("the process died")  # not an interrupt: no checkpoint on the way out

    monkeypatch.setattr(loop.JsonlWriter, "write", dying_write)
    with pytest.raises(RuntimeError, match="died"):
        train_block(cfg, dd, tmp_path / "run", 0, progress=False)
    monkeypatch.setattr(loop.JsonlWriter, "write", real_write)
    train_block(cfg, dd, tmp_path / "run", 0, progress=False)
    steps = [r["step"] for r in read_jsonl(RunDir(tmp_path / "run").metrics_path("block_0")) if "loss" in r]
    assert steps == list(range(1, 7)), steps
