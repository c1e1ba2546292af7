"""Block checkpoints of a run: their metadata, and loading them for composition or as frozen inputs."""

from __future__ import annotations

from torch import nn

from blocktrain.checkpoint.run import RunDir, load_model
from blocktrain.config import RunConfig
from blocktrain.errors import ConfigError, RunError
from blocktrain.objectives import get_objective


def check_block_index(k: int, n_blocks: int) -> None:
    if not 0 <= k < n_blocks:
        raise ConfigError(f"block index {k} is out of range; this config has B={n_blocks} blocks (0..{n_blocks - 1})")


def block_save_meta(cfg: RunConfig, k: int) -> dict[str, str]:
    """Metadata every checkpoint of block k carries (and loading checks)."""
    return {"kind": "block", "block_index": str(k), **get_objective(cfg).checkpoint_meta(k)}


def load_block(run: RunDir, cfg: RunConfig, k: int, *, finished: bool = False) -> nn.Module:
    """Block k of ``run`` (fp32, CPU). ``finished``: it must have completed cfg.train.steps steps."""
    path = run.block_path(k)
    if not path.is_file():
        raise RunError(
            f"{run.root} has no checkpoint for block {k} ({path}); train it with "
            f"'blocktrain train-block --out {run.root} --block {k}' or 'blocktrain train --out {run.root}'"
        )
    block = get_objective(cfg).build_block(k)
    expect = {key: v for key, v in block_save_meta(cfg, k).items() if key != "kind"}
    for key in get_objective(cfg).optional_meta():  # checkpoints of earlier releases may lack these
        expect.pop(key)
    ckpt = load_model(path, block, cfg, "block", **expect)
    steps = get_objective(cfg).block_steps(k)
    if finished and ckpt.step < steps:
        raise RunError(
            f"block {k} of {run.root} is at step {ckpt.step} of {steps}; under the progressive schedule "
            f"block {k + 1} trains only after blocks 0..{k} have finished: run "
            f"'blocktrain train-block --out {run.root} --block {k}' first (or 'blocktrain train', which orders them)"
        )
    return block
