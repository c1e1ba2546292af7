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
2. derives the AdamW moments the round must start from by replaying the worker's earlier rounds back to a start it
   knows (:mod:`.lineage`), and bounds the uploaded ones' distance from them (:func:`moment_error`, at most
   ``audit_moment_tolerance``; not where its records cannot derive them);
3. replays the round from the uploaded state with the worker's own code path
   (:func:`blocktrain.train.round.train_round`), encodes the result with the uploaded residual, and
4. compares it with the decoded push on two statistics, both bounded: the relative error
   ||replayed - pushed|| / ||pushed|| <= ``audit_tolerance`` (``audit_tolerance_bf16`` for a push trained in bf16,
   replayed in bf16) x sqrt(max(H, 25) / 25) (:meth:`Auditor.tolerance`), and the push's scale on its replay,
   s = <pushed, replayed> / ||replayed||^2, within ``audit_scale_tolerance`` of 1. Honest rounding differences
   (other thread counts, another device's kernels) move the replay in directions of their own, which the relative
   error sees and the scale hardly does (a difference orthogonal to the push moves s by its square); a push scaled
   by c moves s to c whatever the rounding. So the
   relative-error bound can leave room for another device's arithmetic while a push scaled by 1.1 still fails.
   Measured on cpu-mini (``benchmarks/results/audit-replay.json`` at H=25, ``audit-replay-h100.json`` at H=100):
   honest replays at other thread counts or in the other arithmetic (bf16 against fp32, the stand-in for another
   device: a GPU worker against a CPU replay was not measured, no GPU was at hand) reach relative error 0.028 at
   H=25 and 0.047 at H=100, with the scale within 0.002 of 1; a push scaled by 1.1 has scale 1.100 and shuffled
   labels relative error above 1. The round is replayed from the uploaded moments, not the derived ones: across
   arithmetic, a replay from moments derived from 2 earlier rounds reached relative error 0.335 and scale 0.969 on
   cpu-mini's block 2 (``audit-replay-moments.json``), which would fail an honest worker on another device. The
   derived moments bound the uploaded ones instead: honest ones were up to 0.51 away from them across bf16 and
   fp32 (0.07 at another thread count), so the bound, 1.0, refuses a negated or grossly rescaled m or v (a negated
   m is 2 away), not a subtle steer.

A failed audit, or one not answered within ``audit_timeout_s``, quarantines the worker (:mod:`.conduct`: token
revoked, later updates refused, its updates not yet applied dropped). Group means (the hivemind engine) commit to no
single state and are not audited. The replay costs the coordinator one worker's round of compute (reported as the
audit answer's ``seconds``); it needs the run's training split (the coordinator's ``--data``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
from blocktrain.protocol.delta import ErrorFeedback, Sent, all_finite, decode_delta, delta_norm, residual_within
from blocktrain.protocol.inner_state import ADAM, MOMENTS, SCALARS, commits_to, load_inner_state, residual_of, unpack_state
from blocktrain.protocol.messages import AuditAnswer
from blocktrain.protocol.moments import M_PREFIX, V_PREFIX, MomentCodec, decode_moments, encode_moments
from blocktrain.protocol.weights import load_trainable, trainable_state
from blocktrain.train.inner import InnerRounds, inner_scalars
from blocktrain.train.round import BlockTask, train_round

log = logging.getLogger(__name__)

AUDIT_TOLERANCE_STEPS = 25  # inner steps at which the audit tolerances hold as set; above, they scale by sqrt(H / this)
MAX_PENDING = 64  # audits awaiting an upload at once (each holds one decoded delta); beyond it a drawn push gets 503
REPLAY_TIMES = 1024  # replays whose wall times the status's median reads (every replay's, kept for a whole run, grew without end)


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
                 rng: random.Random | None = None, key: bytes | None = None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.objective = get_objective(cfg)
        self.train: ByteSplit | None = data.open("train") if data is not None and settings.audit_fraction > 0 else None
        self.device = resolve_device(settings.device)  # where replays train (the worker's may be another)
        # which pushes are drawn: a keyed hash of (worker, block, version), unpredictable (seeded only in process), the
        # same for a push sent again or trained again for its round (a fresh draw per sending was a free re-roll);
        # ``key``: the run's (kept by the coordinator across restarts), else one drawn from ``rng``
        self._key = key if key is not None else (rng or random.SystemRandom()).getrandbits(256).to_bytes(32, "big")
        self._pending: dict[tuple[str, int, int], AuditCase] = {}  # (worker, block, version) -> case
        self._judging: set[tuple[str, int, int]] = set()  # cases taken for replay, not yet decided
        # cases whose upload has begun -> (the end of its upload window: the later of its deadline and its first
        # upload's start + upload_timeout_s; the ids of its uploads whose body is whole, being decoded). Not overdue
        # while the window is open or a whole body waits for its replay. Keys are added and removed under the
        # coordinator's lock only; :meth:`received` and :meth:`cut`, which run without it (on the event loop), only add
        # or discard an id in a set (one operation under the GIL)
        self._arriving: dict[tuple[str, int, int], tuple[float, set[int]]] = {}
        self._uploads = itertools.count(1)
        self.passed = 0
        self.failed = 0
        self.replay_seconds: deque[float] = deque(maxlen=REPLAY_TIMES)  # wall time of the latest replays
        self.derived = 0  # replays whose moments it derived from earlier rounds (coordinator.lineage)

    @property
    def enabled(self) -> bool:
        return self.train is not None

    def draw(self, worker: str, upd: ParsedUpdate, base: Published, stream: int, schedule_steps: int, h: int,
             now: float, accepted: int = 0, outlier: bool = False, prior: tuple[str, ...] = (),
             lineage: Callable[[], Lineage | None] = lambda: None) -> AuditCase | None:
        """The case if this accepted push is audited (it then waits for the worker's upload), else None: every push of
        a worker on probation (``accepted``, its pushes of this block so far, this one included, at most
        --probation-pushes), then a random --audit-fraction, --audit-outlier-fraction for an ``outlier``. ``prior``:
        the blobs of the worker's last pushes of the block, which bound the residual its state may hold;
        ``lineage``: traces the rounds its moments came from (:func:`.lineage.trace`), called for a drawn push only.
        While :data:`MAX_PENDING` audits await their uploads, a drawn push is refused (:meth:`check_room`), never
        accepted unaudited: colluders holding every slot would switch the audits off for the others."""
        if not self.drawn(worker, upd, accepted, outlier):
            return None
        self.check_room()
        case = AuditCase(worker, upd, base, self.cfg.train.seed, stream, schedule_steps, h,
                         now + self.settings.audit_timeout_s, prior, lineage())
        self._pending[(worker, upd.block, upd.base_version)] = case
        return case

    def drawn(self, worker: str, upd: ParsedUpdate, accepted: int, outlier: bool = False) -> bool:
        """Whether this push is audited (see :meth:`draw`)."""
        if not self.enabled or upd.state_sha is None or upd.group:
            return False
        rate = self.settings.audit_outlier_fraction if outlier else self.settings.audit_fraction
        return accepted <= self.settings.probation_pushes or self.lot(worker, upd.block, upd.base_version) < max(
            rate, self.settings.audit_fraction)

    def check_room(self) -> None:
        """503 ``audits_busy`` while MAX_PENDING audits await their uploads: a drawn push is never accepted unaudited
        (its worker's client sends it again for a while, then the worker goes on to its next round)."""
        if len(self._pending) >= MAX_PENDING:
            raise ProtocolError(503, f"{MAX_PENDING} audits await their uploads and this push was drawn for one; send it "
                                "again later (a worker does so by itself)", Reason.AUDITS_BUSY)

    def lot(self, worker: str, k: int, v: int) -> float:
        """The uniform number in [0, 1) that draws ``worker``'s push for block k version v: a push is audited below
        the audit rate. Keyed by this coordinator's secret, so no worker can tell its draws beforehand."""
        digest = hmac.new(self._key, f"{worker}\0{k}\0{v}".encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64

    def restore(self, case: AuditCase) -> None:
        """A case drawn before a restart, read back from the store: it waits for its upload again."""
        self._pending[(case.worker, case.update.block, case.update.base_version)] = case

    def forget(self, case: AuditCase) -> None:
        """A drawn case whose push was not stored after all."""
        self._pending.pop((case.worker, case.update.block, case.update.base_version), None)

    def awaits(self, worker: str, k: int, v: int) -> bool:
        """Whether an audit of ``worker``'s push for (k, v) waits for its upload."""
        return (worker, k, v) in self._pending

    def expect(self, worker: str, k: int, v: int, now: float) -> tuple[int, float]:
        """404 unless an audit of ``worker`` for (k, v) awaits its upload, 408 past its deadline (checked before the
        body is read). An upload begun in time makes the case not overdue while it arrives, until ``upload_timeout_s``
        after the first one began (a slow link past the audit's deadline is no failure, and a resend on a new
        connection keeps that window; uploads begun and cut again and again do not stretch it); until :meth:`take`,
        or :meth:`cut` of every upload begun. Returns the upload's id, for :meth:`cut`, and the seconds its body may
        take (what is left of the window)."""
        key = (worker, k, v)
        case = self._pending.get(key)
        if case is None:
            raise ProtocolError(404, f"no audit of worker {worker!r} is pending for block {k} version {v}",
                                Reason.NO_AUDIT)
        entry = self._arriving.get(key)
        if entry is None:
            if now > case.due:
                raise ProtocolError(408, f"the state for the audit of block {k} v{v} was due by {case.due:.0f}; it is "
                                    "too late", Reason.SLOW)
            entry = self._arriving[key] = (max(case.due, now + self.settings.upload_timeout_s), set())
        elif now > entry[0]:
            raise ProtocolError(408, f"the state for the audit of block {k} v{v} did not arrive within "
                                f"{self.settings.upload_timeout_s:g} s of its first upload", Reason.SLOW)
        return next(self._uploads), entry[0] - now

    def arriving(self, worker: str, k: int, v: int) -> bool:
        """Whether an upload of ``worker``'s audit for (k, v) has begun (its window opened)."""
        return (worker, k, v) in self._arriving

    def received(self, worker: str, k: int, v: int, upload: int) -> None:
        """(Unlocked.) The body of ``upload`` is whole, within its window: the case is not overdue while it is decoded
        and waits for the lock, until :meth:`take` (or its :meth:`cut`, should that fail)."""
        entry = self._arriving.get((worker, k, v))
        if entry is not None:
            entry[1].add(upload)

    def cut(self, worker: str, k: int, v: int, upload: int) -> None:
        """(Unlocked.) ``upload`` begun at :meth:`expect` ended without a replay (cut, late or malformed): the case is
        overdue again once its window has passed (a no-op once the case was taken)."""
        entry = self._arriving.get((worker, k, v))
        if entry is not None:
            entry[1].discard(upload)

    def _not_arriving(self, key: tuple[str, int, int]) -> None:
        self._arriving.pop(key, None)

    def take(self, worker: str, k: int, v: int) -> AuditCase:
        """The case awaiting ``worker``'s upload, now being replayed: its round stays held until :meth:`decided`."""
        case = self._pending.pop((worker, k, v), None)
        self._not_arriving((worker, k, v))
        if case is not None:
            self._judging.add((worker, k, v))
        if case is None:
            raise ProtocolError(404, f"no audit of worker {worker!r} is pending for block {k} version {v}", Reason.NO_AUDIT)
        return case

    def forget_worker(self, worker: str) -> list[tuple[str, int, int]]:
        """The keys of ``worker``'s cases that await an upload, no longer awaited (it was quarantined: its updates are
        dropped, so their rounds need not wait for them)."""
        keys = [key for key in self._pending if key[0] == worker]
        for key in keys:
            del self._pending[key]
            self._not_arriving(key)
        return keys

    def overdue(self, now: float) -> list[AuditCase]:
        """Cases whose upload is late (removed): the coordinator quarantines their workers. A case whose upload window
        is open is not late yet, whether an upload arrives now or its worker is between a cut and its resend (the
        window's end bounds both), nor one whose body is in and being decoded."""
        arriving = {key for key, (until, whole) in list(self._arriving.items()) if now <= until or whole}
        late = [key for key, c in self._pending.items() if c.due < now and key not in arriving]
        for key in late:
            self._not_arriving(key)
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
        tensors = unpack_state(body, shapes, block=k, version=v, scalars=inner_scalars(self.settings.inner_start))
        off = pushed = 0.0  # how far its moments are from the records' (derived: 0 where none are) and from the replay's
        if case.update.state_sha is None or not commits_to(tensors, case.update.state_sha):
            rel, scale = math.inf, math.inf
        else:
            check_residual(tensors, prior)
            built = self._block(case)  # one block and its frozen inputs for both replays
            rel, scale, pushed = self.replay_error(case, tensors, built)
            if derived is not None:
                off = moment_error(tensors, self.derived_moments(case, derived, built))
        seconds = time.perf_counter() - t0
        tolerance = self.tolerance(case.update.precision, case.update.samples // self.cfg.train.batch_size)
        st = self.settings
        passed = (rel <= tolerance and abs(scale - 1.0) <= st.audit_scale_tolerance
                  and off <= st.audit_moment_tolerance and pushed <= st.audit_pushed_moment_tolerance)

        def finite(x: float) -> float:
            return x if math.isfinite(x) else 1e30

        return AuditAnswer(passed=passed, relative_error=finite(rel), tolerance=tolerance, seconds=seconds,
                           scale=finite(scale), derived_steps=derived.steps if derived is not None else 0,
                           moment_error=finite(off), pushed_moment_error=finite(pushed))

    def unjudged(self) -> AuditAnswer:
        """The answer to an audit with no replay to judge (a malformed upload, a replay that broke): not passed."""
        return AuditAnswer(passed=False, relative_error=1e30, tolerance=self.settings.audit_tolerance, seconds=0.0)

    def tolerance(self, precision: str, steps: int) -> float:
        """The relative error an honest replay of ``steps`` inner steps stays under: the setting for its precision
        at AUDIT_TOLERANCE_STEPS, scaled by sqrt(steps / AUDIT_TOLERANCE_STEPS) above it, and never tighter below it.
        Rounding differences compound over a round: measured honest errors grew from <= 0.028 at H=25 to <= 0.047 at
        H=100, other thread counts or the other arithmetic (``benchmarks/results/audit-replay.json``,
        ``audit-replay-h100.json``). They do not shrink to nothing over a short round: one bf16 step replayed in fp32
        is already about 0.011-0.015 away (cpu-mini), so a round cut short by its deadline keeps the H=25 tolerance;
        the scale bound (``audit_scale_tolerance``) still catches a scaled push at any length. fp32 and bf16 get the
        same default: a GPU's fp32 matmuls round like TF32, and the precision is the worker's claim anyway."""
        base = self.settings.audit_tolerance_bf16 if precision == Precision.BF16.value else self.settings.audit_tolerance
        return base * math.sqrt(max(steps, AUDIT_TOLERANCE_STEPS) / AUDIT_TOLERANCE_STEPS)

    def replay_error(self, case: AuditCase, tensors: dict[str, torch.Tensor],
                     built: tuple[torch.nn.Module, BlockTask] | None = None) -> tuple[float, float, float]:
        """(||replayed - pushed|| / ||pushed||, the push's scale on its replay, and :func:`pushed_moment_error` of the
        moments it carried, 0 where none) of the round ``case`` names, started from the state ``tensors`` (its moments
        checked against the derived ones apart: :meth:`derived_moments`); ``built``: the block and task
        :meth:`_block` made for ``case`` (None: made here), its weights reset to W_v."""
        block, task = built or self._block(case)
        load_trainable(block, case.base.weights)
        inner = InnerRounds(block, self.cfg.train, self.settings.inner_start)  # as the worker holds it
        residual = load_inner_state(inner.opt, inner.names, tensors)
        upd = case.update
        self._train(case, task, block, inner.opt, version=upd.base_version, stream=case.stream,
                    steps=upd.samples // self.cfg.train.batch_size, precision=Precision(upd.precision))
        local = trainable_state(block)
        delta = {n: local[n] - w for n, w in case.base.weights.items()}
        if not all_finite(delta.values()):  # its uploaded state made the replay diverge
            return math.inf, math.nan, math.inf  # failed (int8 cannot encode it: that error dropped the push unjudged)
        replayed = decode_delta(ErrorFeedback(upd.compression, residual).encode(delta), upd.compression)
        miss = delta_norm({n: replayed[n] - d for n, d in upd.delta.items()})
        rel = miss / upd.norm if upd.norm > 0 else (0.0 if miss == 0 else math.inf)
        moments = 0.0
        if upd.moments is not None and upd.moment_codec is not None:  # what it carried: the replay's, through its codec
            codec = MomentCodec(upd.moment_codec)
            prefixes = tuple(p for p in (M_PREFIX, V_PREFIX) if any(n.startswith(p) for n in upd.moments))
            own = {n: t.to(CPU) for n, t in (inner.moments(prefixes) or {}).items()}  # once a replay: no hot loop
            shapes = {n: tuple(w.shape) for n, w in case.base.weights.items()}
            moments = pushed_moment_error(upd.moments, decode_moments(encode_moments(own, codec), codec, shapes))
        return rel, replay_scale(upd.delta, replayed), moments

    def derived_moments(self, case: AuditCase, derived: Derivation,
                        built: tuple[torch.nn.Module, BlockTask] | None = None) -> dict[str, torch.Tensor]:
        """The AdamW state the audited round of ``case`` starts from by the records (:mod:`.lineage`): the worker's
        earlier rounds replayed, each started as the worker's was, then the audited round's own start; named as an
        uploaded state names it (no residual). ``built``: as :meth:`replay_error` takes it (each round loads its
        own weights)."""
        block, task = built or self._block(case)
        inner = InnerRounds(block, self.cfg.train, self.settings.inner_start)
        for r in derived.earlier:
            load_trainable(block, r.weights())
            inner.begin(r.loads)
            self._train(case, task, block, inner.opt, version=r.version, stream=r.stream, steps=r.steps,
                        precision=r.precision)
        inner.begin(derived.loads)
        return inner.committed({})

    def _block(self, case: AuditCase) -> tuple[torch.nn.Module, BlockTask]:
        """Block k at W_v on the replay device, with the task over its frozen inputs in the worker's arithmetic."""
        obj, k = self.objective, case.update.block
        with torch.device(CPU):  # built on the host, as the worker's are, then moved
            block = obj.build_block(k)
            load_trainable(block, case.base.weights)
            earlier = whole_blocks(obj, [w for _, w in case.base.frozen])
            if obj.inherits():  # the frozen heads a stack variant reads, as the worker sets them every round
                obj.inherit(block, k, earlier, at_init=False)
        block = block.to(self.device)
        dtype = frozen_dtype(self.cfg.train.frozen_storage, Precision(case.update.precision) is Precision.BF16)
        frozen = [obj.freeze(b, dtype).to(self.device) for b in earlier]
        return block, BlockTask(obj, k, frozen, self.device)

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


def moment_error(claimed: Mapping[str, torch.Tensor], derived: Mapping[str, torch.Tensor]) -> float:
    """How far the AdamW state ``claimed`` (an uploaded inner state) is from ``derived`` (the coordinator's replay of
    the worker's earlier rounds), both named as :mod:`blocktrain.protocol.inner_state` names them: the larger of
    ||m_claimed - m_derived|| / ||m_derived|| and the same for v, over every parameter (a tensor one side lacks
    counts as zeros); inf where a bias correction or step count differs beyond float32 rounding (it rescales a
    moment)."""
    names = {n for n in (*claimed, *derived) if n.startswith(ADAM)}
    zero = torch.zeros(())
    for n in (n for n in names if n.rsplit("/", 1)[1] in SCALARS):
        a, b = float(claimed.get(n, zero)), float(derived.get(n, zero))
        if abs(a - b) > 1e-6 * max(1.0, abs(b)):
            return math.inf
    worst = 0.0
    for leaf in MOMENTS:
        _, num, den = _sums(claimed, derived, [n for n in names if n.endswith("/" + leaf)])
        worst = max(worst, math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf))
    return worst


def _sums(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], names: Sequence[str]) -> tuple[float, float, float]:
    """<a, b>, ||a - b||^2 and ||b||^2 over the tensors ``names`` (in float64; one a side lacks counts as zeros)."""
    dot = num = den = 0.0
    zero = torch.zeros((), dtype=torch.float64)
    for n in names:
        x = a[n].double() if n in a else zero
        y = b[n].double() if n in b else zero
        dot += float((x * y).sum())
        num += float((x - y).square().sum())
        den += float(y.square().sum())
    return dot, num, den


MOMENT_SCALE_BOUND = 2.0  # a pushed moment's scale on its replay must lie in [1/2, 2]: a v pushed x8 or /8 sits at 8
# or 1/8, a negated m at -1, while honest rounding moves it in directions of its own (see replay_scale), not along it


def pushed_moment_error(pushed: Mapping[str, torch.Tensor], replayed: Mapping[str, torch.Tensor]) -> float:
    """How far the moment estimates a push carried (``m/NAME``, ``v/NAME``, decoded) are from those its replay ends
    with (encoded and decoded as the push's were): the larger over m and v of ||pushed - replayed|| / ||replayed||,
    or inf where the pushed one's scale on the replay's, <pushed, replayed> / ||replayed||^2, lies outside
    [1 / MOMENT_SCALE_BOUND, MOMENT_SCALE_BOUND]. They go into the published means the next rounds start from, so a
    push that replays may still not carry moments of its own choosing."""
    worst = 0.0
    for prefix in (M_PREFIX, V_PREFIX):
        names = sorted({n for n in (*pushed, *replayed) if n.startswith(prefix)})
        if not names:
            continue
        dot, num, den = _sums(pushed, replayed, names)
        if den == 0:
            if num > 0:
                return math.inf
            continue
        if not 1 / MOMENT_SCALE_BOUND <= dot / den <= MOMENT_SCALE_BOUND:
            return math.inf
        worst = max(worst, math.sqrt(num / den))
    return worst


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
