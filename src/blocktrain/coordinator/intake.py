"""The update intake: what an update must be, and do, before it may count.

One :class:`Intake` serves the live coordinator (:mod:`.service`) and its in-process rounds (:mod:`.simulate`), so
every defence the hostile-peer study meets is the service's own. A worker's sample count, version and sha256 are
claims; the intake checks each against what the coordinator itself decided, in this order (the first failure refuses,
a :class:`ProtocolError` with its reason):

1. ``base`` (409): the update names the version **and** the weights sha256 it was trained from; another sha256 than
   the published one means it was not trained from them (the worker pulls them again).
2. ``claim`` (422): the samples it claims are at most the budget the work answer assigned (H x batch sequences, times
   the members for a group mean). The claim is its weight in the mean, so no claim buys a round.
3. ``norm`` / ``lazy`` (422): ||Delta|| <= norm_k x the median of the block's recent accepted norms, and
   ||Delta|| >= lazy_fraction x that median x claimed/assigned samples (a zero or tiny delta that claims a full
   budget would only slow the others).
4. ``replay`` (422): a count sketch (Charikar et al. 2002) of every accepted delta of the block is kept; an update whose
   sketch has a cosine above ``replay_cosine`` with any of them, of any worker or version, repeats it.
5. ``gate`` (422): the block's loss on a fixed held-out batch at W_v + Delta may exceed its loss at W_v (computed once
   per version) by at most a tolerance calibrated from the rises of the block's recent accepted updates:
   max(gate_floor, median + gate_z x 1.4826 MAD). ``gate_tolerance`` fixes it instead.

:meth:`Intake.remember` records an accepted update's norm, sketch and rise. What comes after acceptance (the agreement
screen at the round's close, quarantine) is in :mod:`.aggregate` and :mod:`.conduct`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blocktrain.coordinator.evaluation import Evaluator, FrozenWeights
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.validate import ParsedUpdate
from blocktrain.device import CPU
from blocktrain.errors import ProtocolError

MAD_TO_SIGMA = 1.4826  # sigma = 1.4826 x MAD for a normal distribution


def check_norm(k: int, norm: float, history: Sequence[float], settings: CoordinatorSettings) -> None:
    """Refuse ||Delta|| > norm_k x median(history) once the history is long enough (a scaled or random update)."""
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


@dataclass(frozen=True)
class Published:
    """What the coordinator published for a block's open round: the base every update is checked against."""

    block: int  # k
    version: int  # v
    weights_sha: str  # sha256 of W_v's tensors
    weights: dict[str, torch.Tensor]  # W_v (float32)
    frozen: Sequence[FrozenWeights] = ()  # the finished blocks block k reads (stack)


@dataclass(frozen=True)
class Checked:
    """An update that passed the intake, with what :meth:`Intake.remember` keeps of it."""

    norm: float  # ||Delta||
    sketch: torch.Tensor  # (sketch_dim,) unit count sketch of Delta
    gate: tuple[float, float] | None  # held-out loss (before, after), when the gate ran
    replay_cos: float | None = None  # the largest sketch cosine with the block's accepted deltas (None: none yet)


class CountSketch:
    """s(Delta)[h(i)] += sign(i) Delta_i over every coordinate i (fixed seeded hashes): <s(a), s(b)> ~ <a, b>."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dim: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.index: dict[str, torch.Tensor] = {}
        self.sign: dict[str, torch.Tensor] = {}
        for n in sorted(shapes):
            numel = int(torch.Size(shapes[n]).numel())
            self.index[n] = torch.randint(dim, (numel,), generator=g, device=g.device)  # (numel,) bucket of each entry
            self.sign[n] = torch.randint(2, (numel,), generator=g, device=g.device).float().mul_(2).sub_(1)  # (numel,) ±1

    def __call__(self, delta: dict[str, torch.Tensor]) -> torch.Tensor:
        s = torch.zeros(self.dim, dtype=torch.float64, device=CPU)  # sketches live on the host, as the deltas do
        for n, idx in self.index.items():
            s.index_add_(0, idx, (delta[n].reshape(-1).float() * self.sign[n]).double())  # (...) -> (numel,)
        return (s / s.norm().clamp_min(1e-30)).float()


class Intake:
    """The checks of one coordinator (or one in-process run) and the per-block history they read."""

    def __init__(self, settings: CoordinatorSettings, shapes: dict[int, dict[str, tuple[int, ...]]],
                 evaluator: Evaluator | None) -> None:
        self.settings = settings
        self.evaluator = evaluator if settings.gate and evaluator is not None and evaluator.valid is not None else None
        self.norms: dict[int, deque[float]] = {k: deque(maxlen=settings.norm_history) for k in shapes}
        self.rises: dict[int, deque[float]] = {k: deque(maxlen=settings.gate_history) for k in shapes}
        self._sketchers = {k: CountSketch(sh, settings.sketch_dim, seed=k) for k, sh in shapes.items()}
        self._sketches: dict[int, list[torch.Tensor]] = {k: [] for k in shapes}
        # (n, dim) cache of _sketches[k]: valid while it has as many rows as the list (an unlocked check may store
        # a stack taken before an accept appended to the list; its row count gives it away)
        self._stacked: dict[int, torch.Tensor | None] = {k: None for k in shapes}
        self._before: dict[tuple[int, str], float] = {}  # (block, weights sha) -> held-out loss at W_v
        self.checked = 0  # updates that went through check()
        self.seconds = 0.0  # seconds spent in check(), in all

    @property
    def gating(self) -> bool:
        return self.evaluator is not None

    def check(self, upd: ParsedUpdate, base: Published, budget: int) -> Checked:
        """Every check of the module docstring for ``upd`` against ``base``; ``budget``: samples assigned for it."""
        t0 = time.perf_counter()
        try:
            return self._check(upd, base, budget)
        finally:
            self.checked += 1
            self.seconds += time.perf_counter() - t0

    def _check(self, upd: ParsedUpdate, base: Published, budget: int) -> Checked:
        k = base.block
        if upd.base_version != base.version or upd.base_sha != base.weights_sha:
            raise ProtocolError(409, f"the delta names version {upd.base_version} (sha256 {upd.base_sha[:12]}) but block {k} "
                                f"is at version {base.version} (sha256 {base.weights_sha[:12]}); pull the published weights "
                                "and train from them", "stale" if upd.base_version != base.version else "base")
        if upd.samples > budget:
            raise ProtocolError(422, f"the update claims {upd.samples} samples but its round assigned at most {budget}; "
                                "a worker claims the sequences it trained on, steps x batch", "claim")
        history = self.norms[k]
        check_norm(k, upd.norm, history, self.settings)
        if self.settings.lazy_fraction > 0 and len(history) >= self.settings.norm_min_history:
            least = self.settings.lazy_fraction * statistics.median(history) * upd.samples / budget
            if upd.norm < least:
                raise ProtocolError(422, f"update norm {upd.norm:.4g} is below {least:.4g}, the least the {upd.samples} samples "
                                    f"it claims move block {k}; push what you trained", "lazy")
        sketch = self._sketchers[k](upd.delta)
        cos = self.check_replay(k, sketch)
        gate = self._gate(base, upd.delta) if self.evaluator is not None else None
        return Checked(upd.norm, sketch, gate, cos)

    def check_replay(self, k: int, sketch: torch.Tensor) -> float | None:
        """The largest cosine of ``sketch`` with block k's accepted sketches; refuses above ``replay_cosine``."""
        sketches = self._sketches[k][:]  # a snapshot: the list only grows, and may grow while this runs unlocked
        if not sketches:
            return None
        stacked = self._stacked[k]
        if stacked is None or stacked.shape[0] != len(sketches):  # a stack cached before an accept is stale
            stacked = self._stacked[k] = torch.stack(sketches)  # n x (dim,) -> (n, dim)
        cos = float((stacked @ sketch).max())
        if self.settings.replay_cosine < 1 and cos > self.settings.replay_cosine:
            raise ProtocolError(422, f"the update repeats an accepted delta of block {k} (cosine {cos:.6f} > "
                                f"{self.settings.replay_cosine:g}); train on the round's own stream", "replay")
        return cos

    def tolerance(self, k: int) -> float:
        """The gate's tolerance for block k now (nats)."""
        s = self.settings
        if s.gate_tolerance is not None:
            return s.gate_tolerance
        rises = self.rises[k]
        if len(rises) < s.gate_min_history:  # too few honest rises known to calibrate on: a loose start
            return max(s.gate_floor, s.gate_start)
        med = statistics.median(rises)
        mad = statistics.median(abs(r - med) for r in rises)
        return max(s.gate_floor, med + s.gate_z * MAD_TO_SIGMA * mad)

    def _gate(self, base: Published, delta: dict[str, torch.Tensor]) -> tuple[float, float]:
        assert self.evaluator is not None
        k = base.block
        key = (k, base.weights_sha + "".join(sha for sha, _ in base.frozen))
        before = self._before.get(key)
        if before is None:
            before = self.evaluator.gate_loss(k, base.weights, base.frozen)
            self._before = {kk: b for kk, b in self._before.items() if kk[0] != k}  # one version per block
            self._before[key] = before
        after = self.evaluator.gate_loss(k, {n: w + delta[n] for n, w in base.weights.items()}, base.frozen)
        tol = self.tolerance(k)
        if after > before + tol:
            raise ProtocolError(422, f"the update makes block {k}'s held-out loss worse ({before:.4f} -> {after:.4f}, "
                                f"tolerance {tol:.4g})", "gate")
        return before, after

    def remember(self, k: int, checked: Checked) -> None:
        """Count an accepted update in block k's history: its norm, sketch and loss rise."""
        self.norms[k].append(checked.norm)
        self.remember_sketch(k, checked.sketch)
        if checked.gate is not None:
            self.rises[k].append(checked.gate[1] - checked.gate[0])

    def summary(self) -> dict[str, object]:
        """What the intake costs and how tight its gate is, for ``/v1/status``."""
        return {"updates_checked": self.checked, "ms_per_update": 1e3 * self.seconds / max(1, self.checked),
                "gate": self.gating, "gate_tolerance": {k: self.tolerance(k) for k in self.rises} if self.gating else None}

    def remember_sketch(self, k: int, sketch: torch.Tensor) -> None:
        self._sketches[k].append(sketch)
        self._stacked[k] = None

    def sketch(self, k: int, delta: dict[str, torch.Tensor]) -> torch.Tensor:
        """The unit count sketch of ``delta`` for block k (a restarted coordinator re-reads its accepted deltas)."""
        return self._sketchers[k](delta)
