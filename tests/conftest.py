"""Shared fixtures: a small synthetic WikiText-like data directory and tiny configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from blocktrain.config import RunConfig
from blocktrain.presets import tiny

torch.set_num_threads(int(os.environ.get("BLOCKTRAIN_TEST_THREADS", "1")))

_TEXT = (
    " = Valkyria Chronicles III = \n \n Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ "
    "playing video game developed by Sega and Media.Vision for the PlayStation Portable . Released in January "
    "2011 in Japan , it is the third game in the Valkyria series . The game began development in 2010 , carrying "
    "over a large portion of the work done on Valkyria Chronicles II . \n"
)


def write_data_dir(root: Path, n_repeat: int = 40, flavour: str = "tokens") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, split in enumerate(("train", "valid", "test")):
        text = "".join(_TEXT.replace("2011", str(2000 + (j + i) % 30)) for j in range(n_repeat if split == "train" else 6))
        (root / f"wiki.{split}.{flavour}").write_bytes(text.encode())
    return root


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return write_data_dir(tmp_path / "data")


@pytest.fixture
def tiny_cfg() -> RunConfig:
    return tiny()
