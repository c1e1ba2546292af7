"""The coordinator's rounds in one process: the local reference of decentralised training.

M replicas of block k train DiLoCo-style (Douillard et al. 2023, Alg. 1) exactly as
M workers would against a coordinator, without HTTP, storage or processes:

* every replica starts round v from the published W_v and takes H AdamW steps on
  the stream the coordinator hands worker i for (k, v) (:func:`blocktrain.seeds.worker_stream`), with
  the block's lr schedule over ``rounds x H`` steps; its AdamW state starts each round as ``settings.inner_start``
  says (:mod:`blocktrain.train.inner`: afresh, carried, or from the published shared moments);
* it pushes Delta_i = W_i - W_v encoded with error feedback, and its moment estimates where they are shared
  (:func:`blocktrain.protocol.delta.pack_delta`), which is parsed and checked by
  the coordinator's own functions (:mod:`.validate`, :mod:`.intake`: the norm
  bound, and the loss gate when ``gate_tolerance`` is set);
* a drawn push is audited by the coordinator's own :meth:`.audit.Auditor.judge`, from the state it committed to,
  its moments bounded by those its earlier rounds give (:mod:`.lineage` over :class:`.local_records.LocalRecords`,
  the records a store would hold);
* the round closes with :func:`.aggregate.next_version`, the function the
  coordinator calls, and the replicas apply the decoded published step (and load the published moments at their
  next round that counts: a refused round, or one sat out, is undone to before it began, as the worker undoes it).

Bytes are the real payloads' sizes (safetensors, headers included), deflated as the
worker and the coordinator send them (:mod:`blocktrain.protocol.transport`), and raw. Used by the
averaging study (``benchmarks/distributed/averaging_study.py``) and by tests that compare the
distributed run with this reference.
"""

from __future__ import annotations

import copy
import logging
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from blocktrain.checkpoint.safetensors_io import pack, tensors_sha256, unpack
from blocktrain.config import CompileMode, RunConfig
from blocktrain.coordinator.aggregate import OuterState, RoundResult, carried_share, next_version
from blocktrain.coordinator.audit import Auditor
from blocktrain.coordinator.conduct import COUNTED
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.hostile import Hostile, HostileContext
from blocktrain.coordinator.intake import Intake, Published
from blocktrain.coordinator.lineage import derive, trace
from blocktrain.coordinator.local_records import LocalRecords
from blocktrain.coordinator.local_run import LocalRounds, LocalRun, UpdateRecord
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.validate import ParsedUpdate, parse_update
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import compile_module, resolve_device, resolve_precision
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.progress import progress_bar
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.delta import ErrorFeedback, Sent, all_finite, decode_delta, pack_delta
from blocktrain.protocol.inner_state import pack_state, state_sha
from blocktrain.protocol.messages import AuditAnswer
from blocktrain.protocol.moments import InnerStart, decode_moments, shares_moments
from blocktrain.protocol.transport import deflate
from blocktrain.protocol.weights import block_schema, load_trainable, trainable_state
from blocktrain.seeds import init_seed, worker_stream
from blocktrain.train.inner import InnerRounds
from blocktrain.train.round import BlockTask, train_round
from blocktrain.train.step import MuonAdamW, decay_groups, round_lr_scale

__all__ = ["BlockRun", "LocalRounds", "LocalRun", "UpdateRecord", "run_local_rounds"]  # the options and results: .local_run

log = logging.getLogger(__name__)


def run_local_rounds(
    cfg: RunConfig,
    settings: CoordinatorSettings,
    opts: LocalRounds,
    data: DataDir,
    *,
    k: int = 0,
    frozen: Sequence[nn.Module] = (),
    earlier: Sequence[nn.Module] = (),
    progress: bool = False,
    hostile: Hostile | Sequence[Hostile] = (),
    audit: bool = False,
) -> LocalRun:
    """Train block k with ``opts.workers`` replicas for ``opts.rounds`` rounds; see the module docstring.

    ``earlier`` (whole blocks 0..k-1, heads included) gives version 0 what block k inherits from them
    (``Objective.inherit``: a copy of block k-1 under ``stack.init copy``), as the coordinator's version 0 does.
    ``hostile``: the last replicas behave so (:class:`Hostile`). ``audit``: the coordinator's audits run too
    (:class:`.audit.Auditor`: every push on probation, then ``settings.audit_fraction``, drawn by a seeded generator),
    and a replica quarantined (a failed audit, or ``quarantine_after`` refusals) pushes no more.
    """
    block = BlockRun(cfg, settings, opts, data, k=k, frozen=frozen, earlier=earlier, hostile=hostile, audit=audit)
    bar = progress_bar(total=opts.rounds, desc=f"block {k} x{opts.workers} H={opts.local_steps}", unit="round",
                       disable=not progress, dynamic_ncols=True)
    for offset, h in zip(block.offsets, opts.round_steps, strict=True):
        block.round(h, offset)
        bar.update(1)
    bar.close()
    return block.finish()


def _name(i: int) -> str:
    """Replica i's worker name (its number, i + 1, names its streams, as the store numbers workers from 1)."""
    return f"replica{i}"


class BlockRun:
    """One block's rounds in process, one :meth:`round` at a time (:func:`run_local_rounds` runs them all; a
    schedule that interleaves blocks, such as the staggered one, drives several and may change the workers of a
    round and the block's frozen inputs between rounds)."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, opts: LocalRounds, data: DataDir, *, k: int = 0,
                 frozen: Sequence[nn.Module] = (), earlier: Sequence[nn.Module] = (),
                 hostile: Hostile | Sequence[Hostile] = (), audit: bool = False) -> None:
        objective = self.objective = get_objective(cfg)
        self.device = resolve_device(cfg.train.device)  # the replicas, their rounds and the in-process gate
        if opts.inner_start is not None:
            start = opts.inner_start
        elif opts.reset_inner is not None:
            start = InnerStart.FRESH if opts.reset_inner else InnerStart.CARRIED
        else:
            start = settings.inner_start
        self.start = start  # what each round's inner AdamW starts from: the settings' as the audits read them
        settings = replace(settings, device=str(self.device), inner_start=start)
        self.settings = settings = settings.for_objective(objective.outer_step())
        if len(frozen) != objective.frozen_inputs(k) or (frozen and len(earlier) != len(frozen)):
            raise ConfigError(f"block {k} reads {objective.frozen_inputs(k)} frozen blocks: pass them frozen and whole "
                              f"(earlier), got {len(frozen)} and {len(earlier)}")
        self.cfg, self.opts, self.k = cfg, opts, k
        bad = (hostile,) if isinstance(hostile, Hostile) else tuple(hostile)
        if len(bad) >= opts.workers:
            raise ConfigError(f"{len(bad)} hostile replicas need more than {opts.workers} replicas in all")
        self.hostile = {opts.workers - len(bad) + j: h for j, h in enumerate(bad)}  # the last replicas, by index
        self.tc = tc = replace(cfg.train, batch_size=opts.batch_size or cfg.train.batch_size)
        self.schedule = replace(tc, steps=opts.steps, lr=objective.block_lr(k))  # the worker's: the rounds' H in all
        self.offsets = [sum(opts.round_steps[:v]) for v in range(opts.rounds)]  # each round's place in that schedule
        torch.manual_seed(init_seed(cfg.train.seed, k))  # the coordinator's version 0
        self.replicas = [objective.build_block(k) for _ in range(opts.workers)]
        if earlier:
            for r in self.replicas:
                objective.inherit(r, k, earlier, at_init=True)
        # on the device, compiled as the worker compiles its block (train.compile; OFF: eager)
        self.replicas = [compile_module(r.to(self.device), tc.compile) for r in self.replicas]
        self.W = trainable_state(self.replicas[0])
        self.shapes = block_schema(self.replicas[0])
        if self.start.shares and opts.inner != "adamw":
            raise ConfigError(f"inner_start {self.start.value} shares AdamW moments; inner {opts.inner!r} has none")
        self.inner = [self._inner(r) for r in self.replicas]  # each replica's optimiser, started each round
        self.feedback = [ErrorFeedback(opts.compression) for _ in self.replicas]
        self.state = OuterState()
        self.train = data.open("train")
        self.intake = Intake(settings, {k: self.shapes}, Evaluator(cfg, settings, data) if settings.gate else None)
        if audit and (opts.inner != "adamw" or opts.early_steps):
            raise ConfigError("audits replay AdamW rounds at version x H: not with inner muon or an early-H schedule")
        # the coordinator's auditor over the replicas' own train config (their batch), and the records its lineage
        # reads (coordinator.lineage: an audited round's moments derived from the replica's earlier rounds)
        self.auditor = Auditor(replace(cfg, train=tc), settings, data, rng=random.Random(cfg.train.seed)) if audit else None
        if audit and not self.auditor.enabled:  # type: ignore[union-attr]
            raise ConfigError("audits need settings.audit_fraction > 0")
        self.records = LocalRecords(k, {_name(i): i + 1 for i in range(opts.workers)}, settings.moment_every) \
            if audit else None
        if self.records is not None:
            self.records.publish(0, self.W)
        self.refusals = [0] * opts.workers  # refusals that count toward quarantine, per replica
        self.quarantined: dict[int, int] = {}  # replica -> the version it was quarantined at
        self.accepted = [0] * opts.workers  # accepted pushes per replica (the first probation_pushes are audited)
        self.last_pushes: list[deque[Sent]] = [deque(maxlen=2) for _ in range(opts.workers)]  # newest first
        self.previous: list[dict[str, torch.Tensor]] = []  # the deltas the previous round accepted (what a replay copies)
        self.poisoned: dict[int, np.ndarray] = {}  # hostile replica -> the bytes it trains on
        self.set_frozen(frozen, earlier)
        self.precision = resolve_precision(tc.precision, self.device)
        self.version = 0
        # per replica, the newest published moments it has kept no round since: its next round's start loads them
        # (a round that does not count is undone, its load included, and loads them again: Worker._published_moments)
        self.unloaded: list[dict[str, torch.Tensor] | None] = [None] * opts.workers
        self.run = LocalRun(self.replicas[0], self.W)
        self._t0 = time.perf_counter()

    def _inner(self, module: nn.Module) -> InnerRounds:
        if self.opts.inner == "muon":  # names as pushes name the parameters
            return InnerRounds(module, self.tc, self.start,
                               lambda: (MuonAdamW(module, self.tc), decay_groups(module, self.tc)[1]))
        return InnerRounds(module, self.tc, self.start)

    def set_frozen(self, frozen: Sequence[nn.Module], earlier: Sequence[nn.Module]) -> None:
        """The frozen blocks the next rounds read (a refresh: the current versions of the blocks before), as the
        replicas' frozen copies and whole (``earlier``): the weights the coordinator publishes for them, from which
        its gate and audit replay rebuild them."""
        self.frozen_weights = [(tensors_sha256(w), w) for w in (trainable_state(b) for b in earlier[:len(frozen)])]
        if self.objective.inherits():  # frozen heads from the blocks before, as a worker takes them each round
            for r in self.replicas:
                self.objective.inherit(r, self.k, earlier, at_init=False)
        inputs = [b.to(self.device) for b in frozen]
        if self.tc.compile is not CompileMode.OFF:  # compiled copies: the caller's modules stay as they were
            inputs = [compile_module(copy.deepcopy(b), self.tc.compile) for b in inputs]
        self.task = BlockTask(self.objective, self.k, inputs, self.device)

    def round(self, h: int, offset: int, workers: int | None = None) -> None:
        """Round ``self.version``: replicas 0..workers-1 train ``h`` steps from W_v at schedule position ``offset``
        and push; the coordinator's intake (and audits) and outer step close it."""
        opts, k, v, run = self.opts, self.k, self.version, self.run
        if self.auditor is not None and offset != v * h:
            raise ConfigError(f"audits replay round v at schedule position v x H; round {v} is at {offset}, not "
                              f"{v * h} (a staggered or early-H schedule): run it without audits")
        W = self.W
        base = Published(k, v, tensors_sha256(W), W, self.frozen_weights)
        m = opts.workers if workers is None else workers
        kept: list[tuple[int, ParsedUpdate]] = []  # (its record's index, the update) of each accepted push
        for i in range(m):
            if i in self.quarantined:
                continue
            parsed = self._push(i, h, offset, base)
            if parsed is not None:
                kept.append((len(run.updates) - 1, parsed))
        self.version += 1
        self.previous = [p.delta for _, p in kept]
        if not kept:  # every update refused: W stays, and the next round trains from it again
            run.skipped_rounds += 1
            if self.records is not None:
                self.records.publish(v + 1, self.W)  # the same weights, under the next version
            if self.start.shares and shares_moments(v, self.settings.moment_every):
                self.unloaded = [None] * len(self.unloaded)  # none published with v + 1: own moments go on
            return
        moments = [p.moments for _, p in kept if p.moments is not None]
        result = next_version(W, [p.delta for _, p in kept], [p.samples for _, p in kept], self.settings, self.state,
                              moments or None, round_lr_scale(self.schedule, offset, h),
                              carried=carried_share(h, self.settings.moment_every))
        for j, (at, _) in enumerate(kept):
            if j not in result.kept:  # dropped by the agreement screen at the round's close: a counted refusal
                run.updates[at] = replace(run.updates[at], outcome="screened")
                self._refused(run.updates[at].replica, Reason.SCREENED, v)
        self._publish(result, v)

    def _push(self, i: int, h: int, offset: int, base: Published) -> ParsedUpdate | None:
        """Replica i trains its round and pushes; the update as the coordinator accepted it (None: refused, or its
        audit failed). A round that does not count is undone, as the worker undoes it (its inner state back to
        before the round began): the moments an audit derives for its next round (coordinator.lineage) are its."""
        block, inner = self.replicas[i], self.inner[i]
        undo = inner.snapshot()
        load_trainable(block, base.weights)
        block.train()
        inner.begin(self.unloaded[i])
        bad = self._attacking(i, base.version)
        if bad is not None:
            bad.begin(inner)  # the state its push commits to: a moment forger's own
        parsed = self._train_and_push(i, h, offset, base)
        if parsed is None:
            inner.restore(undo)
        else:
            self.unloaded[i] = None
        return parsed

    def _train_and_push(self, i: int, h: int, offset: int, base: Published) -> ParsedUpdate | None:
        """Replica i's round from its start: trained, pushed, checked and (if drawn) audited as the coordinator does."""
        opts, tc, k, v, run = self.opts, self.tc, self.k, base.version, self.run
        block, inner = self.replicas[i], self.inner[i]
        committed = inner.committed(self.feedback[i].residual) if self.auditor is not None else {}
        bad = self._attacking(i, v)
        stream = TrainStream(self._data(i, bad), self.cfg.model.context, tc.batch_size, self.cfg.train.seed,
                             stream=worker_stream(i + 1, k, v), device=self.device)  # worker ids start at 1, as the store's
        train_round(self.task, block, inner.opt, stream, steps=bad.steps(h) if bad else h, offset=offset,
                    schedule=self.schedule, precision=self.precision, targets=bad.targets if bad else None)
        local = trainable_state(block)
        delta = {n: local[n] - base.weights[n] for n in base.weights}
        budget = h * tc.batch_size  # what the coordinator's work answer assigns
        named = bad.version(v) if bad else v
        if bad is not None:
            forged = bad.delta(delta, HostileContext(base.weights, self.previous, stream.generator(0, purpose=3)))
            if forged is None:  # it sits the round out
                return None
            delta = forged
        mine = inner.moments(self.settings.moments_at(named))  # a sharing round's push carries them (moment_every)
        if not all_finite([*delta.values(), *(mine or {}).values()]):
            log.warning("replica %d: block %d v%d diverged to NaN or infinite values: nothing pushed, as a worker "
                        "does", i, k, v)  # (int8 cannot encode it; a worker undoes such a round and pushes nothing)
            return None
        residual = self.feedback[i].residual  # restored if the push is refused, as the worker does
        body = pack_delta(delta, opts.compression, block=k, base_version=named,
                          base_sha=base.weights_sha if named == v else "0" * 64, samples=bad.claim(budget) if bad else budget,
                          feedback=self.feedback[i], moments=mine,
                          moment_codec=self.settings.moment_codec if mine is not None else None,
                          state_sha=state_sha(committed), precision=self.precision.value)
        run.raw_push_bytes.append(len(body))
        run.push_bytes.append(len(deflate(body)))
        parsed = parse_update(body, k, self.shapes, self.start.shares, self.settings.moment_every)  # as the coordinator
        view = self.intake.view(base)
        med = statistics.median(view.norms) if len(view.norms) >= self.settings.norm_min_history else None
        scale = round_lr_scale(self.schedule, offset, h)
        ratio = parsed.norm / scale / med if med else None
        try:
            checked = self.intake.check(parsed, base, budget, view, scale)
        except ProtocolError as exc:
            run.updates.append(UpdateRecord(i, v, parsed.norm, exc.reason or "refused", norm_ratio=ratio,
                                            hostile=bad is not None))
            self.feedback[i].residual = residual
            self._refused(i, exc.reason, v)
            return None
        self.intake.remember(k, checked, held=(i, v))  # as the service holds a push drawn for audit
        self.accepted[i] += 1
        audited = self._audit(i, parsed, base, committed, checked.outlier, h)
        self.last_pushes[i].appendleft((parsed.delta, parsed.compression))  # bound its next audited residual
        failed = audited is not None and not audited.passed
        if self.records is not None and not failed:
            self.records.keep(_name(i), v, body, parsed.samples)  # its round counts: the next trace starts here
        self.intake.release((i, v), passed=not failed)
        run.updates.append(UpdateRecord(i, v, parsed.norm, "audit" if failed else "accepted", checked.gate,
                                        checked.replay_cos, ratio, audited is not None, bad is not None,
                                        None if audited is None else audited.relative_error,
                                        None if audited is None else audited.moment_error,
                                        0 if audited is None else audited.derived_steps))
        if failed:
            self.quarantined[i] = v
            if self.records is not None:
                self.records.forget(_name(i))
            return None
        return parsed

    def _attacking(self, i: int, v: int) -> Hostile | None:
        """Replica i's hostile behaviour at version v (None: it is honest, or not attacking yet)."""
        bad = self.hostile.get(i)
        return bad if bad is not None and v >= bad.attacks_from else None

    def _data(self, i: int, bad: Hostile | None) -> np.ndarray:
        """The bytes replica i trains on: the run's train split, or a hostile replica's own (made once)."""
        if bad is None:
            return self.train.data
        if i not in self.poisoned:
            self.poisoned[i] = bad.train_data(self.train.data)
        return self.poisoned[i]

    def _refused(self, i: int, reason: str, v: int) -> None:
        """A refusal that counts toward quarantine (``coordinator.conduct.COUNTED``) brings replica i closer to it."""
        if reason in COUNTED and self.settings.quarantine_after:
            self.refusals[i] += 1
            if self.refusals[i] >= self.settings.quarantine_after:
                self.quarantined[i] = v

    def _audit(self, i: int, parsed: ParsedUpdate, base: Published, committed: dict[str, torch.Tensor],
               outlier: bool, h: int) -> AuditAnswer | None:
        """Replica i's accepted push's audit answer (None: it was not drawn), judged by the coordinator's own
        :meth:`.audit.Auditor.judge` on the state the push committed to, its moments bounded by those its earlier
        rounds give (:mod:`.lineage`, over :class:`.local_records.LocalRecords`). A malformed state fails, as the
        service has it; records that do not read back are this process's fault and raise."""
        if self.auditor is None or self.records is None:
            return None
        name, k, v, records = _name(i), self.k, base.version, self.records
        stream = worker_stream(i + 1, k, v)
        if self.auditor.draw(name, parsed, base, stream, self.schedule.steps, h, now=0.0, accepted=self.accepted[i],
                             outlier=outlier,
                             lineage=lambda: trace(records, k, name, v, self.start, self.settings.moment_every)) is None:
            return None
        case = self.auditor.take(name, k, v)
        try:
            derived = None if case.lineage is None else derive(
                records.get_blob, case.lineage, k, self.shapes, self.start, self.settings.moment_codec,
                self.tc.batch_size)
            try:
                answer = self.auditor.judge(case, pack_state(committed, block=k, version=v), self.shapes,
                                            list(self.last_pushes[i]), derived)
            except ProtocolError:  # a malformed state (a residual its last pushes do not bound)
                answer = self.auditor.unjudged()
            self.auditor.record(answer)
            return answer
        finally:
            self.auditor.decided(name, k, v)

    def _publish(self, result: RoundResult, v: int) -> None:
        """The round's published step (and moments), decoded as the workers decode them: the next version."""
        run, k, W = self.run, self.k, self.W
        step_body = pack(result.step, {"kind": "step", "block_index": str(k), "from_version": str(v),
                                       "compression": self.settings.step_compression.value})
        run.raw_pull_bytes.append(len(step_body))
        run.pull_bytes.append(len(deflate(step_body)))
        published, _ = unpack(step_body, source="step")
        decoded = decode_delta(published, self.settings.step_compression)
        self.W = {n: (w + decoded[n]).contiguous() for n, w in W.items()}
        if self.records is not None:
            self.records.publish(v + 1, self.W)
        if any(not torch.equal(self.W[n], result.weights[n]) for n in W):  # pragma: no cover - would break exactness
            raise AssertionError("the decoded published step does not reproduce the coordinator's weights")
        self.state = result.state
        if result.moments is not None:  # what the workers download with the next version
            body = pack(result.moments, {"kind": "moments", "block_index": str(k), "version": str(v + 1)})
            run.raw_pull_bytes[-1] += len(body)
            run.pull_bytes[-1] += len(deflate(body))
            published = decode_moments(unpack(body, source="moments")[0], self.settings.moment_codec, self.shapes)
            if self.records is not None:
                self.records.publish_moments(v + 1, body)
            self.unloaded = [published] * len(self.unloaded)

    def current(self) -> nn.Module:
        """Replica 0 holding the latest published weights (what a later block copies and reads)."""
        load_trainable(self.replicas[0], self.W)
        return self.replicas[0]

    def finish(self) -> LocalRun:
        """The run as it ends: the last published weights in replica 0, and its wall time."""
        return replace(self.run, block=self.current(), weights=self.W, quarantined=dict(self.quarantined),
                       wall_s=time.perf_counter() - self._t0)
