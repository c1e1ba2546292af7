from __future__ import annotations

import math
from typing import Any

import pytest

from blocktrain.config import DiffusionConfig, ModelConfig, Readout, RunConfig, Slicing, TrainConfig
from blocktrain.errors import ConfigError
from blocktrain.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_json(name: str) -> None:
    cfg = get_preset(name)
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg
    assert cfg.model.n_layers % cfg.model.n_blocks == 0


def test_unknown_preset_names_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'.*tiny"):
        get_preset("huge")


def test_blocks_must_divide_layers() -> None:
    with pytest.raises(ConfigError, match="does not divide"):
        ModelConfig(n_layers=8, n_blocks=3)


def test_sigma_min_below_sigma_max() -> None:
    with pytest.raises(ConfigError, match="sigma_min"):
        DiffusionConfig(sigma_min=10.0, sigma_max=10.0)
    with pytest.raises(ConfigError, match="sigma_min"):
        DiffusionConfig(sigma_min=-1.0)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (TrainConfig, {"steps": -1}),
        (TrainConfig, {"lr": 0.0}),
        (TrainConfig, {"batch_size": 0}),
        (DiffusionConfig, {"overlap": 1.0}),
        (DiffusionConfig, {"steps_per_block": 0}),
        (DiffusionConfig, {"readout": "last_step"}),
        (ModelConfig, {"d_model": 30, "n_heads": 4}),
    ],
)
def test_bad_values_rejected(cls: type, kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        cls(**kwargs)


def test_enums_serialise_by_value() -> None:
    cfg = get_preset("tiny")
    d = cfg.to_dict()
    assert d["diffusion"]["slicing"] == "equal_prob"
    assert RunConfig.from_dict(d).diffusion.readout is Readout.LAST_STEP
    assert RunConfig.from_dict(d).diffusion.slicing is Slicing.EQUAL_PROB


def test_unknown_config_field_rejected() -> None:
    d = get_preset("tiny").to_dict()
    d["model"]["depth"] = 3
    with pytest.raises(ConfigError, match="unknown fields"):
        RunConfig.from_dict(d)


@pytest.mark.parametrize("bad", [
    lambda: TrainConfig(lr=math.inf), lambda: TrainConfig(weight_decay=math.inf), lambda: TrainConfig(grad_clip=math.inf),
    lambda: DiffusionConfig(sigma_max=math.inf), lambda: DiffusionConfig(sigma_data=math.inf),
    lambda: DiffusionConfig(p_std=math.inf), lambda: TrainConfig(device=None),  # type: ignore[arg-type]
])
def test_infinite_floats_and_a_device_that_is_no_string_are_config_errors(bad: Any) -> None:
    """inf passed the comparisons (NaN slice edges later); "device": null in a run.json was an AttributeError."""
    with pytest.raises(ConfigError):
        bad()
