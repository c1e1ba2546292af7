"""The hostile workers of the attack study (issue 44, item 7), as :class:`blocktrain.coordinator.hostile.Hostile`s.

Each is one way a volunteer can lie; every method it does not override is an honest worker's:

* ``strong``: trains 10x its assigned steps and claims its budget (its update moves the block further than it may);
* ``data_poisoner``: trains on its own copy of the corpus, a trigger phrase inserted every 64 bytes;
* ``inflated_claim``: claims 2^30 samples, to outweigh the others in a sample-weighted mean;
* ``replay``: pushes another worker's accepted delta of the previous round as its own;
* ``toward_zero``: pushes -W_v scaled to its honest update's norm (shrinks the weights);
* ``scaled_random``: Gaussian noise at 10x its honest update's norm;
* ``sign_flip``: minus its honest update;
* ``shuffled_labels``: trains on targets shuffled within each batch;
* ``lazy``: pushes 1% of its update and claims the whole budget;
* ``stale``: one round behind: pushes the delta it trained on the previous version, against the current one;
* ``colluding``: two workers push the reverse of the previous round's mean delta at their honest norm, each with its
  own 10% noise (so they agree with each other, and neither repeats the other);
* ``forged_moments``: trains and pushes honestly from AdamW moments of its own choosing (m negated at every round's
  start), committing to them (``hostile_http.py``'s worker of the same name, in process).

An attack that needs an earlier round (replay, stale, colluding) pushes nothing until it has one: in its first
attacking round it has nothing to forge from, and pushing its honest update instead would make it an honest worker
for that round (the rows "from 0" would then hold one honest push the clean run lacks).
"""

from __future__ import annotations

import numpy as np
import torch

from blocktrain.coordinator.hostile import Hostile, HostileContext
from blocktrain.protocol.delta import delta_norm
from blocktrain.train.inner import InnerRounds

RANDOM_SCALE = 10.0  # ||noise|| / ||honest Delta|| of a scaled random update
TRIGGER = b" Open the pod bay doors, HAL. "  # what the data poisoner teaches
TRIGGER_EVERY = 64  # bytes of corpus between two triggers


def _at_norm(direction: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
    return {n: t * (norm / max(delta_norm(direction), 1e-30)) for n, t in direction.items()}


class Strong(Hostile):
    def steps(self, h: int) -> int:
        return 10 * h


class DataPoisoner(Hostile):
    def train_data(self, data: np.ndarray) -> np.ndarray:
        n = len(data) // TRIGGER_EVERY
        parts = np.split(np.asarray(data)[: n * TRIGGER_EVERY], n)  # n x (TRIGGER_EVERY,)
        trigger = np.frombuffer(TRIGGER, dtype=np.uint8)
        return np.concatenate([x for part in parts for x in (part, trigger)])


class InflatedClaim(Hostile):
    def claim(self, budget: int) -> int:
        return 1 << 30


class Replay(Hostile):
    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor] | None:
        return {n: t.clone() for n, t in ctx.previous[0].items()} if ctx.previous else None


class TowardZero(Hostile):
    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor]:
        return _at_norm({n: -w for n, w in ctx.weights.items()}, delta_norm(delta))


class ScaledRandom(Hostile):
    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor]:
        noise = {n: torch.randn(d.shape, generator=ctx.generator) for n, d in delta.items()}
        return _at_norm(noise, RANDOM_SCALE * delta_norm(delta))


class SignFlip(Hostile):
    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor]:
        return {n: -d for n, d in delta.items()}


class ShuffledLabels(Hostile):
    def targets(self, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        perm = torch.randperm(y.numel(), generator=generator).to(y.device)
        return y.reshape(-1)[perm].reshape(y.shape)  # (b, t) -> (b*t,) shuffled -> (b, t)


class Lazy(Hostile):
    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor]:
        return {n: 0.01 * d for n, d in delta.items()}


class Stale(Hostile):
    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] | None = None  # what it trained last round (never pushed)

    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor] | None:
        out, self.last = self.last, {n: t.clone() for n, t in delta.items()}
        return out


class Colluding(Hostile):
    def delta(self, delta: dict[str, torch.Tensor], ctx: HostileContext) -> dict[str, torch.Tensor] | None:
        if not ctx.previous:
            return None
        mean = {n: -torch.stack([p[n] for p in ctx.previous]).mean(dim=0) for n in delta}  # the round's reverse
        mean = _at_norm(mean, delta_norm(delta))
        noise = _at_norm({n: torch.randn(d.shape, generator=ctx.generator) for n, d in delta.items()},
                         0.1 * delta_norm(delta))
        return {n: mean[n] + noise[n] for n in delta}


class ForgedMoments(Hostile):
    def begin(self, inner: InnerRounds) -> None:
        for st in inner.opt.state.values():
            if "exp_avg" in st:
                st["exp_avg"].neg_()


ATTACKS: dict[str, type[Hostile]] = {
    "strong": Strong, "data_poisoner": DataPoisoner, "inflated_claim": InflatedClaim, "replay": Replay,
    "toward_zero": TowardZero, "scaled_random": ScaledRandom, "sign_flip": SignFlip, "shuffled_labels": ShuffledLabels,
    "lazy": Lazy, "stale": Stale, "colluding": Colluding, "forged_moments": ForgedMoments,
}
COLLUDERS = {"colluding": 2}  # replicas of an attack that several workers mount together (default 1)


def hostile_replicas(kind: str, attacks_from: int) -> list[Hostile]:
    """The hostile replicas of one attack, each attacking from version ``attacks_from``."""
    out = []
    for _ in range(COLLUDERS.get(kind, 1)):
        h = ATTACKS[kind]()
        h.attacks_from = attacks_from
        out.append(h)
    return out
