"""The worker: register, pull its block, train H local steps, push the delta, repeat.

The inner AdamW starts each round as the coordinator's ``inner_start`` says: by default from the moments the
coordinator published with the round's version (the workers' aggregated m and v, pushed with the deltas every
``moment_every``-th round), and from its own between those; ``fresh`` zeroes them every round
(``benchmarks/results/averaging-scaling.md``). The weights are reset to each new published version. The local learning rate
follows the preset's schedule over ``rounds x H`` local steps. Data comes from
the stream id the coordinator hands out for (worker, block, round), so replicas
never repeat one another and the run can be audited.

A ``stack`` block k reads frozen copies of the finished blocks 0..k-1: the
worker fetches them once per published version, caches and verifies them
(:mod:`.frozen`), and waits while its block is still ``waiting``.

Deadlines: a worker stops its local steps when the round's deadline is near (a
margin of twice its slowest push) and pushes what it has, weighted by the samples
behind it, so a slow peer contributes on time instead of arriving stale. An update
that arrives after its round closed anyway is refused (409 ``stale``), counted in
``rounds_stale``, and the worker pulls the new version.

Shutdown: the first SIGINT/SIGTERM finishes the current round (trains, pushes)
and then leaves; a second one abandons the round at once and leaves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace

import torch
from tqdm import tqdm

from blocktrain.checkpoint.safetensors_io import tensors_sha256, unpack
from blocktrain.config import Precision, RunConfig
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import compile_module, resolve_device, resolve_precision
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import frozen_dtype
from blocktrain.protocol.codes import Reason, RoundState
from blocktrain.protocol.delta import ErrorFeedback, all_finite, pack_delta
from blocktrain.protocol.inner_state import pack_state, state_sha
from blocktrain.protocol.messages import Registration, WorkAnswer
from blocktrain.protocol.moments import parse_moments
from blocktrain.protocol.weights import block_schema, load_trainable, schema_fp32_bytes, trainable_state
from blocktrain.train.inner import InnerRounds, Snapshot
from blocktrain.train.loop import Hook, ProgressHook, StepRecord
from blocktrain.train.round import BlockTask, Targets, train_round
from blocktrain.worker.client import UNSIZED_RESPONSE_BYTES, CoordinatorClient
from blocktrain.worker.engines import Averaging, Combined, DirectEngine, Engine, HivemindEngine, RoundClock
from blocktrain.worker.frozen import FrozenInputs
from blocktrain.worker.options import WorkerOptions, WorkerSummary
from blocktrain.worker.versions import fetch_version

log = logging.getLogger(__name__)


# why a group's mean can be refused for a member other than its uploader (one already counts, one cannot count or is
# quarantined) or for no member at all (the coordinator hosts no groups)
MEAN_REFUSED_FOR_A_MEMBER = frozenset({Reason.DUPLICATE, Reason.GROUP_MEMBER, Reason.QUARANTINED, Reason.HIVEMIND_OFF})


def mean_refusal_keeps_own(exc: ProtocolError) -> bool:
    """Whether a group mean's refusal leaves its uploader's own delta to push alone: a refusal for a member
    (:data:`MEAN_REFUSED_FOR_A_MEMBER`), or any other 4xx but a conflict (409: a stale base, which its own delta
    shares). Those include refusals for what the mean holds (a NaN, its norm, the gate), which its uploader cannot tell
    apart from what another member sent into it: counting them against the uploader let one hostile member, poisoning
    the means its honest uploader sent, end it at --max-rejections."""
    return exc.reason in MEAN_REFUSED_FOR_A_MEMBER or (400 <= exc.status < 500 and exc.status != 409)


class Worker:
    targets: Targets | None = None  # what it trains on instead of the stream's next bytes (None: those; a hostile peer's)

    def __init__(self, opts: WorkerOptions, data: DataDir, *, stop: threading.Event | None = None,
                 abandon: threading.Event | None = None) -> None:
        self.opts = opts
        self.data = data
        self.device = resolve_device(opts.device)  # a device this machine lacks fails here, before registering
        self.stop = stop or threading.Event()  # finish the current round, then leave
        self.abandon = abandon or threading.Event()  # leave at once
        self.client = CoordinatorClient(opts.url, opts.token, give_up_s=opts.give_up_s, stop=self.abandon,
                                        leaving=self.stop, verify=opts.verify_tls)
        self.summary = WorkerSummary()
        self._last_beat = 0.0
        self._push_s = Recent()  # seconds a push took, packed and sent (its last sending), for the deadline's margin
        self._step_s = Recent()  # seconds a local step took, for the same margin
        self._work_at = time.monotonic()  # time.monotonic() of the last work answer (its deadline_in counts from it)
        self._claim_cap = 0  # samples one member of a group may claim this round (the work answer's steps x batch)
        self._sync_misses = 0  # weights fetched in a row that were not the version their work answer named
        self._unsent: tuple[int, dict[str, torch.Tensor], int] | None = None  # a grouped round's (version, delta,
        # samples), until its group's mean lands: pushed alone if it has not as the deadline nears
        self.steps_done = 0  # local steps of the current round
        self.engine: Engine = (HivemindEngine(opts.group_size, opts.matchmaking_s, opts.p2p_host, self.abandon)
                               if opts.averaging is Averaging.HIVEMIND else DirectEngine())  # how the delta is averaged
        self._refused: tuple[int, int] = (-1, -1)  # (block, version) whose update the coordinator refused: not trained again
        self._deadline_at = float("inf")  # time.monotonic() of the current round's deadline

    # --- set-up ---------------------------------------------------------------
    def _setup(self, reg: Registration) -> None:
        self.cfg = RunConfig.from_json(reg.config)
        self.k = reg.block
        self.lease_s = reg.lease_seconds
        self.client.waiting = self._beat  # a long wait on the coordinator (a replay, retries) keeps the lease
        self.H = min(self.opts.local_steps or reg.local_steps, reg.local_steps)  # the coordinator assigns the budget
        self.inner_start = reg.inner_start
        rounds = reg.rounds
        # the lr schedule spans the block's rounds x the coordinator's H, the position a round's version gives
        steps = rounds * reg.local_steps if rounds else self.cfg.train.steps
        self.round_steps = reg.local_steps
        self.objective = get_objective(self.cfg)
        self.schedule = replace(self.cfg.train, steps=max(1, steps), lr=self.objective.block_lr(self.k))
        self.precision = resolve_precision(self.opts.precision or self.cfg.train.precision, self.device)
        self.frozen = FrozenInputs(self.client, self.objective, self.opts.frozen_dir, self.device,
                                   frozen_dtype(self.cfg.train.frozen_storage, self.precision is Precision.BF16),
                                   self.opts.compile)
        self.train = self.data.open("train")
        self.block = compile_module(self.objective.build_block(self.k).to(self.device), self.opts.compile)
        self.shapes = block_schema(self.block)
        # the largest answer it reads: moments (2x the block) or frozen blocks, whose sizes differ from its own by the
        # embeddings or a head: 8x its own fp32 bytes and 16 MiB is far above any, and far below a deflate bomb
        self.client.max_response_bytes = 8 * schema_fp32_bytes(self.shapes) + UNSIZED_RESPONSE_BYTES
        self.moment_codec = reg.moment_codec
        self.moment_every = reg.moment_every  # rounds between shared moments (protocol.moments.shares_moments)
        self.inner = InnerRounds(self.block, self.cfg.train, self.inner_start)  # its optimiser, started each round
        self._moments_version = -1  # the version whose published moments this worker loaded last
        self._kept_version = -1  # the version of its newest round of this block that counts (-1: none yet)
        self.round_state: dict[str, torch.Tensor] = {}  # inner state at the current round's start (for an audit)
        # its inner state, loaded moments and kept version before the round began (:meth:`_undo_round`)
        self._undo: tuple[Snapshot, int, int] = ({}, -1, -1)
        self.feedback = ErrorFeedback(self.opts.compression)  # quantisation residual of this block's pushes
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version = -1
        self.base_sha = ""  # sha256 of the base weights: the coordinator's weights_sha for the same version
        # a grouped round's delta waiting for its group's mean is not pushed after a registration: to another block
        # it does not belong, and on the same block its inner state (round_state, above) is gone, so its audit fails
        self._unsent = None
        self.summary.block = self.k
        log.info("registered as %s on block %d (preset %s, %s objective)", reg.worker, self.k, self.cfg.name,
                 self.cfg.objective)
        if reg.message:
            log.info("%s", reg.message)

    def _register(self) -> None:
        reg = self.client.register(self.opts.block, self.data.fingerprint(), p2p_key=self.engine.register_key())
        self._setup(reg)
        weights = trainable_state(self.block)  # what a group averages: the delta, and the moments this run shares
        like = {**weights, **{p + n: torch.zeros_like(t) for p in self.inner_start.shares for n, t in weights.items()}}
        self.engine.joined(reg.p2p, self.k, weights, like)

    # --- weights ---------------------------------------------------------------
    def _sync(self, work: WorkAnswer) -> None:
        self._set_base(*fetch_version(self.client, self.engine, self.k, self.shapes, work, self.base, self.base_version))

    def _set_base(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.base = weights
        self.base_version = version
        self.base_sha = tensors_sha256(weights)
        load_trainable(self.block, weights)
        self.engine.offer(self.k, version, self.base_sha, weights)

    # --- training ----------------------------------------------------------------
    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat > self.lease_s / 3:
            self._last_beat = now
            try:
                self.client.heartbeat()
            except ProtocolError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _train_round(self, work: WorkAnswer) -> bool:
        """H local steps on this round's stream; False if abandoned."""
        frozen = self._frozen(work)
        if self.objective.inherits():  # frozen heads from the earlier blocks (stack variants); trainable weights untouched
            self.objective.inherit(self.block, self.k, self.frozen.whole, at_init=False)
        stream = TrainStream(self.train.data, self.cfg.model.context, self.cfg.train.batch_size, work.seed,
                             stream=work.stream, device=self.device)
        H = min(self.H, work.steps)  # at most the round's budget
        self._claim_cap = work.steps * work.batch  # what one member of a group may claim (the coordinator's check)
        # as the coordinator asks: fresh moments, its own carried, or the published ones (else its own go on); a round
        # whose push does not count is undone to here (coordinator.lineage derives an audited round's moments so)
        self._undo = (self.inner.snapshot(), self._moments_version, self._kept_version)
        self.inner.begin(self._published_moments() if self.inner.shares else None)
        self.round_state = self.inner.committed(self.feedback.residual)  # committed with the push
        # A slow worker trains what fits before the round's deadline (at least one step) and pushes that:
        # its update counts, weighted by the samples behind it, instead of arriving stale.
        # The deadline counts from the work answer, not from here: the frozen blocks and moments fetched since took
        # some of it. An open round past its deadline (held for its audits) gets one step, not an unbounded round.
        self._deadline_at = self._work_at + work.deadline_in
        stop_at = self._deadline_at - self._push_margin() - self.engine.reserve_s()
        self.steps_done = 0
        round_hook = _RoundHook(self, stop_at, H)
        bar = tqdm(total=H, desc=f"block {self.k} v{self.base_version}", unit="step", disable=not self.opts.progress,
                   dynamic_ncols=True, leave=False)

        # the block's own schedule position: rounds done on it (its version) x H, whatever this worker did before
        offset = max(self.base_version, 0) * self.round_steps
        try:
            train_round(BlockTask(self.objective, self.k, frozen, self.device), self.block, self.inner.opt, stream, steps=H,
                        offset=offset, schedule=self.schedule, precision=self.precision,
                        hooks=[round_hook, ProgressHook(bar)], targets=self.targets)
        finally:
            bar.close()
        return not round_hook.abandoned

    def _published_moments(self) -> dict[str, torch.Tensor] | None:
        """The inner moments to start this round from, checked, each publication once (None: its own go on).

        Moments are published with every ``moment_every``-th version (:func:`shares_moments` of the round before);
        a worker loads the newest published at or before its base version unless it has kept a round of this block
        since they were published (then its own moments go on): those of its base version when it is one, and the
        newest before it when it joined between two shares. A coordinator derives an audited round's moments by
        this rule (``coordinator.lineage``)."""
        v = self.base_version
        at = v - v % self.moment_every  # the newest version published with moments, at or before v
        if at <= 0 or at == self._moments_version or self._kept_version >= at:
            return None  # none published yet, loaded already (its state still holds them), or its own moments go on
        try:
            tensors, meta = unpack(self.client.moments(self.k, at), source="moments")
        except ProtocolError as exc:
            if exc.status == 404:  # none published with v: its own state goes on
                return None
            raise
        except CheckpointError as exc:
            raise ProtocolError(502, f"the coordinator's moments of block {self.k} version {at} could not be read: "
                                f"{exc}", Reason.MOMENTS) from exc
        if meta.get("block_index") != str(self.k) or meta.get("version") != str(at):
            raise ProtocolError(502, f"the coordinator sent moments of block {meta.get('block_index')} version "
                                f"{meta.get('version')} for block {self.k} version {at}", Reason.MOMENTS)
        self._moments_version = at
        return parse_moments(tensors, self.shapes, self.inner_start.shares, self.moment_codec)

    def _push_margin(self) -> float:
        """Seconds kept free before a deadline: a step that starts just before the stop still runs (the slowest step
        of this round), then the push is packed and sent (twice their recent time; at least half a second)."""
        return max(0.5, 2.0 * self._push_s.recent()) + self._step_s.recent()

    def _frozen(self, work: WorkAnswer) -> list[torch.nn.Module]:
        """The verified frozen copies of the blocks this block reads (fetched once per published version)."""
        refs = list(work.frozen)
        if len(refs) != self.objective.frozen_inputs(self.k):
            raise ProtocolError(
                502, f"the coordinator names {len(refs)} frozen inputs for block {self.k}, which reads "
                f"{self.objective.frozen_inputs(self.k)}; check that it runs the same BlockTrain version", Reason.FROZEN,
            )
        before = self.frozen.downloads
        modules = self.frozen.ensure(refs)
        self.summary.frozen_downloads += self.frozen.downloads - before
        return modules

    def _delta(self) -> tuple[dict[str, torch.Tensor], int]:
        """What this round trained: Delta = W_local - W_v, and the sequences behind it (steps x batch)."""
        assert self.base is not None
        local = trainable_state(self.block)
        return {n: local[n] - self.base[n] for n in self.base}, self.steps_done * self.cfg.train.batch_size

    def _push(self, unsent: tuple[dict[str, torch.Tensor], int] | None = None) -> None:
        """Push this round's delta (or its group's mean); ``unsent``: the delta and samples of a round whose group
        mean did not land, pushed alone before its deadline."""
        assert self.base is not None
        t_pack = time.monotonic()
        own: tuple[dict[str, torch.Tensor], int] | None = None  # this worker's own delta and samples, where it uploads a mean
        if unsent is None:
            delta, samples = self._delta()
            # on a sharing round its moments travel with the delta
            delta.update(self.inner.moments(self.inner_start.shares_at(self.base_version, self.moment_every)) or {})
            if not all_finite(delta.values()):  # once a round
                self._diverged()
                return
            clock = RoundClock(self._deadline_at - self._push_margin() - self.engine.reserve_s(), self.lease_s,
                               self._beat)
            t_combine = time.monotonic()
            combined = self.engine.combine(delta, samples, self.k, self.base_version, clock, self._claim_cap)
            t_pack += time.monotonic() - t_combine  # waiting for peers and averaging: reserve_s, not the push's time
            if combined is None:  # another member of its group uploads the mean; kept in case it never lands
                self._unsent = (self.base_version, delta, samples)
                load_trainable(self.block, self.base)
                self._kept_version = self.base_version
                return
            own = (delta, samples)
        else:
            combined = Combined(*unsent)
        self._unsent = None
        group = combined.members
        samples = combined.samples
        delta = {n: t for n, t in combined.delta.items() if not n.startswith(self.inner_start.shares)}
        moments = {n: t for n, t in combined.delta.items() if n not in delta} or None
        residual = self.feedback.residual  # what the error feedback carried before this push, restored if refused
        payload = pack_delta(delta, self.opts.compression, block=self.k, base_version=self.base_version,
                             base_sha=self.base_sha, samples=samples, feedback=self.feedback,
                             group=group,
                             state_sha=None if group else state_sha(self.round_state), precision=self.precision.value,
                             moments=moments, moment_codec=self.moment_codec if moments is not None else None)
        packing = time.monotonic() - t_pack
        try:
            try:
                answer = self.client.push(self.k, payload, timed=lambda s: self._push_s.add(packing + s))
            except ProtocolError as exc:
                # a refused push sent nothing: its quantisation error is not carried, nor do its moments go on (an
                # audit bounds the residual by this worker's last accepted pushes and derives its moments from the
                # rounds they came from: coordinator.audit, coordinator.lineage)
                self.feedback.residual = residual
                if group is not None and own is not None and mean_refusal_keeps_own(exc):
                    # its own delta is kept, pushed alone as the deadline nears, as every other member keeps its own
                    # (else this round's training never counts); the refusal is not counted toward --max-rejections
                    self._unsent = (self.base_version, *own)
                    self._kept_version = self.base_version  # as a member whose mean another uploads (its round counts)
                    log.warning("block %d v%d: the group's mean was refused (%s); its own delta goes alone before the "
                                "deadline", self.k, self.base_version, exc)
                    return
                if not (unsent is not None and exc.reason == Reason.DUPLICATE):  # its group's mean landed meanwhile:
                    self._undo_round()                                        # the round counts (lineage), so its
                                                                              # moments go on
                self._refused_push(exc)
                return
            self._kept_version = self.base_version
            self.summary.rounds_pushed += 1
            self.summary.groups_uploaded += group is not None
            log.info("block %d: pushed a %d-byte delta against v%d (%d local steps so far)",
                     self.k, len(payload), self.base_version, self.summary.local_steps)
            self._rejections = 0
            if answer.audit:  # after the push was taken: whatever its audit meets, the residual stays this push's
                self._answer_audit()
        finally:
            load_trainable(self.block, self.base)  # the local copy restarts from the published version

    def _undo_round(self) -> None:
        """This round does not count: its inner state, its loaded moments and the version of its newest round that
        counts go back to where the round began (a member whose group's mean was to count had moved the last on, and
        a refused push left it there, so the moments published in its window were never loaded)."""
        snapshot, self._moments_version, self._kept_version = self._undo
        self.inner.restore(snapshot)

    def _diverged(self) -> None:
        """This round's training ended in NaN or infinite values: nothing is pushed (int8 encoded NaN as 0 and kept it
        in the error feedback's residual, which then failed this worker's next audit), the round is undone, and it
        counts toward --max-rejections."""
        assert self.base is not None
        self._undo_round()
        load_trainable(self.block, self.base)
        self._refused_push(ProtocolError(  # counted as a refused push: the same round trained again would diverge again
            422, f"block {self.k} v{self.base_version}: training diverged to NaN or infinite values; nothing was pushed "
            "(if it recurs, train in fp32: --precision fp32)", Reason.NON_FINITE))

    def _refused_push(self, exc: ProtocolError) -> None:
        """A refused push: a stale one waits for the new version; another counts toward --max-rejections."""
        if exc.status == 409:
            self.summary.rounds_stale += 1
            log.warning("block %d: delta against v%d refused (%s); pulling the new version", self.k, self.base_version,
                        exc)
            return
        if exc.reason == Reason.AUDITS_BUSY:  # its audit could not be drawn for want of room: sent again next round
            self.summary.rounds_stale += 1
            log.warning("block %d: the coordinator has no room to audit the push against v%d (%s); training the next "
                        "round", self.k, self.base_version, exc)
            return
        if exc.reason == Reason.RATE_LIMITED:  # the coordinator judged nothing (its own quarantine judges conduct):
            self.summary.rounds_stale += 1     # stale pushes of a slow worker in short rounds come to this too
            log.warning("block %d: the coordinator is refusing this worker's requests for a while (%s); waiting "
                        "before the next round", self.k, exc)
            self.abandon.wait(RATE_LIMIT_WAIT_S)
            return
        if exc.status >= 500:
            raise exc
        self._rejections += 1
        self._refused = (self.k, self.base_version)  # the same round trained again would push the same update
        log.error("block %d: update rejected: %s; waiting for the next version", self.k, exc)
        if self._rejections >= self.opts.max_rejections:
            raise exc

    def _answer_audit(self) -> None:
        """Upload the inner state this round's push committed to; the coordinator replays the round before it
        answers. A 404 means it no longer awaits it (an earlier try reached it and its answer was lost); no answer in
        time (the replay outlasted the client's wait, or the link dropped) leaves the outcome to the coordinator,
        which decides on the audit either way: the worker goes on, and its next request finds out whether the
        coordinator is still there."""
        if self.abandon.is_set():  # the second signal came during the push: no state to pack and send
            log.warning("block %d v%d: leaving before the audit upload; the coordinator decides on it", self.k,
                        self.base_version)
            return
        try:
            result = self.client.audit(self.k, self.base_version,
                                       pack_state(self.round_state, block=self.k, version=self.base_version))
        except ProtocolError as exc:
            if exc.reason in (Reason.UNREACHABLE, Reason.STOPPED):  # no answer in time, or the worker is leaving
                log.warning("block %d v%d: no answer to the audit upload (%s); the coordinator decides on it",
                            self.k, self.base_version, exc)
                return
            if exc.status >= 500 or exc.status in (401, 403):  # its fault, or this worker may no longer work
                raise
            # 404: an earlier try reached it and its answer was lost; another refusal (408 on a slow link, ...) is
            # logged: the push stays accepted and the coordinator decides on its audit as it does without an upload
            log.warning("block %d v%d: the audit upload was refused (%s)", self.k, self.base_version, exc)
            return
        self.summary.audits += 1
        log.info("block %d v%d: audited; the coordinator's replay %s (relative error %.2g, %.1f s)", self.k,
                 self.base_version, "matched" if result.passed else "did NOT match", result.relative_error,
                 result.seconds)

    # --- main loop ------------------------------------------------------------------
    def run(self) -> WorkerSummary:
        self._rejections = 0
        waiting = False  # the last work answer said our block is waiting (logged once)
        try:
            self._register()
            while not self.stop.is_set() and not self.abandon.is_set():
                if self.engine.token_due():  # its DHT token nears its end: a new one, the session going on
                    self._renew_p2p()
                try:
                    work = self.client.work()
                    self._work_at = time.monotonic()  # when deadline_in was true: downloads after it count against it
                except ProtocolError as exc:
                    if exc.reason == Reason.NOT_REGISTERED:
                        self._register()
                        continue
                    raise
                if work.finished:
                    log.info("block %d has finished its rounds", self.k)
                    break
                self.engine.revoke(work.revoked)  # whose group cards no longer count (hivemind)
                if work.block != self.k:
                    log.info("reassigned from block %d to %d", self.k, work.block)
                    self._register()
                    continue
                if work.version != self.base_version or work.weights_sha != self.base_sha:
                    self._synced(work)  # a new version, or version 0 replaced by a warm start as the block opened
                    continue
                if self._unsent is not None and (self._unsent[0] != work.version or work.submitted):
                    self._unsent = None  # the group's mean landed, or its round closed without it
                if self._alone_now(work):
                    continue
                if self._unsent is not None:  # its group's mean not there yet: asked often, not to miss the deadline
                    self.abandon.wait(self.opts.poll_s)
                    continue
                if work.round_state is RoundState.WAITING and not waiting:  # a waiting block, or one warming up
                    log.info("%s", work.message or f"block {self.k} is waiting for earlier blocks to finish")
                waiting = work.round_state is RoundState.WAITING
                if (work.round_state is not RoundState.OPEN or work.submitted or self.engine.waits_for_peers(work.version)
                        or self._refused == (work.block, work.version)):
                    self._await_next(work.version)
                    continue
                if not self._train_round(work):
                    break
                self._push()
                if self.engine.waits_for_peers(self.base_version):  # another member sent our mean: no need to ask yet
                    self._await_next(self.base_version)
        finally:
            self._leave()
        self.summary.bytes_sent = self.client.bytes_sent
        self.summary.bytes_received = self.client.bytes_received
        if isinstance(self.engine, HivemindEngine):
            self.summary.peer_pulls, self.summary.rounds_grouped = self.engine.peer_pulls, self.engine.rounds_grouped
        return self.summary

    def _synced(self, work: WorkAnswer) -> None:
        """:meth:`_sync`, asked again (at most SYNC_TRIES times in a row) when the weights served are not the version
        the work answer named: the block may have moved on, or version 0 been replaced by a warm start, between the
        two requests."""
        try:
            self._sync(work)
            self._sync_misses = 0
        except ProtocolError as exc:
            self._sync_misses += 1
            if exc.reason != Reason.BASE or self._sync_misses >= SYNC_TRIES:
                raise
            log.warning("block %d: %s; asking for work again", self.k, exc)
            self.abandon.wait(self.opts.poll_s)

    def _alone_now(self, work: WorkAnswer) -> bool:
        """Whether it pushed alone now the delta of a round whose group mean has not landed as its deadline nears
        (its uploader left, was refused, or never sent it): else that round's training would never count."""
        if (self._unsent is None or work.round_state is not RoundState.OPEN  # (a landed mean cleared it: run())
                or work.deadline_in > self._push_margin() + 2 * self.opts.poll_s):
            return False
        _, delta, samples = self._unsent
        log.warning("block %d v%d: its group's mean has not reached the coordinator %.1f s before the deadline; "
                    "pushing its own delta", self.k, self.base_version, work.deadline_in)
        self._deadline_at = self._work_at + work.deadline_in
        self.summary.rounds_alone += 1
        self._push((delta, samples))
        return True

    def _renew_p2p(self) -> None:
        """A new DHT token from the coordinator, two days before its own expires: an answer that gives none (an older
        release: 404; a lapsed lease: 409, which the next work request settles by registering again; a token not
        taken, 502) is asked again later; only a worker that may no longer work (401, 403) ends."""
        try:
            self.engine.renew(self.client.p2p_token().p2p)
        except ProtocolError as exc:
            if exc.status in (401, 403):
                raise
            log.warning("block %d: no new hivemind token from the coordinator (%s); asking again later", self.k, exc)

    def _await_next(self, v: int) -> None:
        """Wait before asking the coordinator for work again (as the averaging engine says)."""
        self.engine.wait_next(self.k, v, self.opts.poll_s, self.lease_s, self.abandon)

    def _leave(self) -> None:
        self.engine.close()
        try:
            self.client.leave()
        except ProtocolError as exc:
            log.warning("could not tell the coordinator we leave: %s", exc)
        self.client.close()


RATE_LIMIT_WAIT_S = 10.0  # seconds a rate-limited worker waits before it asks again (the coordinator's window: 60 s)
SYNC_TRIES = 3  # fetches in a row of weights that are not the version named before the worker gives up


class Recent:
    """The largest of the last ``n`` durations (seconds; 0 before any): one slow outlier (a first step that compiles, a
    push retried through an outage) stops counting after ``n`` more, where a running maximum kept it for good."""

    def __init__(self, n: int = 8) -> None:
        self._last: deque[float] = deque(maxlen=n)

    def add(self, seconds: float) -> None:
        self._last.append(seconds)

    def recent(self) -> float:
        return max(self._last, default=0.0)


class _RoundHook(Hook):
    """The worker's side of a round in the loop: leaves on abandon, stops near the deadline, heartbeats, counts steps."""

    def __init__(self, worker: Worker, stop_at: float, H: int) -> None:
        self.worker = worker
        self.stop_at = stop_at  # time.monotonic() after which no new step starts
        self.H = H
        self.abandoned = False
        self._began = 0.0  # time.monotonic() as the current step began

    def before(self, step: int) -> bool:
        w = self.worker
        if w.abandon.is_set():
            self.abandoned = True
            return False
        w._beat()  # first: a heartbeat the coordinator is slow to answer counts against the deadline
        if step > 0 and time.monotonic() > self.stop_at:
            w.summary.rounds_cut += 1
            log.info("block %d v%d: the deadline is near; pushing after %d of %d steps", w.k, w.base_version, step, self.H)
            return False
        self._began = time.monotonic()
        return True

    def after(self, rec: StepRecord) -> None:
        self.worker._step_s.add(time.monotonic() - self._began)
        self.worker.summary.local_steps += 1
        self.worker.steps_done = rec.done
