"""What the in-process rounds (:mod:`.simulate`) are asked to do and what they return: the rounds' options
(:class:`LocalRounds`), every push and what became of it (:class:`UpdateRecord`), and the run (:class:`LocalRun`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from blocktrain.config import RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ConfigError
from blocktrain.evaluate.scoring import score_split
from blocktrain.objectives import get_objective
from blocktrain.protocol.delta import Compression
from blocktrain.protocol.moments import InnerStart

__all__ = ["LocalRounds", "LocalRun", "UpdateRecord"]


@dataclass(frozen=True)
class LocalRounds:
    workers: int = 6  # M: replicas of the block
    local_steps: int = 25  # H: inner steps per round
    steps: int = 400  # inner steps of each replica in all (rounds = steps // H)
    compression: Compression = Compression.INT8  # push encoding (lossy ones carry error feedback)
    batch_size: int = 0  # sequences per inner step (0: the run config's)
    reset_inner: bool | None = None  # True: fresh inner moments each round, False: carried (None: inner_start)
    inner_start: InnerStart | None = None  # what each round's inner AdamW starts from (None: reset_inner, else settings')
    inner: str = "adamw"  # inner optimiser: "adamw", or "muon" (train.step.MuonAdamW; a measured lever)
    early_steps: int = 0  # H schedule: the first early_steps inner steps run at H = early_h (0: H fixed)
    early_h: int = 0  # H of those early rounds

    def __post_init__(self) -> None:
        if self.workers < 1 or self.local_steps < 1 or self.batch_size < 0:
            raise ConfigError("workers and local_steps must be >= 1 and batch_size >= 0")
        if self.reset_inner is not None and self.inner_start is not None:
            raise ConfigError("set reset_inner or inner_start, not both")
        late = self.steps - self.early_steps
        if late < self.local_steps or late % self.local_steps:
            raise ConfigError(f"steps after the early ones ({late}) must be a positive multiple of local_steps "
                              f"({self.local_steps})")
        if self.early_steps and (self.early_h < 1 or self.early_steps % self.early_h):
            raise ConfigError(f"early_steps ({self.early_steps}) must be a multiple of early_h ({self.early_h}) >= 1")
        if self.inner not in ("adamw", "muon"):
            raise ConfigError(f"inner must be adamw or muon, got {self.inner!r}")

    @property
    def round_steps(self) -> list[int]:
        """H of every round, in order: early_h over the first early_steps, then local_steps."""
        early = [self.early_h] * (self.early_steps // self.early_h) if self.early_steps else []
        return early + [self.local_steps] * ((self.steps - self.early_steps) // self.local_steps)

    @property
    def rounds(self) -> int:
        return len(self.round_steps)


@dataclass(frozen=True)
class UpdateRecord:
    replica: int  # index of the replica that pushed it
    round: int  # the version it was against
    norm: float  # ||Delta|| as the coordinator decoded it
    outcome: str  # "accepted", the refusal's reason ("norm", "gate", ...), "screened" at the close, or "audit" (failed)
    gate: tuple[float, float] | None = None  # held-out loss (before, after) when the gate ran
    replay_cos: float | None = None  # its largest sketch cosine with the block's earlier accepted deltas
    norm_ratio: float | None = None  # its norm per unit of lr over the median of the block's recent ones (None: too few)
    audited: bool = False  # its round was replayed (then "audit" if the replay failed)
    hostile: bool = False  # a hostile replica pushed it while attacking
    replay_error: float | None = None  # its audit's ||replayed - pushed|| / ||pushed|| (None: not audited)
    moment_error: float | None = None  # its audit's distance of the moments it committed to from the derived ones
    derived_steps: int = 0  # inner steps of its earlier rounds its audit replayed to derive those moments


@dataclass
class LocalRun:
    block: nn.Module  # replica 0's module holding the final published weights
    weights: dict[str, torch.Tensor]  # final published W
    push_bytes: list[int] = field(default_factory=list)  # every pushed payload's size on the wire (deflated)
    pull_bytes: list[int] = field(default_factory=list)  # every published step's size on the wire (deflated)
    raw_push_bytes: list[int] = field(default_factory=list)  # the same payloads as safetensors, before deflate
    raw_pull_bytes: list[int] = field(default_factory=list)
    updates: list[UpdateRecord] = field(default_factory=list)  # every pushed update and what became of it
    skipped_rounds: int = 0  # rounds in which every update was refused (the coordinator would wait on)
    quarantined: dict[int, int] = field(default_factory=dict)  # replica -> the version it was quarantined at
    wall_s: float = 0.0  # seconds of the whole simulation

    def test_ce(self, cfg: RunConfig, data: DataDir, max_bytes: int, k: int = 0,
                frozen: Sequence[nn.Module] = ()) -> float:
        """CE (nats/byte) of the trained block's own next-byte prediction (``Objective.local_logits``: a stack's
        prefix 0..k, a diffusion block alone) on the first ``max_bytes`` test bytes."""
        objective = get_objective(cfg)
        self.block.eval()
        device = next(self.block.parameters()).device
        inputs = [f.to(device) for f in frozen]

        def log_probs(x: torch.Tensor) -> torch.Tensor:
            logits = objective.local_logits(self.block, k, x, torch.Generator().manual_seed(0), inputs)
            return torch.log_softmax(logits.float(), dim=-1)[None]  # (1, b, t, 256)

        with torch.no_grad():
            return score_split(log_probs, data.open("test").data, cfg.model.context, max_bytes=max_bytes,
                               device=device).ce_nats_per_byte

    def bytes_per_worker_round(self, wire: bool = True) -> float:
        """Mean bytes one replica moves per round: its push plus the step it pulls (on the wire, or raw)."""
        push, pull = (self.push_bytes, self.pull_bytes) if wire else (self.raw_push_bytes, self.raw_pull_bytes)
        return sum(push) / max(1, len(push)) + sum(pull) / max(1, len(pull))
