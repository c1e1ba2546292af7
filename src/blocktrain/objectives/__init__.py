"""Block objectives behind one seam: :class:`~blocktrain.objectives.base.Objective`.

Objective code never imports network code.
"""

from __future__ import annotations

from torch import nn

from blocktrain.config import Objective as ObjectiveKind
from blocktrain.config import RunConfig
from blocktrain.objectives.base import LocalLoss, Objective, compose_logits
from blocktrain.objectives.diffusion import DiffusionObjective
from blocktrain.objectives.stack import StackObjective


def get_objective(cfg: RunConfig) -> Objective:
    """The objective a run's config names."""
    if cfg.objective is ObjectiveKind.STACK:
        return StackObjective(cfg)
    return DiffusionObjective(cfg)


def build_block(cfg: RunConfig, k: int) -> nn.Module:
    """A freshly initialised block k of the run's objective."""
    return get_objective(cfg).build_block(k)


__all__ = ["LocalLoss", "Objective", "build_block", "compose_logits", "get_objective"]
