"""The depth ablation harness (benchmarks/quality/depth_ablation.py): every row is a valid run config that names each lever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.quality import depth_ablation

from blocktrain.config import Schedule, StackDense, StackHead, StackInit
from blocktrain.presets import get_preset


@pytest.mark.parametrize("name", list(depth_ablation.ROWS))
def test_every_row_builds_its_config_whatever_the_presets_recipe(name: str) -> None:
    cfg = depth_ablation._config(["--preset", "depth-proxy", "--objective", "stack", *depth_ablation.row_flags(name)])
    own = dict(zip(depth_ablation.ROWS[name][1][::2], depth_ablation.ROWS[name][1][1::2], strict=True))
    assert cfg.stack.init is StackInit(own.get("--init", "fresh"))  # the preset's copy recipe never leaks into a row
    assert cfg.stack.head is StackHead(own.get("--head", "private"))
    assert cfg.stack.dense is StackDense(own.get("--dense", "off"))
    assert cfg.stack.aux_layers == int(own.get("--aux-layers", "0"))
    assert cfg.stack.step_ratio == float(own.get("--step-ratio", "1.0"))
    assert cfg.train.schedule is Schedule(own.get("--schedule", "progressive"))


def test_the_stack_presets_carry_the_ablations_winner() -> None:
    for name in ("cpu-mini", "cpu-small", "cpu-small-long", "depth-proxy", "paper"):
        assert get_preset(name).stack.init is StackInit.COPY and get_preset(name).stack.step_ratio == 0.7
    assert get_preset("tiny").stack.init is StackInit.FRESH  # the test suite's preset keeps the dataclass default


def test_e2e_references_are_found_again_only_under_their_own_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The E2E references were cached by step count alone: rows run with ``--extra --lr 4e-3`` reused the reference
    trained at the preset's lr, and the lr sweep's folders (``e2e-sweep-...``) crashed the lookup. A reference is now
    found only under the flags, data and scored bytes it was made with."""
    base = depth_ablation.E2ECache(tmp_path, ["--preset", "p"], "data", 100, 0.1)
    other = depth_ablation.E2ECache(tmp_path, ["--preset", "p", "--lr", "4e-3"], "data", 100, 0.1)
    assert base.key != other.key != depth_ablation.E2ECache(tmp_path, ["--preset", "p"], "data", 200, 0.1).key
    (tmp_path / "e2e-sweep-1000-lr0.002").mkdir()  # the sweep's runs are no references
    ref = tmp_path / f"e2e-ref-{base.key}-1000"
    ref.mkdir()
    (ref / "eval.json").write_text(json.dumps({"ce_nats_per_byte": 1.5}))
    assert base.get(1050) == (1000, {"ce_nats_per_byte": 1.5})  # within the share: found again
    trained: list[list[str]] = []

    def train(cmd: list[str]) -> str:
        trained.append(cmd)
        return ""

    monkeypatch.setattr(depth_ablation, "_run", train)
    monkeypatch.setattr(depth_ablation, "_summaries",
                        lambda run, name: {"train_mem_bytes": 1, "flops_per_step": 2.0, "steps": 1000})
    monkeypatch.setattr(depth_ablation, "_eval", lambda *a, **k: {"ce_nats_per_byte": 1.6})
    assert other.get(1000)[0] == 1000
    ev = json.loads((tmp_path / f"e2e-ref-{other.key}-1000" / "eval.json").read_text())
    assert len(trained) == 1 and trained[0][trained[0].index("--lr") + 1] == "4e-3"
    assert ev["ce_nats_per_byte"] == 1.6 and ev["steps"] == 1000  # written whole, with its training figures


def test_a_row_measured_again_under_another_recipe_trains_in_a_folder_of_its_own() -> None:
    """Row folders were named by the row alone: ``--rows baseline --extra --lr 0.004`` after ``--rows baseline`` went on
    from the stack the default lr had finished (``blocktrain train`` returns a finished block's summary), while its
    E2E reference, keyed by its flags, trained at 0.004: the row's gap mixed two recipes (helper-69)."""
    common = ["--preset", "depth-proxy", "--data", "d", "--no-progress"]
    base = depth_ablation.run_dir("runs", "baseline", [*common, *depth_ablation.row_flags("baseline")])
    again = depth_ablation.run_dir("runs", "baseline", [*common, "--lr", "0.004", *depth_ablation.row_flags("baseline")])
    assert base != again and base.name.startswith("baseline-") and base.parent.name == "runs"
    assert base == depth_ablation.run_dir("runs", "baseline", [*common, *depth_ablation.row_flags("baseline")])
