"""Audits: the coordinator replays a sampled fraction of accepted updates and quarantines a worker whose push its own
round does not reproduce.

A worker's round is a function of what the coordinator knows (W_v, the frozen blocks, the stream id it handed out
for (worker, block, version), the schedule position v x H, the samples claimed) and of the worker's inner state at the
round's start: its AdamW moments and its error-feedback residual (:mod:`blocktrain.protocol.inner_state`). Every push
commits to that state's sha256 (``UpdateMeta.state_sha``). The coordinator audits an accepted push with probability
``audit_fraction`` (drawn from the operating system's randomness, so a worker cannot know which rounds are audited):
its answer says ``audit``, the worker uploads the state, and the coordinator

1. checks the state's sha256 against the commitment (a different state is a failed audit) and its residual against
   the worker's last pushes (:func:`check_residual`);
2. replays the round with the worker's own code path (:func:`blocktrain.train.round.train_round`), from moments it
   derives by replaying the worker's earlier rounds back to a start it knows (:mod:`.lineage`; the uploaded moments
   only where its records cannot derive them), encodes the result with the uploaded residual, and
3. compares it with the decoded push on two statistics, both bounded: the relative error
   ||replayed - pushed|| / ||pushed|| <= ``audit_tolerance`` (``audit_tolerance_bf16`` for a push trained in bf16,
   replayed in bf16) x sqrt(H / 25) (:meth:`Auditor.tolerance`), and the push's scale on its replay,
   s = <pushed, replayed> / ||replayed||^2, within ``audit_scale_tolerance`` of 1. Honest rounding differences
   (other thread counts, another device's kernels) move the replay in directions of their own, which the relative
   error sees and the scale hardly does (a difference orthogonal to the push moves s by its square); a push scaled
   by c moves s to c whatever the rounding. So the
   relative-error bound can leave room for another device's arithmetic while a push scaled by 1.1 still fails.
   Measured on cpu-mini (``benchmarks/results/audit-replay.json`` at H=25, ``audit-replay-h100.json`` at H=100):
   honest replays at other thread counts or in the other arithmetic (bf16 against fp32, the stand-in for another
   device: a GPU worker against a CPU replay was not measured, no GPU was at hand) reach relative error 0.028 at
   H=25 and 0.047 at H=100, with the scale within 0.002 of 1; with the moments derived from 1, 2 or 8 earlier
   rounds at H=25 (``audit-replay-derived.json``) 0.038, 0.071 and 0.042, from 2 at H=100 0.099, the scale within
   0.0054 of 1, so the tolerance counts the earlier rounds' steps too, up to three times the round's H (up to 0.1
   at H=25, 0.2 at H=100: the margin over the worst measured is 1.4x, where the audited round alone has 1.8x); a
   push scaled
   by 1.1 has scale 1.100 and shuffled labels relative error above 1.

A failed audit, or one not answered within ``audit_timeout_s``, quarantines the worker (:mod:`.conduct`: token
revoked, later updates refused, its updates not yet applied dropped). Group means (the hivemind engine) commit to no
single state and are not audited. The replay costs the coordinator one worker's round of compute (reported as the
audit answer's ``seconds``); it needs the run's training split (the coordinator's ``--data``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from blocktrain.config import Precision, RunConfig
from blocktrain.coordinator.intake import Published
from blocktrain.coordinator.lineage import Derivation, Lineage
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.validate import ParsedUpdate
from blocktrain.data.dataset import ByteSplit, DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import CPU, resolve_device
from blocktrain.errors import ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import frozen_dtype, whole_blocks
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.delta import ErrorFeedback, Sent, decode_delta, delta_norm, residual_within
from blocktrain.protocol.inner_state import load_inner_state, residual_of, state_sha, unpack_state
from blocktrain.protocol.messages import AuditAnswer
from blocktrain.protocol.weights import load_trainable, trainable_state
from blocktrain.train.inner import InnerRounds
from blocktrain.train.round import BlockTask, train_round

log = logging.getLogger(__name__)

AUDIT_TOLERANCE_STEPS = 25  # inner steps at which the audit tolerances hold as set; they scale by sqrt(H / this)
# The steps of earlier rounds replayed to derive the moments (coordinator.lineage) count in the tolerance up to this
# many times the round's H: their rounding reaches it only through the moments, which forget (beta2 0.95). Three: the
# tolerance at most doubles, 0.1 at H=25, 1.4x the worst measured there (a GPU worker against a CPU replay: unmeasured).
# Measured across bf16 and fp32: 0.071 from 2 earlier rounds and 0.042 from 8 at H=25, 0.099 from 2 at H=100 (where
# the audited round alone stays under 0.1: audit-replay-derived.json, audit-replay-derived-h100.json).
EARLIER_ROUNDS_COUNTED = 3
MAX_PENDING = 64  # audits awaiting an upload at once (each holds one decoded delta); beyond it none is drawn


def replay_scale(pushed: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> float:
    """s = <pushed, replayed> / ||replayed||^2: the factor that best maps the replay onto the push (1 for an honest
    push up to rounding, c for a push scaled by c); 1 when both are zero, inf when only the replay is."""
    dot = sum(float((pushed[n].double() * r.double()).sum()) for n, r in replayed.items())
    sq = sum(float(r.double().square().sum()) for r in replayed.values())
    if sq == 0:
        return 1.0 if all(not bool(pushed[n].any()) for n in replayed) else math.inf
    return dot / sq


@dataclass(frozen=True)
class AuditCase:
    """An accepted push the coordinator will replay, with everything the replay needs but the worker's state."""

    worker: str  # who pushed it
    update: ParsedUpdate  # the push as the coordinator decoded it (its delta, samples, compression, state_sha)
    base: Published  # W_v and the frozen blocks it was trained from
    seed: int  # the run's seed
    stream: int  # the stream id the work answer named for (worker, block, version)
    schedule_steps: int  # the block's rounds x H: the span of its lr schedule
    round_steps: int  # H: the schedule position of version v is v x H
    due: float  # coordinator clock time by which the state must be uploaded
    prior: tuple[str, ...] = ()  # blobs of the worker's last pushes of the block, newest first (its residual's origin)
    lineage: Lineage | None = None  # the rounds its moments came from (None: the uploaded moments are a claim)


class Auditor:
    """Draws audits, keeps them until their upload, replays and judges them. Every method but :meth:`judge` is called
    under the coordinator's lock; :meth:`judge` replays one taken case, unlocked, and touches no state of the
    auditor's (:meth:`record` counts its answer, under the lock)."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, data: DataDir | None,
                 rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.objective = get_objective(cfg)
        self.train: ByteSplit | None = data.open("train") if data is not None and settings.audit_fraction > 0 else None
        self.device = resolve_device(settings.device)  # where replays train (the worker's may be another)
        self._rng = rng or random.SystemRandom()  # which pushes are drawn: unpredictable (seeded only in process)
        self._pending: dict[tuple[str, int, int], AuditCase] = {}  # (worker, block, version) -> case
        self._judging: set[tuple[str, int, int]] = set()  # cases taken for replay, not yet decided
        self.passed = 0
        self.failed = 0
        self.replay_seconds: list[float] = []  # wall time of every replay
        self.derived = 0  # replays whose moments it derived from earlier rounds (coordinator.lineage)

    @property
    def enabled(self) -> bool:
        return self.train is not None

    def draw(self, worker: str, upd: ParsedUpdate, base: Published, stream: int, schedule_steps: int, h: int,
             now: float, accepted: int = 0, outlier: bool = False, prior: tuple[str, ...] = (),
             lineage: Callable[[], Lineage | None] = lambda: None) -> AuditCase | None:
        """The case if this accepted push is audited (it then waits for the worker's upload), else None: every push of
        a worker on probation (``accepted``, its accepted pushes so far, this one included, at most
        --probation-pushes), then a random --audit-fraction, --audit-outlier-fraction for an ``outlier``. ``prior``:
        the blobs of the worker's last pushes of the block, which bound the residual its state may hold;
        ``lineage``: traces the rounds its moments came from (:func:`.lineage.trace`), called for a drawn push only."""
        if not self.enabled or upd.state_sha is None or upd.group:
            return None
        rate = self.settings.audit_outlier_fraction if outlier else self.settings.audit_fraction
        if accepted > self.settings.probation_pushes and self._rng.random() >= max(rate, self.settings.audit_fraction):
            return None
        if len(self._pending) >= MAX_PENDING:
            log.warning("%d audits await their uploads: %s's push for block %d v%d is accepted unaudited%s",
                        MAX_PENDING, worker, upd.block, upd.base_version,
                        " (on probation)" if accepted <= self.settings.probation_pushes else "")
            return None
        case = AuditCase(worker, upd, base, self.cfg.train.seed, stream, schedule_steps, h,
                         now + self.settings.audit_timeout_s, prior, lineage())
        self._pending[(worker, upd.block, upd.base_version)] = case
        return case

    def restore(self, case: AuditCase) -> None:
        """A case drawn before a restart, read back from the store: it waits for its upload again."""
        self._pending[(case.worker, case.update.block, case.update.base_version)] = case

    def forget(self, case: AuditCase) -> None:
        """A drawn case whose push was not stored after all."""
        self._pending.pop((case.worker, case.update.block, case.update.base_version), None)

    def awaits(self, worker: str, k: int, v: int) -> bool:
        """Whether an audit of ``worker``'s push for (k, v) waits for its upload."""
        return (worker, k, v) in self._pending

    def expect(self, worker: str, k: int, v: int) -> None:
        """404 unless an audit of ``worker`` for (k, v) awaits its upload (checked before the body is read)."""
        if (worker, k, v) in self._pending:
            return
        raise ProtocolError(404, f"no audit of worker {worker!r} is pending for block {k} version {v}", Reason.NO_AUDIT)

    def take(self, worker: str, k: int, v: int) -> AuditCase:
        """The case awaiting ``worker``'s upload, now being replayed: its round stays held until :meth:`decided`."""
        case = self._pending.pop((worker, k, v), None)
        if case is not None:
            self._judging.add((worker, k, v))
        if case is None:
            raise ProtocolError(404, f"no audit of worker {worker!r} is pending for block {k} version {v}", Reason.NO_AUDIT)
        return case

    def overdue(self, now: float) -> list[AuditCase]:
        """Cases whose upload is late (removed): the coordinator quarantines their workers."""
        late = [key for key, c in self._pending.items() if c.due < now]
        return [self._pending.pop(key) for key in late]

    def holds(self, k: int, v: int) -> bool:
        """Whether an accepted update of block k version v awaits its audit (its round must not close yet)."""
        return any(key[1] == k and key[2] == v for key in (*self._pending, *self._judging))

    def decided(self, worker: str, k: int, v: int) -> None:
        """The replay of ``worker``'s push for (k, v) is judged (and its worker quarantined if it failed)."""
        self._judging.discard((worker, k, v))

    def pending(self) -> int:
        return len(self._pending)

    def judge(self, case: AuditCase, body: bytes, shapes: dict[str, tuple[int, ...]],
              prior: Sequence[Sent] = (), derived: Derivation | None = None) -> AuditAnswer:
        """Replay ``case`` from the uploaded state ``body``; the answer says whether it reproduced the push.
        ``prior``: the worker's last pushes of the block (``case.prior`` read back), which bound its residual;
        ``derived``: ``case.lineage`` read back, the rounds replayed first to derive its moments (None: the uploaded
        moments are taken as they are)."""
        t0 = time.perf_counter()
        k, v = case.update.block, case.update.base_version
        tensors = unpack_state(body, shapes, block=k, version=v)
        if state_sha(tensors) != case.update.state_sha:
            rel, scale = math.inf, math.inf
        else:
            check_residual(tensors, prior)
            rel, scale = self.replay_error(case, tensors, derived)
        seconds = time.perf_counter() - t0
        tolerance = self.tolerance(case.update.precision, case.update.samples // self.cfg.train.batch_size,
                                   derived.steps if derived is not None else 0, case.round_steps)
        passed = rel <= tolerance and abs(scale - 1.0) <= self.settings.audit_scale_tolerance
        return AuditAnswer(passed=passed, relative_error=rel if math.isfinite(rel) else 1e30,
                           tolerance=tolerance, seconds=seconds, scale=scale if math.isfinite(scale) else 1e30,
                           derived_steps=derived.steps if derived is not None else 0)

    def tolerance(self, precision: str, steps: int, earlier: int = 0, h: int = 0) -> float:
        """The relative error an honest replay of ``steps`` inner steps stays under, after ``earlier`` steps of the
        worker's earlier rounds replayed to derive its moments: the setting for its precision at
        AUDIT_TOLERANCE_STEPS, scaled by sqrt(counted / AUDIT_TOLERANCE_STEPS), where ``counted`` is ``steps`` plus
        ``earlier`` up to EARLIER_ROUNDS_COUNTED x the round's assigned ``h`` (default ``steps``; a round cut at its
        deadline still starts from moments a whole round's rounding moved). Rounding differences compound over a round: measured
        honest errors grew from <= 0.028 at H=25 to <= 0.047 at H=100, other thread counts or the other arithmetic
        (``benchmarks/results/audit-replay.json``, ``audit-replay-h100.json``). fp32 and bf16 get the same default:
        a GPU's fp32 matmuls round like TF32, and the precision is the worker's claim anyway."""
        base = self.settings.audit_tolerance_bf16 if precision == Precision.BF16.value else self.settings.audit_tolerance
        counted = steps + min(earlier, EARLIER_ROUNDS_COUNTED * max(h, steps))
        return base * math.sqrt(max(counted, 1) / AUDIT_TOLERANCE_STEPS)

    def replay_error(self, case: AuditCase, tensors: dict[str, torch.Tensor],
                     derived: Derivation | None = None) -> tuple[float, float]:
        """(||replayed - pushed|| / ||pushed||, the push's scale on its replay) of the round ``case`` names, started
        from the residual of the state ``tensors`` and from moments ``derived`` by replaying the worker's earlier
        rounds (None: the moments of ``tensors``, the worker's claim). Tolerances then cover the earlier rounds'
        steps too (:meth:`judge`): their rounding carries into the moments."""
        assert self.train is not None
        obj, k, upd = self.objective, case.update.block, case.update
        with torch.device(CPU):  # built on the host, as the worker's are, then moved
            block = obj.build_block(k)
            load_trainable(block, case.base.weights)
            earlier = whole_blocks(obj, [w for _, w in case.base.frozen])
            if obj.inherits():  # the frozen heads a stack variant reads, as the worker sets them every round
                obj.inherit(block, k, earlier, at_init=False)
        block = block.to(self.device)
        precision = Precision(upd.precision)  # the worker's arithmetic (bf16 autocast runs on a CPU too, slower)
        dtype = frozen_dtype(self.cfg.train.frozen_storage, precision is Precision.BF16)
        frozen = [obj.freeze(b, dtype).to(self.device) for b in earlier]
        task = BlockTask(obj, k, frozen, self.device)
        inner = InnerRounds(block, self.cfg.train, self.settings.inner_start)  # as the worker holds it
        residual = {n: e.clone() for n, e in residual_of(tensors).items()}
        if derived is None:  # the uploaded moments, as the worker claims them
            load_inner_state(inner.opt, inner.names, tensors)
        else:  # the moments its earlier rounds end with, each started as the worker's was
            for r in derived.earlier:
                load_trainable(block, r.weights())
                inner.begin(r.loads)
                self._train(case, task, block, inner.opt, version=r.version, stream=r.stream, steps=r.steps,
                            precision=r.precision)
            load_trainable(block, case.base.weights)
            inner.begin(derived.loads)
        self._train(case, task, block, inner.opt, version=upd.base_version, stream=case.stream,
                    steps=upd.samples // self.cfg.train.batch_size, precision=precision)
        local = trainable_state(block)
        delta = {n: local[n] - w for n, w in case.base.weights.items()}
        replayed = decode_delta(ErrorFeedback(upd.compression, residual).encode(delta), upd.compression)
        miss = delta_norm({n: replayed[n] - d for n, d in upd.delta.items()})
        rel = miss / upd.norm if upd.norm > 0 else (0.0 if miss == 0 else math.inf)
        return rel, replay_scale(upd.delta, replayed)

    def _train(self, case: AuditCase, task: BlockTask, block: torch.nn.Module, opt: torch.optim.Optimizer, *,
               version: int, stream: int, steps: int, precision: Precision) -> None:
        """One of the worker's rounds: ``steps`` inner steps from version ``version``'s schedule position, on its
        stream ``stream``, in its arithmetic."""
        assert self.train is not None
        batch = self.cfg.train.batch_size
        data = TrainStream(self.train.data, self.cfg.model.context, batch, case.seed, stream=stream, device=self.device)
        schedule = replace(self.cfg.train, steps=max(1, case.schedule_steps), lr=self.objective.block_lr(task.k))
        train_round(task, block, opt, data, steps=steps, offset=version * case.round_steps, schedule=schedule,
                    precision=precision)

    def record(self, answer: AuditAnswer) -> None:
        """Count a judged replay."""
        self.derived += answer.derived_steps > 0
        self.replay_seconds.append(answer.seconds)
        self.passed += answer.passed
        self.failed += not answer.passed

    def summary(self) -> dict[str, float | int]:
        secs = sorted(self.replay_seconds)
        return {"passed": self.passed, "failed": self.failed, "pending": self.pending(), "derived": self.derived,
                "median_replay_s": secs[len(secs) // 2] if secs else 0.0}


def check_residual(tensors: dict[str, torch.Tensor], prior: Sequence[Sent]) -> None:
    """422 unless the error-feedback residual in an uploaded state is one that encoding one of ``prior`` (the worker's
    last pushes of the block, decoded; none: it has pushed none) leaves behind
    (:func:`~blocktrain.protocol.delta.residual_within`): the replay adds it to the replayed delta, so a free residual
    would let any push replay."""
    name = residual_within(residual_of(tensors), prior)
    if name is not None:
        raise ProtocolError(422, f"the residual of {name!r} in the uploaded state is larger than what encoding your "
                            f"last pushes of this block ({len(prior)} on record) leaves behind; upload the state you "
                            "committed to", Reason.AUDIT_FORMAT)
