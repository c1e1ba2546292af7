"""The update intake: what an update must be, and do, before it may count.

One :class:`Intake` serves the live coordinator (:mod:`.service`) and its in-process rounds (:mod:`.simulate`), so
every defence the hostile-peer study meets is the service's own. A worker's sample count, version and sha256 are
claims; the intake checks each against what the coordinator itself decided, in this order (the first failure refuses,
a :class:`ProtocolError` with its reason):

1. ``base`` (409): the update names the version **and** the weights sha256 it was trained from; another sha256 than
   the published one means it was not trained from them (the worker pulls them again).
2. ``claim`` (422): the samples it claims are at most the budget the work answer assigned (H x batch sequences, times
   the members for a group mean). The claim is its weight in the mean, so no claim buys a round.
3. ``norm`` / ``lazy`` (422): with norms measured per unit of the round's lr (||Delta|| / s_v, s_v the mean inner lr
   of round v over the peak lr, :func:`blocktrain.train.step.round_lr_scale`, so the warm-up and the decay do not move
   them), ||Delta|| / s_v <= norm_k x the median of the block's recent accepted ones, and
   ||Delta|| / s_v >= lazy_fraction x that median x claimed/assigned samples (a zero or tiny delta that claims a full
   budget would only slow the others). Only pushes claiming at least half their budget (:data:`FULL_CLAIM`) join the
   history the median is taken over: a push of a sample or two, whose tiny norm the lazy floor lets through, would
   drag it down until honest pushes were refused.
4. ``replay`` (422): a count sketch (Charikar et al. 2002) of every accepted delta of the block is kept; an update whose
   sketch has a cosine above ``replay_cosine`` with any of them, of any worker or version, repeats it.
5. ``gate`` (422): the block's loss on a fixed held-out batch at W_v + Delta may exceed its loss at W_v (computed once
   per version) by at most a tolerance calibrated from the rises of the block's recent accepted updates:
   max(gate_floor, median + gate_z x 1.4826 MAD). ``gate_tolerance`` fixes it instead. A NaN loss is refused.

:meth:`Intake.view` takes what the checks read of a block's history (call under the coordinator's lock); :meth:`Intake.check`
then runs on that snapshot, unlocked, and touches no state of the intake's; :meth:`Intake.remember` records an accepted
update's norm, sketch and rise (under the lock; for a push drawn for audit, its norm and rise only once the audit
passed, :meth:`Intake.release`). The replay check runs twice: on the snapshot, and again under the
lock that accepts the update (:meth:`Intake.check_replay`), against every sketch accepted meanwhile, so two copies
sent at once are not both accepted. What comes after acceptance (the agreement screen at the round's close,
quarantine) is in :mod:`.aggregate` and :mod:`.conduct`.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from blocktrain.checkpoint.safetensors_io import pack, unpack
from blocktrain.coordinator.evaluation import Evaluator, FrozenWeights
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.validate import ParsedUpdate
from blocktrain.device import CPU
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.protocol.codes import Reason

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # sigma = 1.4826 x MAD for a normal distribution
FULL_CLAIM = 0.5  # a push claiming at least this fraction of its budget counts in the norm and loss-rise histories:
# pushes claiming a sample or two (small norms the lazy check lets through) would drag the median honest pushes are
# judged by down, until honest ones are refused as NORM


def full_claim(samples: int, budget: int) -> bool:
    """Whether a push claiming ``samples`` of ``budget`` counts in its block's norm and loss-rise histories."""
    return samples >= FULL_CLAIM * budget


def check_norm(k: int, norm: float, history: Sequence[float], settings: CoordinatorSettings) -> None:
    """Refuse a (per unit of lr) norm > norm_k x median(history) once the history is long enough (a scaled or random
    update)."""
    if settings.norm_k <= 0 or len(history) < settings.norm_min_history:
        return
    med = statistics.median(history)
    if norm > settings.norm_k * med:
        raise ProtocolError(
            422,
            f"update norm {norm:.4g} (per unit of the round's lr) exceeds {settings.norm_k:g} x the median {med:.4g} of "
            f"recent updates of block {k}; check the worker's learning rate and data",
            Reason.NORM,
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

    norm: float  # ||Delta|| / s_v: its norm per unit of its round's lr
    sketch: torch.Tensor  # (sketch_dim,) unit count sketch of Delta
    gate: tuple[float, float] | None  # held-out loss (before, after), when the gate ran
    replay_cos: float | None = None  # the largest sketch cosine with the block's accepted deltas (None: none yet)
    outlier: bool = False  # its norm or its loss rise is unusual for the block: audited more often (settings)
    full: bool = True  # it claims at least half its budget (FULL_CLAIM): its norm and loss rise join the histories
    grouped: bool = False  # a group's mean: judged by, and joining, the histories of group means

    @property
    def rise(self) -> float | None:
        """Its held-out loss rise (nats; None where the gate did not run)."""
        return self.gate[1] - self.gate[0] if self.gate is not None else None


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


def pack_sketch(k: int, sketch: torch.Tensor) -> bytes:
    """An accepted update's count sketch (sketch_dim,) as the blob a restart reads back instead of its delta."""
    return pack({"sketch": sketch}, {"kind": "sketch", "block_index": str(k)})


def unpack_sketch(payload: bytes, k: int, dim: int, source: str) -> torch.Tensor | None:
    """The sketch :func:`pack_sketch` stored for block k; None where it is of another dimension (the run's
    --sketch-dim changed since: the delta is sketched again). CheckpointError for a blob that is no sketch of block k."""
    tensors, meta = unpack(payload, source=source)
    sketch = tensors.get("sketch")
    if meta.get("kind") != "sketch" or meta.get("block_index") != str(k) or sketch is None or sketch.dim() != 1:
        raise CheckpointError(f"{source} is not a count sketch of block {k}; the coordinator state is damaged")
    return sketch.float() if sketch.numel() == dim else None


@dataclass(frozen=True)
class IntakeView:
    """What the checks of one update read of its block's history, taken under the coordinator's lock (its tensors are
    not shared with the intake, which may append to its history while the checks run)."""

    norms: tuple[float, ...]  # the block's recent accepted norms, oldest first
    tolerance: float  # nats: the gate's tolerance now
    sketches: torch.Tensor | None  # (n, sketch_dim) the block's accepted sketches (None: none yet)
    before: float | None  # held-out loss at the published version and frozen inputs (None: no gate)


def replay_cosine(k: int, sketch: torch.Tensor, sketches: torch.Tensor | None, settings: CoordinatorSettings) -> float | None:
    """The largest cosine of ``sketch`` with the accepted ``sketches`` of block k; refuses above ``replay_cosine``."""
    if sketches is None:
        return None
    cos = float((sketches @ sketch).max())  # (n, dim) @ (dim,) -> (n,)
    if settings.replay_cosine < 1 and cos > settings.replay_cosine:
        raise ProtocolError(422, f"the update repeats an accepted delta of block {k} (cosine {cos:.6f} > "
                            f"{settings.replay_cosine:g}); train on the round's own stream", Reason.REPLAY)
    return cos


class SketchRows:
    """A block's accepted sketches as rows of one growing buffer (capacity doubles): :meth:`rows` is a view of the rows
    so far, which later appends never change, so a snapshot taken under the lock stays valid without a copy."""

    def __init__(self, dim: int) -> None:
        self._buf = torch.empty(0, dim, device=CPU)  # (capacity, dim): sketches live on the host, as the deltas do
        self.n = 0  # rows in use

    def append(self, sketch: torch.Tensor) -> None:
        if self.n == self._buf.shape[0]:
            grown = torch.empty(max(16, 2 * self.n), self._buf.shape[1], device=CPU)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n] = sketch
        self.n += 1

    def rows(self) -> torch.Tensor | None:
        """(n, dim) the sketches so far (None: none yet)."""
        return self._buf[: self.n] if self.n else None


class Intake:
    """The checks of one coordinator (or one in-process run) and the per-block history they read. Every method but
    :meth:`check` is called under the coordinator's lock; :meth:`check` reads only its :class:`IntakeView`."""

    def __init__(self, settings: CoordinatorSettings, shapes: dict[int, dict[str, tuple[int, ...]]],
                 evaluator: Evaluator | None) -> None:
        self.settings = settings
        self.evaluator = evaluator if settings.gate and evaluator is not None and evaluator.valid is not None else None
        self._norms: dict[int, deque[float]] = {k: deque(maxlen=settings.norm_history) for k in shapes}
        self._rises: dict[int, deque[float]] = {k: deque(maxlen=settings.gate_history) for k in shapes}
        # group means' own histories (hivemind): a mean of n deltas has a smaller norm and loss rise than one delta, so
        # in a shared history its members' solo pushes (when their group did not form) were refused as NORM or GATE
        self._group_norms: dict[int, deque[float]] = {k: deque(maxlen=settings.norm_history) for k in shapes}
        self._group_rises: dict[int, deque[float]] = {k: deque(maxlen=settings.gate_history) for k in shapes}
        self._sketchers = {k: CountSketch(sh, settings.sketch_dim, seed=k) for k, sh in shapes.items()}
        self._sketches = {k: SketchRows(settings.sketch_dim) for k in shapes}  # the accepted deltas' sketches
        self._before: dict[tuple[int, str], float] = {}  # (block, weights and frozen sha) -> held-out loss at W_v
        self._held: dict[Hashable, tuple[int, float, float | None]] = {}  # pushes awaiting their audit -> (k, norm, rise)
        self._partial_warned: set[int] = set()  # blocks whose first pushes claimed too little to arm the history
        self.checked = 0  # updates that went through check()
        self.seconds = 0.0  # seconds spent in check(), in all

    @property
    def gating(self) -> bool:
        return self.evaluator is not None

    def _history(self, k: int, grouped: bool) -> tuple[deque[float], deque[float]]:
        """Block k's (norms, rises) of single workers' pushes, or of group means."""
        return (self._group_norms[k], self._group_rises[k]) if grouped else (self._norms[k], self._rises[k])

    def view(self, base: Published, grouped: bool = False) -> IntakeView:
        """The snapshot the checks of an update against ``base`` read (``grouped``: a group's mean, judged against
        group means); computes the held-out loss at ``base`` once."""
        k = base.block
        before = None
        if self.evaluator is not None:
            key = (k, base.weights_sha + "".join(sha for sha, _ in base.frozen))
            before = self._before.get(key)
            if before is None:
                before = self.evaluator.gate_loss(k, base.weights, base.frozen)
                if not math.isfinite(before):  # the published weights' own fault: no push is to blame for it
                    log.error("block %d v%d: the held-out loss of the published weights is %s; the loss gate is off "
                              "for this version", k, base.version, before)
                self._before = {kk: b for kk, b in self._before.items() if kk[0] != k}  # one version per block
                self._before[key] = before
            if not math.isfinite(before):
                before = None
        norms = self._history(k, grouped)[0]
        if len(norms) < self.settings.norm_min_history:  # too few group means known: judged as one worker's push
            norms = self._norms[k]                        # (a mean's norm is at most its largest member's)
        return IntakeView(tuple(norms), self.tolerance(k, grouped), self._sketches[k].rows(), before)

    def check(self, upd: ParsedUpdate, base: Published, budget: int, view: IntakeView | None = None,
              lr_scale: float = 1.0) -> Checked:
        """Every check of the module docstring for ``upd`` against ``base``; ``budget``: samples assigned for it;
        ``lr_scale``: s_v of its round. ``view``: the snapshot to check against (None: take it now, for a caller with
        no concurrent updates)."""
        view = view if view is not None else self.view(base)
        k = base.block
        if upd.base_version != base.version or upd.base_sha != base.weights_sha:
            raise ProtocolError(409, f"the delta names version {upd.base_version} (sha256 {upd.base_sha[:12]}) but block {k} "
                                f"is at version {base.version} (sha256 {base.weights_sha[:12]}); pull the published weights "
                                "and train from them", Reason.STALE if upd.base_version != base.version else Reason.BASE)
        if upd.samples > budget:
            raise ProtocolError(422, f"the update claims {upd.samples} samples but its round assigned at most {budget}; "
                                "a worker claims the sequences it trained on, steps x batch", Reason.CLAIM)
        norm = upd.norm / max(lr_scale, 1e-12)
        check_norm(k, norm, view.norms, self.settings)
        if self.settings.lazy_fraction > 0 and len(view.norms) >= self.settings.norm_min_history:
            least = self.settings.lazy_fraction * statistics.median(view.norms) * upd.samples / budget
            if norm < least:
                raise ProtocolError(422, f"update norm {norm:.4g} (per unit of the round's lr) is below {least:.4g}, the "
                                    f"least the {upd.samples} samples it claims move block {k}; push what you trained",
                                    Reason.LAZY)
        sketch = self.sketch(k, upd.delta)
        cos = replay_cosine(k, sketch, view.sketches, self.settings)
        gate = self._gate(base, upd.delta, view) if view.before is not None else None
        s = self.settings
        outlier = ((len(view.norms) >= s.norm_min_history and norm > s.audit_outlier_ratio * statistics.median(view.norms))
                   or (gate is not None and gate[1] - gate[0] > 0.5 * view.tolerance))
        return Checked(norm, sketch, gate, cos, outlier, full_claim(upd.samples, budget), bool(upd.group))

    def check_replay(self, k: int, sketch: torch.Tensor) -> float | None:
        """The replay check against every sketch block k has accepted by now (under the lock that accepts)."""
        return replay_cosine(k, sketch, self._sketches[k].rows(), self.settings)

    def tolerance(self, k: int, grouped: bool = False) -> float:
        """The gate's tolerance for block k now (nats), for a single worker's push or a group's mean."""
        s = self.settings
        if s.gate_tolerance is not None:
            return s.gate_tolerance
        rises = self._history(k, grouped)[1]
        if len(rises) < s.gate_min_history:  # too few group means' rises known: calibrated on single workers' pushes
            rises = self._rises[k]
        if len(rises) < s.gate_min_history:  # too few honest rises known to calibrate on: a loose start
            return max(s.gate_floor, s.gate_start)
        med = statistics.median(rises)
        mad = statistics.median(abs(r - med) for r in rises)
        return max(s.gate_floor, med + s.gate_z * MAD_TO_SIGMA * mad)

    def _gate(self, base: Published, delta: dict[str, torch.Tensor], view: IntakeView) -> tuple[float, float]:
        assert self.evaluator is not None and view.before is not None
        k, before = base.block, view.before
        after = self.evaluator.gate_loss(k, {n: w + delta[n] for n, w in base.weights.items()}, base.frozen)
        if not after <= before + view.tolerance:  # a NaN loss fails too (a finite delta can overflow the forward)
            raise ProtocolError(422, f"the update makes block {k}'s held-out loss worse ({before:.4f} -> {after:.4f}, "
                                f"tolerance {view.tolerance:.4g})", Reason.GATE)
        return before, after

    def remember(self, k: int, checked: Checked, held: Hashable | None = None) -> None:
        """Count an accepted update in block k's history. Its sketch counts at once (a copy of it is a replay whatever
        its audit decides). Its norm and loss rise count at once too, unless the push awaits its audit (``held``: a
        key for it): then they count when :meth:`release` says the audit passed, so a push that fails its audit leaves
        nothing the next pushes are judged by. A push that claims less than half its budget (:data:`FULL_CLAIM`) adds
        neither."""
        self.remember_sketch(k, checked.sketch)
        if not checked.full:
            if not self._history(k, checked.grouped)[0] and k not in self._partial_warned:
                self._partial_warned.add(k)
                log.warning("block %d: accepted a push claiming less than half its budget before any whole one; the "
                            "norm bound and the gate's calibration wait for pushes of at least half a round (if every "
                            "worker is cut short by the deadline, lengthen --round-seconds)", k)
            return
        rise = checked.rise
        if held is not None:
            self.hold(held, k, checked.norm, rise)
        else:
            self._count(k, checked.norm, rise, checked.grouped)

    def hold(self, held: Hashable, k: int, norm: float, rise: float | None = None) -> None:
        """Keep a push's norm (per unit of lr) and loss rise under ``held`` until its audit is decided (also an audit
        restored after a restart; only single workers' pushes are audited)."""
        self._held[held] = (k, norm, rise)

    def release(self, held: Hashable, passed: bool) -> None:
        """The audit of the push held under ``held`` is decided: its norm and rise join its block's history if it
        passed (no-op for a key not held)."""
        entry = self._held.pop(held, None)
        if entry is not None and passed:
            self._count(*entry)

    def _count(self, k: int, norm: float, rise: float | None, grouped: bool = False) -> None:
        norms, rises = self._history(k, grouped)
        norms.append(norm)
        if rise is not None:
            rises.append(rise)

    def count(self, seconds: float) -> None:
        """One update went through :meth:`check`, taking ``seconds``."""
        self.checked += 1
        self.seconds += seconds

    def restore(self, k: int, norms: Sequence[float], sketches: Iterable[torch.Tensor],
                rises: Sequence[float] = (), group_norms: Sequence[float] = (), group_rises: Sequence[float] = ()) -> None:
        """Block k's history again after a restart: its recent accepted norms per unit of lr and loss rises (oldest
        first; single workers' pushes, and group means') and the sketch of every accepted delta (taken one at a time:
        a long run's deltas do not fit in memory together)."""
        self._norms[k].extend(norms)
        self._rises[k].extend(rises)
        self._group_norms[k].extend(group_norms)
        self._group_rises[k].extend(group_rises)
        for sketch in sketches:
            self.remember_sketch(k, sketch)

    def summary(self) -> dict[str, object]:
        """What the intake costs and how tight its gate is, for ``/v1/status``."""
        return {"updates_checked": self.checked, "ms_per_update": 1e3 * self.seconds / max(1, self.checked),
                "gate": self.gating, "gate_tolerance": {k: self.tolerance(k) for k in self._rises} if self.gating else None}

    def remember_sketch(self, k: int, sketch: torch.Tensor) -> None:
        self._sketches[k].append(sketch)

    def sketch(self, k: int, delta: dict[str, torch.Tensor]) -> torch.Tensor:
        """The unit count sketch of ``delta`` for block k."""
        return self._sketchers[k](delta)
