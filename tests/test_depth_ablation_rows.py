"""The depth ablation harness (benchmarks/quality/depth_ablation.py): every row is a valid run config that names each lever."""

from __future__ import annotations

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
