"""The seam a hostile replica of the in-process rounds (:mod:`.simulate`) overrides: what it trains, claims and
pushes, and the inner state it starts its round from. Attacks are ``benchmarks/distributed/attacks.py``'s subclasses of :class:`Hostile`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blocktrain.train.inner import InnerRounds


@dataclass(frozen=True)
class HostileContext:
    """What a hostile replica knows when it forges its update."""

    weights: dict[str, torch.Tensor]  # W_v, the version it trained from
    previous: list[dict[str, torch.Tensor]]  # the deltas the previous round accepted (decoded)
    generator: torch.Generator  # its own seeded randomness


class Hostile:
    """A hostile replica's behaviour in the in-process rounds (``benchmarks/distributed/attacks.py``); every method's
    default is what an honest worker does, so an attack overrides only what it changes. Before version
    ``attacks_from`` it behaves honestly (a worker that passes its probation first)."""

    attacks_from: int = 0  # the first version it attacks at

    def begin(self, inner: InnerRounds) -> None:
        """Its inner state once its round has started (what its push commits to): a moment forger's own."""

    def steps(self, h: int) -> int:
        """Inner steps it trains (a strong worker trains more than its budget)."""
        return h

    def train_data(self, data: np.ndarray) -> np.ndarray:
        """The bytes it trains on (a data poisoner's own)."""
        return data

    def targets(self, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The targets it trains on."""
        return y

    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor] | None:
        """The update it pushes in place of the one it trained (None: it pushes nothing this round, having nothing
        to forge from yet; it does not fall back to honest work)."""
        return delta

    def claim(self, budget: int) -> int:
        """The samples it claims."""
        return budget

    def version(self, v: int) -> int:
        """The version it names as its base (a stale worker names an older one)."""
        return v
