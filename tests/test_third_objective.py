"""A third objective, added in this file alone: the seam is whole if the library trains, resumes, composes,
scores and averages it with no change outside ``objectives/`` (issue 20's target).

The toy: every block is a bigram table (next-byte logits from the current byte) trained alone on the
next byte; the composed model averages the blocks' logits. It is registered under its own name and
reaches the library only through :func:`blocktrain.objectives.register_objective`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from blocktrain.checkpoint.blocks import load_block
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig, Schedule
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.simulate import LocalRounds, run_local_rounds
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import ConfigError
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.evaluate.report import evaluate_model
from blocktrain.model.loss import lm_loss
from blocktrain.objectives import LocalLoss, get_objective, register_objective, unregister_objective
from blocktrain.presets import tiny
from blocktrain.train.block import train_block
from blocktrain.train.schedule import schedule_of

NAME = "toy_bigram"


class BigramBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)  # row c: logits of the byte after c
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x.long())  # (b, t) -> (b, t, 256)


class BigramEnsemble:
    """Blocks trained alone on the next byte; composing averages their logits (carry: the running sum)."""

    name = NAME
    reference_name = "blocks_alone_ce"
    reference_label = "bigrams alone"
    deterministic = True
    trains_in_order = False
    blocks_alike = True
    gain_reference = "best"
    composed_is_last_reference = False
    prefix_drafts = False
    serves_sweep = False
    serving_span = ""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def build_block(self, k: int) -> nn.Module:
        return BigramBlock()

    def block_steps(self, k: int) -> int:
        return self.cfg.train.steps

    def block_lr(self, k: int) -> float:
        return self.cfg.train.lr

    def frozen_inputs(self, k: int) -> int:
        return 0

    def inherit(self, block: nn.Module, k: int, earlier: Sequence[nn.Module], *, at_init: bool) -> None:
        """Bigram blocks take nothing from one another."""

    def inherits(self) -> bool:
        return False

    def serving_blocker(self) -> str | None:
        return "the toy bigram objective has no serving span; score it with 'blocktrain eval'"

    def outer_step(self) -> str:
        return "average"

    def freeze(self, block: nn.Module, dtype: torch.dtype) -> nn.Module:
        raise ValueError("bigram blocks train alone")

    def block_loss(self, block: nn.Module, k: int, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator,
                   frozen: Sequence[nn.Module] = ()) -> LocalLoss:
        return LocalLoss(lm_loss(block(x), y), {})

    def local_logits(self, block: nn.Module, k: int, x: torch.Tensor, generator: torch.Generator,
                     frozen: Sequence[nn.Module] = ()) -> torch.Tensor:
        return block(x)  # type: ignore[no-any-return]

    def initial_carry(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        return None

    def step(self, block: nn.Module, k: int, x: torch.Tensor, carry: torch.Tensor | None, *, want_logits: bool,
             is_last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = block(x).float() + (0.0 if carry is None else carry)
        return total, total / (k + 1) if want_logits else None

    def reference_logits(self, blocks: Sequence[nn.Module], x: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        return [b(x) for b in blocks]

    def single_block_logits(self, blocks: Sequence[nn.Module], x: torch.Tensor, seed: int = 0,
                            only: int | None = None) -> list[torch.Tensor]:
        return [blocks[k](x) for k in (range(len(blocks)) if only is None else [only])]

    def schedule(self) -> Schedule:
        return Schedule.PROGRESSIVE

    def checkpoint_meta(self, k: int) -> dict[str, str]:
        return {"objective": self.name}

    def optional_meta(self) -> tuple[str, ...]:
        return ()

    def check_composable(self, blocks: Sequence[nn.Module]) -> None:
        """Any trained bigram tables compose."""

    def traversal_flops_per_byte(self, blocks: Sequence[nn.Module]) -> float:
        return 256.0 * len(blocks)  # one add of a logits row per block

    def train_flops_per_token(self, k: int) -> float:
        return 6.0 * 256


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    """The toy is known while this file's tests run, and forgotten after them (other tests see the built-ins)."""
    register_objective(NAME, BigramEnsemble)
    yield
    unregister_objective(NAME)


@pytest.fixture
def cfg() -> RunConfig:
    return replace(tiny().with_train(steps=40, eval_bytes=0, lr=0.05, warmup_steps=2), objective=NAME)


def test_the_config_round_trips_a_registered_name(cfg: RunConfig) -> None:
    assert RunConfig.from_json(cfg.to_json()) == cfg and schedule_of(cfg) is Schedule.PROGRESSIVE
    assert isinstance(get_objective(cfg), BigramEnsemble)
    with pytest.raises(ConfigError, match=r"known objective .*'nonesuch'.*register_objective"):
        replace(cfg, objective="nonesuch")
    with pytest.raises(ConfigError, match="registered already"):
        register_objective(NAME, lambda c: BigramEnsemble(c))
    with pytest.raises(ConfigError, match="built-in"):
        unregister_objective("stack")


def test_an_unregistered_objective_is_unknown_again() -> None:
    register_objective("toy_once", BigramEnsemble)
    unregister_objective("toy_once")
    with pytest.raises(ConfigError, match="known objective"):
        replace(tiny(), objective="toy_once")
    with pytest.raises(ConfigError, match="no plug-in"):
        unregister_objective("toy_once")


def test_an_objective_written_for_an_earlier_release_is_refused_by_name(cfg: RunConfig) -> None:
    """A plug-in that lacks a member the seam has since gained is refused where the run asks for it, naming what
    to add, not with an AttributeError deep in whatever first reads it."""
    older = type("OlderBigram", (), {k: v for k, v in vars(BigramEnsemble).items() if k != "prefix_drafts"})
    register_objective("toy_older", older)
    try:
        with pytest.raises(ConfigError, match=r"'toy_older' lacks prefix_drafts, .*add them"):
            get_objective(replace(cfg, objective="toy_older"))
    finally:
        unregister_objective("toy_older")


def test_trains_resumes_composes_and_scores(cfg: RunConfig, data_dir: Path, tmp_path: Path) -> None:
    dd = open_data_dir(data_dir)
    run = tmp_path / "run"
    for k in range(cfg.model.n_blocks):
        summary = train_block(cfg, dd, run, k, progress=False)
        assert summary.steps == 40 and summary.final_loss < 5.0  # uniform is ln 256 = 5.55
    trained = load_block(RunDir(run), cfg, 0).state_dict()
    again = train_block(cfg, dd, run, 0, progress=False)  # resumed at its last step: nothing left to train
    after = load_block(RunDir(run), cfg, 0).state_dict()
    assert again.steps == 40 and all(torch.equal(trained[n], after[n]) for n in trained)
    model = AssembledModel.load(RunDir(run))
    result = evaluate_model(model, dd.open("test"), blocks_alone=True)
    refs = result["blocks_alone_ce"]
    assert result["objective"] == NAME and len(refs) == cfg.model.n_blocks
    assert result["ce_nats_per_byte"] < 5.0
    assert result["compositional_gain_nats_per_byte"] == pytest.approx(min(refs) - result["ce_nats_per_byte"])
    # the composed model is the mean of the blocks' logits, exactly
    x = torch.from_numpy(dd.open("test").data[:64].copy()).long().unsqueeze(0)
    mean = torch.stack([load_block(RunDir(run), cfg, k)(x) for k in range(cfg.model.n_blocks)]).mean(0)
    assert torch.allclose(model.log_probs(x)[0], torch.log_softmax(mean, -1), atol=1e-5)


def test_no_future_byte_moves_a_past_log_prob(cfg: RunConfig) -> None:
    model = AssembledModel([BigramBlock() for _ in range(cfg.model.n_blocks)], cfg)
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    base = model.log_probs(x)
    for t in range(32):
        changed = x.clone()
        changed[0, t:] = (changed[0, t:] + 1) % 256
        assert torch.equal(model.log_probs(changed)[..., :t, :], base[..., :t, :]), t


def test_averages_like_any_objective(cfg: RunConfig, data_dir: Path) -> None:
    """The coordinator's rounds (validation, aggregation, the outer step) on two replicas of a bigram block."""
    run = run_local_rounds(cfg, CoordinatorSettings(rounds=2, norm_k=0.0), LocalRounds(workers=2, local_steps=5, steps=10),
                           open_data_dir(data_dir))
    assert len(run.updates) == 4 and all(u.outcome == "accepted" for u in run.updates)
    assert run.test_ce(cfg, open_data_dir(data_dir), max_bytes=4096) < math.log(256) - 0.3  # untrained: ln 256


def test_validation_is_logged_under_the_objectives_reference_name(
    cfg: RunConfig, data_dir: Path, tmp_path: Path,
) -> None:
    """bench quality's block-0 lr sweep reads ``val_<reference_name>``; a plug-in's key must be that, or every lr
    scores NaN and the sweep picks its first lr."""
    from blocktrain.train.metrics import read_jsonl

    run = tmp_path / "run"
    train_block(replace(cfg, train=replace(cfg.train, steps=4, eval_bytes=2048)), open_data_dir(data_dir), run, 0,
                progress=False)
    vals = [r["val_blocks_alone_ce"] for r in read_jsonl(RunDir(run).metrics_path("block_0")) if "val_blocks_alone_ce" in r]
    assert vals and all(math.isfinite(v) for v in vals)


def test_bench_serve_refuses_its_runs_through_the_sweep_flag_before_any_stage(
    cfg: RunConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serves_sweep`` False: bench serve, which times sweep, refuses the run by that flag, not by a name it knows."""
    from blocktrain.bench.serve import run_serve_bench
    from blocktrain.bench.serve_options import ServeBenchOptions
    from blocktrain.bench.serve_pipeline import Pipeline

    def start(*args: object, **kwargs: object) -> None:
        raise AssertionError("a stage started before the run was refused")

    monkeypatch.setattr(Pipeline, "start", start)
    RunDir(tmp_path / "run").init(cfg)
    with pytest.raises(ConfigError, match=f"is a {NAME} run, whose stages do not serve the sweep mode"):
        run_serve_bench(ServeBenchOptions(run=tmp_path / "run", output_bytes=16))
