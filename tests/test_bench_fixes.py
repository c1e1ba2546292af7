"""bench quality's and bench serve's figures and refusals: the matched-FLOPs E2E says whom it matched, the block
worker's state is its largest block's, results name their objective's references, the serve bench refuses a run
it cannot serve before any stage starts, and its quality and compute helpers take the texts the bench gives them."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from blocktrain.bench.quality import QualityOptions, run_quality_bench
from blocktrain.bench.quality_report import derive_figures, format_table, rederive
from blocktrain.bench.serve import run_serve_bench
from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.bench.serve_pipeline import Pipeline
from blocktrain.bench.serve_quality import generative_ce, traversal_compute_s
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import Objective
from blocktrain.data.dataset import open_data_dir
from blocktrain.errors import BlockTrainError, ConfigError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.report import evaluate_model, format_eval
from blocktrain.model.e2e import E2ETransformer
from blocktrain.objectives import get_objective
from blocktrain.presets import tiny
from blocktrain.sampling import EMPTY_PROMPT
from tests.conftest import write_data_dir
from tests.serve_utils import tiny_models

# --- bench quality ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quality(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny `bench quality --objective both` in this process, one step per arm (about 5 s)."""
    root = tmp_path_factory.mktemp("bench-fixes")
    data = open_data_dir(write_data_dir(root / "data"))
    cfg = tiny().with_train(steps=1, eval_bytes=0, checkpoint_every=1, log_every=1)
    opts = QualityOptions(cfg=cfg, data=data, out=root / "bench", objective="both", lr_sweep=False, progress=False,
                          isolate=False, max_eval_bytes=128)
    return run_quality_bench(opts)


def _cell(table: str, label: str, column: int) -> str:
    """The cell of row ``label`` in column ``column`` (0: the row label) of a markdown table."""
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} "))
    return row.strip("|").split("|")[column].strip()


def _column(table: str, name: str) -> int:
    header = table.splitlines()[0].strip("|").split("|")
    return next(i for i, c in enumerate(header) if c.strip().startswith(name))


def test_the_matched_flops_e2e_records_whom_it_matched_and_each_objectives_ratio(quality: dict[str, Any]) -> None:
    """One E2E at the primary's FLOPs: the other objective's gap to it is not at matched FLOPs, and says so."""
    matched = quality["e2e_matched_flops"]
    assert matched["matched_to"] == quality["primary_objective"] == "stack"
    for sec in quality["objectives"].values():
        assert sec["matched_e2e_flops_ratio"] == pytest.approx(matched["train_flops"] / sec["train_flops"], rel=1e-12)
    stack, diffusion = quality["objectives"]["stack"], quality["objectives"]["diffusion"]
    assert abs(stack["matched_e2e_flops_ratio"] - 1) <= 0.05 < diffusion["matched_e2e_flops_ratio"] - 1  # tiny: 1.26x
    table = format_table(quality)
    gap = "gap to E2E, matched FLOPs"
    assert _cell(table, gap, _column(table, "diffusion")) == (
        f"{diffusion['gap_matched_flops_nats_per_byte']:+.4f} (E2E at {diffusion['matched_e2e_flops_ratio']:.2f}x its FLOPs)")
    assert _cell(table, gap, _column(table, "stack")) == f"{stack['gap_matched_flops_nats_per_byte']:+.4f}"
    assert "trained for the stack arm's training FLOPs" in table


def test_a_result_from_before_the_ratio_still_formats_and_says_so(quality: dict[str, Any]) -> None:
    """--rederive of a file without matched_to, the ratios or the reference names: derived from its FLOPs and keys."""
    old = copy.deepcopy(quality)
    del old["e2e_matched_flops"]["matched_to"]
    for sec in old["objectives"].values():
        for key in ("matched_e2e_flops_ratio", "reference_name", "reference_label", "compositional_gain_nats_per_byte"):
            del sec[key]
    new = rederive(old)
    for name, sec in new["objectives"].items():
        want = quality["objectives"][name]
        assert sec["matched_e2e_flops_ratio"] == pytest.approx(want["matched_e2e_flops_ratio"], rel=1e-12)
        assert sec["compositional_gain_nats_per_byte"] == want["compositional_gain_nats_per_byte"]
    table = format_table(new)
    assert "x its FLOPs)" in _cell(table, "gap to E2E, matched FLOPs", _column(table, "diffusion"))
    assert f"trained for the {new['primary_objective']} arm's training FLOPs" in table  # always the primary's


def test_the_only_e2e_at_matched_flops_says_whose_flops_it_matched(quality: dict[str, Any]) -> None:
    """--no-matched-steps: the one E2E column is the matched-FLOPs run; its gap row marks the other objective."""
    r = copy.deepcopy(quality)
    r["e2e_is_matched_flops"] = True
    r["e2e"]["ce_nats_per_byte"] = r["e2e_matched_flops"]["ce_nats_per_byte"]
    table = format_table(derive_figures(r))
    diffusion = r["objectives"]["diffusion"]
    assert _cell(table, "gap to E2E, matched FLOPs", _column(table, "diffusion")) == (
        f"{diffusion['gap_nats_per_byte']:+.4f} (E2E at {diffusion['matched_e2e_flops_ratio']:.2f}x its FLOPs)")
    assert "x its FLOPs" not in _cell(table, "gap to E2E, matched FLOPs", _column(table, "stack"))


def test_the_block_worker_state_is_that_of_the_largest_block(quality: dict[str, Any]) -> None:
    """A stack's block 0 embeds the bytes: it, not the last block, is the largest a worker trains."""
    for name, sec in quality["objectives"].items():
        obj = get_objective(replace(tiny(), objective=Objective(name)))
        params = [sum(p.numel() for p in obj.build_block(k).parameters() if p.requires_grad) for k in range(4)]
        assert sec["block_worker"]["analytic"]["params"] == max(params), name
    stack = quality["objectives"]["stack"]["block_worker"]["analytic"]
    assert quality["block_worker"]["analytic"] == stack and stack["total_state_bytes"] == 16 * stack["params"]


def test_each_section_names_its_objectives_references(quality: dict[str, Any]) -> None:
    for name, sec in quality["objectives"].items():
        obj = get_objective(replace(tiny(), objective=Objective(name)))
        assert (sec["reference_name"], sec["reference_label"]) == (obj.reference_name, obj.reference_label)
        assert quality[obj.reference_name] == sec[obj.reference_name]  # the top level keeps each objective's references


def _toy_result(quality: dict[str, Any]) -> dict[str, Any]:
    """The bench's result with a third objective's section, its references under a key no built-in uses."""
    r = copy.deepcopy(quality)
    toy = copy.deepcopy(r["objectives"]["diffusion"])
    toy["member_ce"] = toy.pop("blocks_alone_ce")
    toy.update(reference_name="member_ce", reference_label="members alone", gain_reference="best")
    r["objectives"] = {"toy": toy}
    r["primary_objective"] = "toy"
    r["lr_sweep"] = {"factors": [1.0], "e2e_val_ce": {"0.003": 2.0}, "e2e_lr": 0.003,
                     "toy_block0_val_member_ce": {"0.003": 2.5}, "toy_lr": 0.003}
    return r


def test_the_report_reads_a_third_objectives_references_through_its_name(quality: dict[str, Any]) -> None:
    r = derive_figures(_toy_result(quality))
    toy = r["objectives"]["toy"]
    assert toy["compositional_gain_nats_per_byte"] == pytest.approx(min(toy["member_ce"]) - toy["ce_nats_per_byte"])
    table = format_table(r)
    assert _cell(table, "single-block references", _column(table, "toy")).startswith("members alone ")
    assert "toy block 0 {'0.003': 2.5} -> lr 0.003" in table  # its block-0 lr sweep, read under its reference name


def test_format_eval_prints_the_references_the_result_names() -> None:
    r = {"model": "blocktrain", "split": "test", "bytes_scored": 10, "ce_nats_per_byte": 2.0, "bits_per_byte": 2.9,
         "perplexity": 7.4, "member_ce": [2.1, 2.2], "compositional_gain_nats_per_byte": 0.1,
         "reference_name": "member_ce", "reference_label": "members alone", "gain_reference": "best"}
    lines = format_eval(r).splitlines()
    assert "members alone 2.1000, 2.2000" in lines
    assert lines[-1] == "gain        +0.1000 nats/byte over the best single-block reference (members alone)"
    old = {k: v for k, v in r.items() if not k.startswith(("reference_", "gain_reference", "member"))}
    assert "prefixes    2.1000" in format_eval({**old, "prefix_ce": [2.1]})  # a result without the name: its old label


def test_evaluate_model_names_the_objectives_references(tmp_path: Path) -> None:
    cfg, blocks, _ = tiny_models()
    split = open_data_dir(write_data_dir(tmp_path / "data")).open("test")
    out = evaluate_model(AssembledModel(blocks, cfg), split, max_bytes=64, blocks_alone=True)
    obj = get_objective(cfg)
    assert (out["reference_name"], out["reference_label"], out["gain_reference"]) == (
        obj.reference_name, obj.reference_label, obj.gain_reference)
    assert any(line.startswith(obj.reference_label) for line in format_eval(out).splitlines())


# --- bench serve --------------------------------------------------------------------------------------------


@pytest.fixture
def no_stages(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A stage that starts fails the test: every refusal here must come before the first."""

    def start(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a stage started before the run was refused")

    monkeypatch.setattr(Pipeline, "start", start)
    yield


def _run(root: Path, objective: Objective) -> Path:
    """A run directory with its run.json only (no block, no E2E)."""
    RunDir(root).init(replace(tiny(), objective=objective))
    return root


@pytest.mark.usefixtures("no_stages")
def test_an_output_longer_than_the_sweep_window_is_refused_before_any_stage(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", Objective.DIFFUSION)  # context 32
    with pytest.raises(ConfigError, match=r"--output-bytes 31 or less"):
        run_serve_bench(ServeBenchOptions(run=run, output_bytes=32))


@pytest.mark.usefixtures("no_stages")
def test_a_run_that_cannot_serve_sweep_is_refused_before_any_stage(tmp_path: Path) -> None:
    assert get_objective(replace(tiny(), objective=Objective.DIFFUSION)).serves_sweep
    assert not get_objective(replace(tiny(), objective=Objective.STACK)).serves_sweep
    run = _run(tmp_path / "stack", Objective.STACK)
    with pytest.raises(ConfigError, match=r"do not serve the sweep mode") as err:
        run_serve_bench(ServeBenchOptions(run=run, output_bytes=16))
    assert f"--stack-run {run}" in str(err.value) and "--objective diffusion" in str(err.value)
    assert "--out RUN" in str(err.value)  # a diffusion run cannot go on in a stack run's directory


@pytest.mark.usefixtures("no_stages")
def test_a_run_without_its_e2e_says_which_commands_make_the_run_bench_serve_needs(tmp_path: Path) -> None:
    """bench quality writes each arm to its own directory: the message names the commands that make one directory."""
    run = _run(tmp_path / "diffusion", Objective.DIFFUSION)
    with pytest.raises(BlockTrainError, match=r"needs all 4 blocks and the E2E reference") as err:
        run_serve_bench(ServeBenchOptions(run=run, output_bytes=16))
    text = str(err.value)
    assert f"'blocktrain train --preset tiny --objective diffusion --data DATA --out {run}'" in text
    assert "'blocktrain train-e2e' with the same flags" in text and "train them with 'blocktrain bench quality'" not in text
    with pytest.raises(BlockTrainError, match=r"no run.json.*blocktrain train --preset PRESET --objective diffusion"):
        run_serve_bench(ServeBenchOptions(run=tmp_path / "missing", output_bytes=16))


def test_the_traversal_timed_is_at_most_one_context_window() -> None:
    """bench serve times a traversal of prompt + output bytes; longer than the context, it is one window."""
    cfg, blocks, _ = tiny_models()
    assert math.isfinite(traversal_compute_s(cfg, AssembledModel(blocks, cfg), 12 + 24, repeat=1))  # context 32


def test_an_empty_prompt_is_scored_as_generation_continues_it() -> None:
    """Generation continues an empty prompt after EMPTY_PROMPT: every output byte is scored after it, once."""
    cfg = tiny()
    torch.manual_seed(0)
    model = E2EModel(E2ETransformer(cfg.model), cfg)
    for out in (b"world", bytes(range(65, 65 + 26)) * 4):  # one window; several (context 32)
        assert generative_ce(model, b"", out) == pytest.approx(generative_ce(model, EMPTY_PROMPT, out), rel=1e-6)
    with torch.no_grad():
        seq = EMPTY_PROMPT + b"world"
        logp = torch.log_softmax(model.model(torch.tensor([list(seq[:-1])])), -1)[0]
    manual = -sum(float(logp[i, seq[i + 1]]) for i in range(5)) / 5
    assert generative_ce(model, b"", b"world") == pytest.approx(manual, rel=1e-5)
