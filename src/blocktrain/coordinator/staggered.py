"""A stack's blocks trained by one pool of workers in process: progressive, or staggered.

The pool has W workers and every block k a budget of W x R_k worker-rounds of H steps (R_k = its step budget over
H, ``Objective.block_steps``), so every schedule spends the same compute. Time passes in slots: in one slot every
open block runs one round (:class:`.simulate.BlockRun`) with the workers it was given, all in parallel.

* progressive (``open_fraction`` 1): block k opens when block k-1 has spent its whole budget; all W workers train
  the one open block. This is the coordinator's schedule, and :func:`.simulate.run_local_rounds` block after block.
* staggered (``open_fraction`` f < 1): block k opens once block k-1 has spent the fraction f of its budget, as a copy
  of block k-1's current weights (``Objective.inherit``), on frozen copies of blocks 0..k-1 that are refreshed at each
  of their new versions until they finish. The workers are split evenly over the open blocks (the earlier blocks take
  the remainder); a block's lr schedule advances with the worker-rounds it has spent, so a round of W/2 workers
  moves it half as far as a round of W.

The slots a schedule takes are its wall time in rounds; at full utilisation both schedules take sum_k R_k.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from blocktrain.config import RunConfig
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.simulate import BlockRun, LocalRounds
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ConfigError
from blocktrain.objectives import get_objective

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSchedule:
    workers: int = 6  # W: the pool
    local_steps: int = 10  # H: inner steps per round
    open_fraction: float = 1.0  # block k opens when block k-1 has spent this fraction of its budget (1: progressive)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.local_steps < 1 or not 0 < self.open_fraction <= 1:
            raise ConfigError("workers and local_steps must be >= 1 and open_fraction in (0, 1]")


@dataclass
class PoolRun:
    blocks: list[nn.Module]  # the final blocks 0..B-1 (replica 0 of each, at its last published version)
    slots: int  # rounds of wall time
    worker_rounds: list[int]  # spent per block (each W x R_k)
    rounds: list[int]  # rounds each block ran
    opened_at: list[int]  # the slot each block opened in
    workers_per_slot: list[list[int]] = field(default_factory=list)  # workers of every block, slot by slot


def run_pool(cfg: RunConfig, settings: CoordinatorSettings, sched: PoolSchedule, data: DataDir) -> PoolRun:
    """Train every block of ``cfg``'s stack with one pool of workers; see the module docstring."""
    objective = get_objective(cfg)
    if not objective.trains_in_order:
        raise ConfigError("a pool schedule trains a stack (blocks that read the ones before them)")
    W, H, B = sched.workers, sched.local_steps, cfg.model.n_blocks
    R = [objective.block_steps(k) // H for k in range(B)]
    budget = [W * r for r in R]
    spent = [0] * B
    runs: list[BlockRun | None] = [None] * B
    out = PoolRun([], 0, spent, [0] * B, [-1] * B)

    def earlier_of(k: int) -> list[nn.Module]:
        """Blocks 0..k-1 whole, at their latest published versions (each loaded once per call)."""
        return [run.current() for run in runs[:k] if run is not None]

    def frozen(whole: list[nn.Module]) -> list[nn.Module]:
        return [objective.freeze(b, torch.float32) for b in whole]

    def open_block(k: int) -> None:
        earlier = earlier_of(k)
        opts = LocalRounds(workers=W, local_steps=H, steps=R[k] * H)
        runs[k] = BlockRun(cfg, settings, opts, data, k=k, frozen=frozen(earlier), earlier=earlier)
        out.opened_at[k] = out.slots
        log.info("slot %d: block %d opens (%d rounds of %d workers' budget)", out.slots, k, R[k], W)

    open_block(0)
    while any(s < b for s, b in zip(spent, budget, strict=True)):
        live = [k for k in range(B) if runs[k] is not None and spent[k] < budget[k]]
        share = _split(W, [budget[k] - spent[k] for k in live])
        for k, m in zip(live, share, strict=True):
            run = runs[k]
            assert run is not None
            if m == 0:
                continue
            run.round(H, offset=spent[k] * H // W, workers=m)
            spent[k] += m
            out.rounds[k] += 1
        out.workers_per_slot.append([dict(zip(live, share, strict=True)).get(k, 0) for k in range(B)])
        out.slots += 1
        for k in range(1, B):  # an open block reads the new versions its earlier blocks published this slot
            run = runs[k]
            if run is not None and spent[k] < budget[k] and any(out.workers_per_slot[-1][j] > 0 for j in range(k)):
                earlier = earlier_of(k)
                run.set_frozen(frozen(earlier), earlier)
        for k in range(1, B):
            if runs[k] is None and spent[k - 1] >= sched.open_fraction * budget[k - 1]:
                open_block(k)
    out.blocks = [run.current() for run in runs if run is not None]
    return out


def _split(W: int, need: list[int]) -> list[int]:
    """W workers over blocks that each need at most ``need`` more worker-rounds: evenly, the earlier blocks taking
    the remainder; what a nearly finished block cannot use goes to the others."""
    share = [0] * len(need)
    left = W
    while left > 0 and any(s < n for s, n in zip(share, need, strict=True)):
        takers = [i for i, (s, n) in enumerate(zip(share, need, strict=True)) if s < n]
        each, extra = divmod(left, len(takers))
        for rank, i in enumerate(takers):
            give = min(each + (1 if rank < extra else 0), need[i] - share[i])
            share[i] += give
            left -= give
        if each == 0 and extra == 0:
            break
    return share
