"""The checks an update passes against the coordinator's state, after it parsed (:mod:`.validate`).

* **Norm bound**: ||Delta|| <= norm_k x the median of the block's recent accepted
  norms (once ``norm_min_history`` are known). A scaled or random update fails it.
* **Loss gate** (``gate_tolerance``): the block's loss on a fixed held-out
  validation batch at W_v + Delta may exceed its loss at W_v by at most the
  tolerance. An update that undoes training (a sign flip) or learns something else
  (shuffled labels) fails it while it matters.

Both raise :class:`ProtocolError` (422) with the reason ``norm`` or ``gate``. The
coordinator (:mod:`.service`) and its in-process reference (:mod:`.simulate`)
call these same functions.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from blocktrain.coordinator.evaluation import Evaluator, FrozenWeights
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.errors import ProtocolError


def check_norm(k: int, norm: float, history: Sequence[float], settings: CoordinatorSettings) -> None:
    """Refuse ||Delta|| > norm_k x median(history) once the history is long enough."""
    if settings.norm_k <= 0 or len(history) < settings.norm_min_history:
        return
    med = statistics.median(history)
    if norm > settings.norm_k * med:
        raise ProtocolError(
            422,
            f"update norm {norm:.4g} exceeds {settings.norm_k:g} x the median {med:.4g} of recent updates "
            f"of block {k}; check the worker's learning rate and data",
            "norm",
        )


def check_gate(
    evaluator: Evaluator,
    k: int,
    base: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
    frozen: Sequence[FrozenWeights],
    tolerance: float,
) -> tuple[float, float]:
    """Refuse an update that raises block k's held-out loss by more than ``tolerance``; returns (before, after)."""
    before = evaluator.gate_loss(k, base, frozen)
    after = evaluator.gate_loss(k, {n: w + delta[n] for n, w in base.items()}, frozen)
    if after > before + tolerance:
        raise ProtocolError(
            422,
            f"the update makes block {k}'s held-out loss worse ({before:.4f} -> {after:.4f}, tolerance {tolerance:g})",
            "gate",
        )
    return before, after
